"""Process-group setup for Megatron: works under torchrun/Ray (env vars) and in a plain single process."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from agentrl.trainer.cpu_shims import apply_cpu_shims, seed_model_parallel_rng


def init_distributed() -> None:
    """Initialise ``torch.distributed`` once: from torchrun's env vars, or as a 1-rank gloo group."""
    apply_cpu_shims()
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend)
    else:
        # One rank needs no rendezvous: an in-process store, no port to race for.
        dist.init_process_group(backend=backend, store=dist.HashStore(), world_size=1, rank=0)


def init_model_parallel(tp_size: int = 1, seed: int = 1234, ep_size: int = 1) -> None:
    """(Re)build Megatron's parallel state for ``tp_size`` (data parallel gets the rest; ``ep_size``: MoE
    experts split over that many of the data-parallel ranks) and seed RNGs."""
    from megatron.core import parallel_state

    init_distributed()
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"world size {world} is not divisible by tensor-parallel size {tp_size}")
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() == tp_size
                and parallel_state.get_expert_model_parallel_world_size() == ep_size):
            seed_model_parallel_rng(seed)
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size, expert_model_parallel_size=ep_size)
    seed_model_parallel_rng(seed)


def tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def expert_parallel_rank_size() -> dict[str, int]:
    """``{"ep_rank": ..., "ep_size": ...}`` of this rank (for ``load_hf_weights``)."""
    from megatron.core import parallel_state

    return {"ep_rank": parallel_state.get_expert_model_parallel_rank(),
            "ep_size": parallel_state.get_expert_model_parallel_world_size()}
