"""GPU check of the colocated path: trainer and embedded engine share one GPU; weights go over CUDA IPC.

Builds the tiny model, starts an embedded engine on CUDA, then for K rounds perturbs the weights on the
GPU (standing in for optimizer steps), syncs them with ``TensorSync(transport="cuda_ipc")`` and compares
the engine's ``/weights_checksum`` with the local one (bitwise). Prints one JSON line and writes it to
``--out``. Needs CUDA; run on the GPU machine::

    python3 benchmarks/cuda_sync_check.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/cuda_sync_check.json")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.engine.launch import EngineProcess
    from agentrl.engine.weight_loading import weights_checksum
    from agentrl.models.tiny import make_tiny_model
    from agentrl.weights.tensor_sync import TensorSync

    if not torch.cuda.is_available():
        print("cuda_sync_check needs CUDA", file=sys.stderr)
        return 2
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir).cuda()
    rounds = []
    with EngineProcess(model_dir, extra_args=["--device", "cuda"]) as engine:
        engine.wait_healthy(300)
        sync = TensorSync([engine.url], transport="cuda_ipc")
        for k in range(1, args.rounds + 1):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 1e-3)
            named = list(model.state_dict().items())
            report = sync.sync(named, f"ipc-{k}")
            with urllib.request.urlopen(engine.url + "/weights_checksum") as r:
                remote = json.loads(r.read())
            local = weights_checksum((n, t.cpu()) for n, t in named)
            # every parameter the engine holds must carry exactly the trainer-side bits
            same = {n: local["parameters"].get(n) == d for n, d in remote["parameters"].items()}
            rounds.append({"round": k, "bitwise_equal": all(same.values()), "seconds": report.seconds,
                           "bytes_sent": report.bytes_sent, "weight_version": remote["weight_version"],
                           "transport": report.details.get("transport")})
            time.sleep(0.1)
        sync.close()
    result = {"device": torch.cuda.get_device_name(), "rounds": rounds,
              "all_bitwise_equal": all(r["bitwise_equal"] for r in rounds)}
    print(json.dumps(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if result["all_bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
