"""One ``torchrun --nproc_per_node 2`` launch (gloo, CPU) for every two-rank trainer test that needs it.

Each launch pays torchrun plus two interpreters importing torch, transformers and Megatron (most of the
cost at toy size), so tests/trainer/conftest.py starts this once per session and runs, in one process
pair, the parts the session's tests need: ``dist`` (test_distributed.py, dist_worker.py), ``ckpt``
(test_checkpoint_dist.py) and ``ep`` (test_moe_ep.py, moe_ep_worker.py). Every part rebuilds Megatron's
parallel state for its own layout (``init_model_parallel``), so none sees another's.

argv: ROOT then ``part=arg,arg...`` per part; each part writes its own results under ROOT.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def main(root: Path, parts: list[str]) -> None:
    import torch.distributed as dist

    for part in parts:
        name, _, args = part.partition("=")
        args = args.split(",")
        if name == "dist":
            import dist_worker

            dist_worker.run(args, root / "dist")
        elif name == "ckpt":
            import test_checkpoint_dist

            test_checkpoint_dist._run_worker(root / "ckpt", Path(args[0]))
        elif name == "ep":
            import moe_ep_worker

            moe_ep_worker.main(args[0], str(root / "ep2.pt"))
        else:
            raise SystemExit(f"unknown part {name!r}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
