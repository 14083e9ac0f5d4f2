#!/usr/bin/env bash
# The third wave's GPU questions (issues 40, 41, 42) in few device calls; each part writes JSON under $OUT.
# Carries .whl (bash benchmarks/device_wheels.sh). Usage on the device: bash benchmarks/gpu_wave3.sh PART...
# parts: env server memory memory4b lora moe
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_wave3_out}; mkdir -p "$OUT"
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; } || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
log() { echo "[$(date +%T)] $*"; }
quiet() { grep -v -i -E "warn|it/s"; }
for part in "$@"; do
  log "== $part"
  case $part in
    env) { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
           python3 -c "import torch, transformers, megatron.core as m; print(torch.__version__, torch.version.cuda, transformers.__version__, m.__version__)"; } 2>&1 | quiet | tee "$OUT/env.txt" ;;
    server)  # issue 40: in-process engine vs `python -m agentrl.engine` over HTTP, Qwen2-0.5B bf16, c=128/256
      timeout 210 python3 benchmarks/engine_server_bench.py --device cuda --shape qwen2-0.5b --concurrency 128 256 \
        --out "$OUT/engine_server_bench.json" 2>&1 | quiet | tail -12
      # the HTTP rows with admission before every step (the behaviour before grouped admission)
      timeout 130 python3 benchmarks/engine_server_bench.py --device cuda --shape qwen2-0.5b --concurrency 128 256 \
        --sides http --admit-wait-ratio 0 --out "$OUT/engine_server_bench_ratio0.json" 2>&1 | quiet | tail -8 ;;
    memory)  # issue 41: chunked log-prob kernels on CUDA; 1.5B full fine-tune at 8k tokens/micro-batch
      timeout 50 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_fused_logprobs.py 2>&1 | tail -3 | tee "$OUT/fused_logprobs_cuda.txt"
      timeout 100 python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --dtype bfloat16 --seq-len 2048 \
        --seqs-per-microbatch 4 --microbatches 2 --steps 3 --attention sdpa --out "$OUT/trainer_1.5b_8k_norecompute.json" 2>&1 | quiet | tail -4
      timeout 70 python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --dtype bfloat16 --seq-len 2048 \
        --seqs-per-microbatch 4 --microbatches 2 --steps 2 --attention sdpa --recompute selective --recompute-modules mlp \
        --out "$OUT/trainer_1.5b_8k_selective_mlp.json" 2>&1 | quiet | tail -4 ;;
    memory4b)  # issue 41: a 3.7B (Qwen3-4B widths) full fine-tune at 8k tokens with Adam offloaded to the CPU
      timeout 130 python3 benchmarks/trainer_bench.py --device cuda --shape 4b --dtype bfloat16 --seq-len 2048 \
        --seqs-per-microbatch 4 --microbatches 1 --steps 2 --attention sdpa --optimizer-offload --recompute selective \
        --recompute-modules mlp --out "$OUT/trainer_4b_8k_offload.json" 2>&1 | quiet | tail -4 ;;
    lora)  # issue 41: Qwen2-7B shape with LoRA r16 at 8k tokens/micro-batch; adapter bytes per sync on 0.5B
      timeout 240 python3 benchmarks/lora_bench.py --device cuda --shape qwen2-7b --dtype bfloat16 --rank 16 --seq-len 8192 \
        --seqs-per-microbatch 1 --microbatches 2 --steps 3 --train-only --out "$OUT/lora_train_qwen2-7b_8k.json" 2>&1 | quiet | tail -5
      timeout 100 python3 benchmarks/lora_bench.py --device cuda --shape qwen2-0.5b --dtype bfloat16 --rank 16 --sync-only \
        --out "$OUT/lora_sync_qwen2-0.5b_r16.json" 2>&1 | quiet | tail -3 ;;
    moe)  # issue 42: a Qwen3-MoE shape scaled to one card: engine vs HF generate at c=128, a train step, the replay gap
      timeout 150 python3 benchmarks/moe_gpu_bench.py --device cuda --shape qwen3-moe-scaled --dtype bfloat16 --parts generate \
        --concurrency 128 --prompt-len 256 --new-tokens 128 --out "$OUT/moe_generate.json" 2>&1 | quiet | tail -6
      timeout 120 python3 benchmarks/moe_gpu_bench.py --device cuda --shape qwen3-moe-scaled --dtype bfloat16 --parts train \
        --train-seqs 8 --train-len 1024 --out "$OUT/moe_train.json" 2>&1 | quiet | tail -4
      timeout 80 python3 benchmarks/moe_gpu_bench.py --device cuda --shape qwen3-moe-scaled --dtype bfloat16 --parts gap \
        --gap-samples 8 --prompt-len 256 --new-tokens 128 --out "$OUT/moe_gap.json" 2>&1 | quiet | tail -3 ;;
    *) echo "unknown part $part" ;;
  esac
done
log "done"
