#!/usr/bin/env bash
# helper "lora" (issue 41), one H100 call, <= 200 s. Runs from the repo root; writes under $OUT/lora/.
# (a) 1.5B full fine-tune at 8k tokens per micro-batch, four batch shapes in one process (baseline first);
# (b) Qwen2-7B-shape LoRA r16 at 8k tokens/micro-batch with an embedded engine colocated (released while
#     the trainer steps, resumed for generation): device memory per component and phase;
# (c) if time is left: the CUDA test that a release frees the engine's LoRA base copy.
set -uo pipefail
# Needs .whl carried (bash benchmarks/device_wheels.sh), installed exactly as benchmarks/gpu_wave3.sh does.
OUT=${OUT:?}; mkdir -p "$OUT/lora"
D=$OUT/lora
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; } || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
log() { echo "[$(date +%T) +${SECONDS}s] $*"; }
quiet() { grep -v -i -E "warn|it/s|Loading weights|Writing model|^\s*$"; }
log "== env"
{ timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  timeout 30 python3 -c "import torch, transformers, megatron.core as m; print(torch.__version__, torch.version.cuda, transformers.__version__, m.__version__)"
  df -h /dev/shm /tmp 2>/dev/null | tail -2; } 2>&1 | quiet | tee "$D/env.txt"

log "== (a) 1.5B full fine-tune, setups LEN x SEQS/ubatch x ubatches/step"
timeout 70 python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --dtype bfloat16 --attention sdpa \
  --steps 3 --phases --setups 2048x4x2 8192x1x8 2048x4x8 8192x1x2 --out "$D/trainer_1.5b_setups.json" 2>&1 | quiet \
  | grep -v "^shape " | tail -16
log "rc=$?"

log "== (b) Qwen2-7B shape LoRA r16, 8k tokens/ubatch x2, engine colocated"
timeout 115 python3 benchmarks/lora_bench.py --device cuda --shape qwen2-7b --dtype bfloat16 --rank 16 --seq-len 8192 \
  --seqs-per-microbatch 1 --microbatches 2 --steps 2 --colocate --gen-requests 8 --prompt-len 512 --new-tokens 32 \
  --out "$D/lora_colocate_qwen2-7b_8k.json" 2>&1 | quiet | tail -45
log "rc=$?"

left=$((195 - SECONDS))
if [ "$left" -gt 25 ]; then
  log "== (c) CUDA: a release frees the engine's LoRA base copy (${left}s left)"
  timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/engine/test_lora_engine.py -k cuda 2>&1 | tail -3 \
    | tee "$D/test_lora_engine_cuda.txt"
else
  log "(c) skipped: ${left}s left"
fi

log "== summary"
timeout 15 python3 - "$D" <<'PY' 2>&1 | quiet
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
try:
    rows = json.loads((d / "trainer_1.5b_setups.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    print(f"{'setup':<10} {'step s':>7} {'tok/s':>7} {'of mm peak':>10} {'peak GiB':>8}  phases")
    for r in rows:
        if "error" in r:
            print(f"{r.get('seq_len')}x?x{r.get('microbatches')} ERROR {r['error'][:100]}")
            continue
        ph = r.get("phases_s") or {}
        print(f"{r['seq_len']}x{r['seqs_per_microbatch']}x{r['microbatches']:<4} {r['step_s']:>7.3f} {r['tokens_per_s']:>7.0f} "
              f"{100 * r['mfu_of_matmul_peak']:>9.1f}% {r['peak_mem_gib']:>8.2f}  "
              + " ".join(f"{k}={ph[k]}" for k in ("forward", "backward", "optimizer", "other") if k in ph))
except Exception as e:
    print("1.5B: no result:", e)
try:
    c = json.loads((d / "lora_colocate_qwen2-7b_8k.json").read_text())["colocate"]
    print("7B colocate:", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in c.items()
                           if k not in ("memory_points", "timings_s")})
except Exception as e:
    print("7B colocate: no result:", e)
PY
log "done"
