"""Save / resume a trainer with ``megatron.core.dist_checkpointing`` (resharding-capable, one dir per step).

Contents: model and optimizer (sharded), per-rank RNG states (a ``ShardedObject`` per rank), and common
state written once by rank 0: the LR scheduler, the step counter and the caller's ``extra_state``
(data-buffer cursor, weight version, ...).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.trainer.cpu_shims import cuda_to_cpu


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch here
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_sharded(state: dict[str, Any] | None):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world, rank = dist.get_world_size(), dist.get_rank()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _sharded_state(model, optimizer, *, is_loading: bool) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        "rng": _rng_sharded(None if is_loading else _rng_state()),
    }


def save_checkpoint(directory: str | Path, model, optimizer, scheduler, *, step: int,
                    extra_state: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint of ``model`` (an unwrapped GPTModel) and its optimizer into ``directory``."""
    from megatron.core import dist_checkpointing

    path = Path(directory)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        if any(path.iterdir()):
            raise FileExistsError(f"checkpoint directory {path} is not empty")
    dist.barrier()
    with cuda_to_cpu():
        state = _sharded_state(model, optimizer, is_loading=False)
        state["scheduler"] = scheduler.state_dict()
        state["step"] = step
        state["extra_state"] = dict(extra_state or {})
        dist_checkpointing.save(state, str(path))
    dist.barrier()
    return path


def load_checkpoint(directory: str | Path, model, optimizer, scheduler) -> tuple[int, dict[str, Any]]:
    """Restore everything :func:`save_checkpoint` wrote; returns ``(step, extra_state)``."""
    from megatron.core import dist_checkpointing

    path = Path(directory)
    if not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        raise FileNotFoundError(f"{path} is not a dist_checkpointing checkpoint")
    with cuda_to_cpu():
        template = _sharded_state(model, optimizer, is_loading=True)
        common = dist_checkpointing.load_common_state_dict(str(path))
        loaded = dist_checkpointing.load(template, str(path))
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(common["scheduler"])
    _set_rng_state(loaded["rng"])
    return int(common["step"]), dict(common["extra_state"])
