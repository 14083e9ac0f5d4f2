"""Let megatron-core 0.16.1 run on a CPU-only torch build (gloo): the few CUDA assumptions it makes, mapped to CPU.

Everything here is a no-op when CUDA is available: on a GPU Megatron runs unmodified.
Two parts:

* :func:`apply_cpu_shims` patches a few ``torch.cuda`` functions once per process;
* :func:`cuda_to_cpu` is a ``TorchFunctionMode`` that maps ``device="cuda"`` / ``.cuda()`` to the CPU
  while Megatron's DDP, optimizer and gradient clipping run (they allocate on ``"cuda"`` literally).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_cpu_shims() -> None:
    """Patch ``torch.cuda`` for Megatron when CUDA is absent (idempotent)."""
    global _applied
    if _applied or cuda_available():
        return
    # parallel_state / ColumnParallelLinear / DDP buffers call torch.cuda.current_device() to place
    # parameters and buffers; returning the CPU device puts them on the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # DistributedDataParallel.{offload,reload}_grad_buffers and the optimizer's state offload call
    # torch.cuda.synchronize(); there is nothing to wait for on the CPU.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # Same callers free cached blocks afterwards; the CPU allocator has no cache.
    torch.cuda.empty_cache = lambda: None
    # tensor_parallel.model_parallel_cuda_manual_seed() seeds torch.cuda; the CPU generator is the only one.
    torch.cuda.manual_seed = torch.manual_seed
    # Activation recomputation saves and restores the CUDA RNG state around each checkpoint; the CPU
    # state, the only one, is saved and restored beside it already.
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    _applied = True


def seed_model_parallel_rng(seed: int) -> None:
    """Seed Megatron's RNG trackers.

    Needed by ``tensor_parallel.model_parallel_cuda_manual_seed``: its default tracker saves/restores CUDA
    generator states inside ``get_cuda_rng_tracker().fork()`` (used by ColumnParallelLinear init and
    attention dropout); on the CPU we use the inference tracker, whose ``fork`` is a no-op. Dropout is 0
    in RL training, so nothing depends on the forked stream.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not cuda_available())


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.split(":")[0] == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made inside the mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        # Float16OptimizerWithFloat16Params / clip_grad_by_total_norm_fp32 / DDP buffers:
        # torch.tensor(..., device='cuda'), torch.zeros(..., device='cuda').
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        # MegatronOptimizer.reload_model_params and state loading: p.data.cuda(), v.cuda().
        if func is torch.Tensor.cuda:
            return args[0]
        # Tensor.to("cuda") in checkpoint loading paths.
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        result = func(*args, **kwargs)
        # clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor' and the
        # bf16 optimizer checks param.type() in ['torch.cuda.BFloat16Tensor', ...]: report CPU tensors
        # under their CUDA type names so the checks hold.
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1) if ".cuda." not in result else result
        return result


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Run Megatron DDP / optimizer / clipping code on the CPU; a no-op when CUDA is available."""
    if cuda_available():
        yield
        return
    apply_cpu_shims()
    with _CudaToCpuMode():
        yield
