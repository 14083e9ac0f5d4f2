set -uo pipefail; OUT=${OUT:?}; mkdir -p $OUT/engine
# helper "engine" (issue 40): engine_gpu_bench in-process AND engine_server_bench (in-process + HTTP server) on the
# same card, after the fixes of commits 5560765 2feab9b 54bffd0 8562cad (prefix cache scans, one-store KV, no short cached
# prefixes / cached rows prefilled apart, every bucket captured at start); doubles as the profile: per-step split of the worker's time.
# Both benches now print a per-step split of the engine worker's time (Scheduler.stats(): busy, device wait in
# collect, host = busy - wait - admissions - captures; admissions and rows per admission; graph captures; eager
# steps; host writes of captured inputs; pipelined fraction) and write per-step traces under $OUT/engine/traces.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; } || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
E=$OUT/engine; T=$E/traces; mkdir -p $T
log() { echo "[$(date +%T)] $*"; }
log "card: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1); commit $(git rev-parse --short HEAD 2>/dev/null)"
# 1. engine_gpu_bench's own path (all requests submitted at once, prefix cache off), c=128 and 256, no HF anchors
log "== engine_gpu_bench c=128 256"
timeout 80 python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b --concurrency 128 256 --hf-modes \
  --trace-dir $T --out $E/gpu_bench.json > $E/gpu_bench.log 2>&1; echo "rc=$?"
grep -E "^(run |engine_|qwen2|shape )" $E/gpu_bench.log | tail -8
grep -i -E "Traceback|Error|failed" $E/gpu_bench.log | grep -v -i warn | head -5
# 2. engine_server_bench, long shape (512 in / 256 out), in-process and over HTTP, c=128 and 256
log "== engine_server_bench long+short c=128 256"
timeout 145 python3 benchmarks/engine_server_bench.py --device cuda --shape qwen2-0.5b --concurrency 128 256 \
  --workloads long short --trace-dir $T --out $E/server_bench.json > $E/server_bench.log 2>&1; echo "rc=$?"
grep -v -i -E "warn|it/s" $E/server_bench.log | tail -22
grep -i -E "Traceback|Error|failed" $E/server_bench.log $T/*.log 2>/dev/null | grep -v -i warn | head -8
# 3. a compact view of the traces: admissions (rows, ms) and steps per phase
python3 - "$T" <<'EOF' 2>&1 | tail -40
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "trace_*.json"))):
    tr = json.load(open(f))
    adm = [r for r in tr if r[0] == "admit"]
    steps = [r for r in tr if r[0] != "admit"]
    d = sorted(r[2] for r in steps) or [0]
    big = sorted(steps, key=lambda r: -r[2])[:5]
    print(f"{os.path.basename(f)}: {len(steps)} steps, p50 {1e3*d[len(d)//2]:.2f} ms, p90 {1e3*d[int(.9*len(d))]:.2f}, "
          f"max {1e3*d[-1]:.1f}; span {tr[-1][1]+tr[-1][2]:.3f} s")
    print("  admissions (t s, ms, rows):", [(round(r[1], 3), round(1e3*r[2], 1), r[3]) for r in adm][:14])
    print("  slowest steps (t s, ms, rows, queued):", [(round(r[1], 3), round(1e3*r[2], 1), r[3], r[4]) for r in big])
    rows = [r[3] for r in steps]
    print("  rows over the run (every 32nd step):", rows[::32])
EOF
log "done"
