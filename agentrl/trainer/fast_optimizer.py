"""Megatron's mixed-precision optimizer on a GPU without TransformerEngine or Apex, minus its per-tensor Python.

Without TE/Apex, megatron-core 0.16.1 falls back to ``local_multi_tensor_scale`` (a Python loop of
``dst.copy_(src * scale)``: two kernels and an fp32 temporary per tensor; it copies the fp32 main params
into the bf16 model params after every step, scale 1.0, and clips gradients) and
``local_multi_tensor_l2_norm`` (a norm kernel per tensor, then ``torch.tensor`` over the list of CUDA
scalars: a device sync per tensor, 338 at 1.5B), and to torch's AdamW in its ``foreach`` form.
:func:`install` swaps in ``torch._foreach_*`` equivalents and :func:`fuse_adam` switches AdamW to its
fused CUDA kernel. Values: the scale is the same fp32 multiply (bitwise the same: a copy when the scale
is 1.0); the norm is the same 2-norm summed in another order and the fused AdamW the same update
computed in another order, equal to fp32 rounding (tests/trainer/test_fast_optimizer.py).

Both apply on CUDA only (:class:`~agentrl.trainer.actor.MegatronTrainer` calls them when CUDA is
available), so CPU training keeps Megatron's exact code paths. ``ENABLED = False`` turns both off
(benchmarks/trainer_bench.py ``--megatron-fallbacks``: the before of an A/B).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

ENABLED = True
_installed = False


def foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: Sequence[list[torch.Tensor]], scale: float) -> None:
    """Drop-in for ``local_multi_tensor_scale``: ``dst = src * scale`` for each pair, in foreach kernels."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if scale == 1.0:  # x * 1.0 == x exactly: a (casting) copy
        torch._foreach_copy_(dst, src)
    elif all(a is b for a, b in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: Sequence[list[torch.Tensor]], per_tensor: bool,
                    *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for ``local_multi_tensor_l2_norm``: the 2-norm over all tensors as a 1-element fp32 tensor on
    their device, with no host round trip (the local one syncs once per tensor)."""
    tensors = tensor_lists[0]
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1)
    return total, (torch.stack(norms) if per_tensor else None)


def install() -> bool:
    """Point Megatron's optimizer and gradient clipping at the foreach versions where they use the local
    fallbacks (idempotent). Returns whether they are installed."""
    global _installed
    if not ENABLED:
        return False
    if _installed:
        return True
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mp_optimizer

    if getattr(mp_optimizer, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
        mp_optimizer.multi_tensor_scale_impl = foreach_scale
    if getattr(clip_grads, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = foreach_scale
    if getattr(clip_grads, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    _installed = True
    return True


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained, mixed precision or plain)."""
    out: list[torch.optim.Optimizer] = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
    return out


def fuse_adam(optimizer: Any) -> int:
    """Switch every torch ``Adam``/``AdamW`` inside ``optimizer`` whose parameters are all floating-point
    CUDA tensors to the fused kernel (before its first step: its state is created for that form).
    Returns how many parameter groups were switched."""
    if not ENABLED:
        return 0
    switched = 0
    for opt in torch_optimizers(optimizer):
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW) or any(opt.state.values()):
            continue
        for group in opt.param_groups:
            if group["params"] and all(p.is_cuda and p.is_floating_point() for p in group["params"]) \
                    and not group.get("differentiable"):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched
