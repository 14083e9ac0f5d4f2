#!/usr/bin/env bash
# Issue 20's GPU benchmarks in one device call (one H200): each writes its JSON and log under $OUT, which
# come back to benchmarks/results/. Carries .whl (bash benchmarks/device_wheels.sh: megatron-core, fastapi and friends, zstandard; .whl/hf:
# transformers 5.x if the image's is older). Usage on the device: bash benchmarks/gpu_suite.sh [parts...]
# parts: env logprobs englogprobs engine engine2 engine3 engprof engab engpdl engkern eng15 engpf engtune trainer trainer-before trainer-fp32lp trainer-unfused trainer-fused delta ipc
# packing (default: env logprobs
# engine trainer delta ipc packing); engine2: the CUDA-graph
# engine against the warm HF anchors (0.5B) and on 1.5B, the second run of 2026-12-02; engine3: the 0.5B
# engine (timed warm) against warm HF static generate at c=1/128, the shortest call that answers the goals.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_suite_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
if ! python3 -c "import transformers, sys; sys.exit(int(transformers.__version__.split('.')[0]) < 5)" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/hf/*.whl
fi
parts=${*:-env logprobs engine trainer delta ipc packing}
log() { echo "[$(date +%T)] $*"; }
for part in $parts; do
  log "== $part"
  case $part in
    env)
      { nvidia-smi; python3 -c "import torch, transformers, megatron.core as m; print(torch.__version__, torch.version.cuda, transformers.__version__, m.__version__)"; } 2>&1 | tee "$OUT/env.txt" ;;
    logprobs)
      timeout 180 python3 -m pytest -q -p no:cacheprovider tests/engine/test_logprobs.py tests/engine/test_static_kv.py \
        tests/engine/test_attention.py tests/engine/test_fused_decoder.py tests/weights/test_delta_diff.py \
        tests/trainer/test_fast_optimizer.py \
        tests/trainer/test_fused_logprobs.py \
        2>&1 | tail -5 | tee "$OUT/logprobs_cuda.txt" ;;
    engine)
      timeout 330 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b qwen2-1.5b \
        --concurrency 1 32 128 256 --out "$OUT/engine_gpu_bench.json" 2>&1 | grep -v -i warn | tail -25 ;;
    engine2)
      timeout 300 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b qwen2-1.5b \
        --concurrency 1 32 128 256 --engine-modes static --hf-modes static eager --hf-shapes qwen2-0.5b \
        --hf-concurrency 1 128 --out "$OUT/engine_gpu_bench.json" 2>&1 | grep -v -i -E "warn|it/s" | tail -30 ;;
    engine3)
      timeout 200 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b \
        --concurrency 1 32 128 256 --engine-modes static --hf-modes static --hf-concurrency 1 128 \
        --out "$OUT/engine_gpu_bench.json" 2>&1 | grep -v -i -E "warn|it/s" | tail -16 ;;
    englogprobs)  # the engine's log-prob tests alone (the fused decode step's included) on CUDA
      timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/engine/test_logprobs.py tests/engine/test_static_kv.py \
        tests/engine/test_attention.py tests/engine/test_model_runner.py tests/engine/test_sampling.py \
        tests/engine/test_fused_decoder.py 2>&1 | tail -40 | tee "$OUT/logprobs_cuda.txt" ;;
    eng15)  # the 1.5B rows (engine3's columns on qwen2-1.5b)
      timeout 300 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-1.5b \
        --concurrency 1 32 128 256 --engine-modes static --hf-modes static --hf-concurrency 1 128 \
        --out "$OUT/engine_gpu_bench_1.5b.json" 2>&1 | grep -v -i -E "warn|it/s" | tail -16 ;;
    engpf)  # A/B at c=128: two prefill chunks of 32,768 tokens (the benchmark's default until 2026-12-04) instead
      # of one of all 128 prompts (65,536 tokens, the default since)
      timeout 120 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b --concurrency 128 \
        --engine-modes static --hf-modes --max-prefill-tokens 32768 --out "$OUT/engine_ab_prefill2.json" 2>&1 \
        | grep -v -i -E "warn|it/s" | tail -4 ;;
    engtune)  # the decode attention's and the sampler's launch swept at 128 rows (in CUDA graphs), then engine3's
      # rows with the fastest of each and all 128 prompts in one prefill, against the defaults at c=1/128
      timeout 240 python3 benchmarks/decode_kernels_bench.py --tune --rows 128 --out "$OUT/decode_tune.json" 2>&1 \
        | grep -v -i warn | tail -3
      read -r ATTN SAMP < <(python3 -c "
import json; rows = json.load(open('$OUT/decode_tune.json'))['rows']
best = lambda kind: min((r for r in rows if r['kind'] == kind and 'warps' in r), key=lambda r: r['us'])
a, s = best('attention'), best('sample')
import sys; [print(r['kind'], r['variant'], round(r['us'], 1), file=sys.stderr) for k in ('attention', 'sample') for r in sorted((r for r in rows if r['kind'] == k), key=lambda r: r['us'])[:6]]
print(json.dumps({'block_n': a['block_n'], 'num_warps': a['warps'], 'num_stages': a['stages'], 'programs': 256 * a['splits']}, separators=(',', ':')),
      json.dumps({'programs': s['programs'], 'num_warps': s['warps']}, separators=(',', ':')))")
      log "tuned: attention $ATTN sampler $SAMP"
      timeout 200 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b --concurrency 1 32 128 256 \
        --engine-modes static --hf-modes static --hf-concurrency 1 128 --max-prefill-tokens 65536 \
        --attention-launch "$ATTN" --sampler-launch "$SAMP" --out "$OUT/engine_gpu_bench_tuned.json" 2>&1 \
        | grep -v -i -E "warn|it/s" | tail -9
      timeout 100 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b --concurrency 1 128 \
        --engine-modes static --hf-modes --out "$OUT/engine_ab_defaults.json" 2>&1 | grep -v -i -E "warn|it/s" | tail -4 ;;
    engpdl)  # A/B at c=1/128, the engine alone: programmatic dependent launch on (the default) and off, twice
      for variant in "pdl1:" "nopdl1:--no-pdl" "pdl2:" "nopdl2:--no-pdl"; do
        name=${variant%%:*}
        # shellcheck disable=SC2086
        timeout 100 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b --concurrency 1 128 \
          --engine-modes static --hf-modes ${variant#*:} --out "$OUT/engine_ab_$name.json" 2>&1 \
          | grep -v -i -E "warn|it/s" | tail -3 | sed "s/^/$name: /"
      done ;;
    engkern)  # the fused decoder's kernels at decode shapes against what they replace (decode_kernels_bench.py)
      timeout 150 python3 benchmarks/decode_kernels_bench.py --out "$OUT/decode_kernels.json" 2>&1 \
        | grep -v -i warn | tail -12 ;;
    engprof)  # engine3's rows, plus per-phase timings of a decode iteration at c=1/128 (sampling in the
      # captured step, and on the host as before) and torch.profiler tables of short runs
      timeout 480 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b \
        --concurrency 1 32 128 256 --engine-modes static --hf-modes static --hf-concurrency 1 128 --profile 1 128 \
        --out "$OUT/engine_gpu_bench.json" 2>&1 | grep -v -i -E "warn|it/s" | tail -40 ;;
    engab)  # A/Bs of the engine alone at c=1/128: no step or one step queued ahead (default two), without the Triton decode attention
      # (SDPA: cuDNN), host-side sampling, without the compiled ops (and so without the Triton attention);
      # ENGAB overrides the list (e.g. "nofd:--no-fused-decoder nofp:--no-fused-prefill")
      for v in ${ENGAB:-"depth0:--pipeline-depth=0" "depth1:--pipeline-depth=1" "notriton:--no-triton-attention" "hostsample:--no-fused-sampling" "nofused:--no-fused-ops"}; do
        timeout 150 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b --concurrency 1 128 \
          --engine-modes static --hf-modes ${v#*:} --out "$OUT/engine_ab_${v%%:*}.json" 2>&1 \
          | grep -v -i -E "warn|it/s" | tail -4
      done ;;
    trainer)
      timeout 200 python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --dtype bfloat16 --seq-len 2048 \
        --seqs-per-microbatch 4 --microbatches 2 --steps 5 --attention sdpa --variants packed:reuse padded:fresh \
        --profile --phases --out "$OUT/trainer_bench_cuda_1.5b_packed.json" 2>&1 | grep -v -i warn | tail -42 ;;
    trainer-before)  # the A/B's before: Megatron's per-tensor fallbacks and foreach AdamW, fp32 log-probs, unfused SwiGLU
      timeout 150 python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --dtype bfloat16 --seq-len 2048 \
        --seqs-per-microbatch 4 --microbatches 2 --steps 5 --attention sdpa --variants packed:reuse --phases \
        --megatron-fallbacks --fp32-logprobs --megatron-override bias_activation_fusion=false \
        --out "$OUT/trainer_bench_cuda_1.5b_before.json" 2>&1 | grep -v -i warn | tail -3 ;;
    trainer-fp32lp)  # attribution: everything on but the one-pass log-prob kernel
      timeout 150 python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --dtype bfloat16 --seq-len 2048 \
        --seqs-per-microbatch 4 --microbatches 2 --steps 5 --attention sdpa --variants packed:reuse --phases \
        --fp32-logprobs --out "$OUT/trainer_bench_cuda_1.5b_fp32lp.json" 2>&1 | grep -v -i warn | tail -3 ;;
    trainer-unfused)  # attribution: everything on but the fused SwiGLU
      timeout 150 python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --dtype bfloat16 --seq-len 2048 \
        --seqs-per-microbatch 4 --microbatches 2 --steps 5 --attention sdpa --variants packed:reuse --phases \
        --megatron-override bias_activation_fusion=false \
        --out "$OUT/trainer_bench_cuda_1.5b_unfused.json" 2>&1 | grep -v -i warn | tail -3 ;;
    delta)
      timeout 150 python3 benchmarks/delta_gpu_bench.py --device cuda --shape qwen2-1.5b --changed 0.03 --repeats 15 \
        --out "$OUT/delta_gpu_bench_1.5b.json" 2>&1 | grep -v -i warn | tail -7 ;;
    ipc)
      timeout 200 python3 benchmarks/gpu_sync_check.py --mode ipc --shape qwen2-1.5b --rounds 5 --log-dir /tmp/ipc_logs \
        --release-check --out "$OUT/gpu_sync_ipc_1.5b.json" 2>&1 | grep -v -i warn | tail -24 ;;
    packing)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_packing.py -k "matches_padded or within or bitwise" \
        2>&1 | tail -3 | tee "$OUT/packing_cuda.txt" ;;
  esac
done
log "done"
