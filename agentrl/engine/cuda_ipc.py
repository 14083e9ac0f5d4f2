"""CUDA IPC handles that name their GPU by UUID, so sender and receiver may see different device indices.

torch's reduction pickles a CUDA tensor's device as an index in the *sender's* numbering; an engine
started with ``CUDA_VISIBLE_DEVICES=1`` calls that GPU 0 and fails with "invalid device ordinal" (seen
on 2 H200s with the trainer on GPU 1). As SGLang does, the handle carries the GPU's UUID instead and
the receiver maps it back to its own index. CPU tensors keep torch's reduction unchanged.
"""

from __future__ import annotations

import io
from functools import cache
from typing import Any

_DEVICE_ARG = 6  # position of the device in torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments


def _uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def rebuild_cuda_tensor_by_uuid(*args: Any):
    """torch's ``rebuild_cuda_tensor`` with the device given as a UUID (see module doc)."""
    import torch
    from torch.multiprocessing import reductions

    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        local = [i for i in range(torch.cuda.device_count()) if _uuid(i) == device]
        if not local:
            raise RuntimeError(f"the tensor lives on GPU {device}, which this process does not see "
                               "(check CUDA_VISIBLE_DEVICES: colocated transfer needs the same GPU)")
        args = (*args[:_DEVICE_ARG], local[0], *args[_DEVICE_ARG + 1:])
    return reductions.rebuild_cuda_tensor(*args)


def _reduce_tensor_by_uuid(tensor):
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        return rebuild_cuda_tensor_by_uuid, (*args[:_DEVICE_ARG], _uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return rebuild, args


@cache
def _pickler_class():
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    reducers = {**ForkingPickler._extra_reducers, torch.Tensor: _reduce_tensor_by_uuid,
                torch.nn.Parameter: _reduce_tensor_by_uuid}
    return type("UUIDForkingPickler", (ForkingPickler,), {"_extra_reducers": reducers})


def dumps(obj: Any) -> bytes:
    """``ForkingPickler`` bytes of ``obj`` whose CUDA tensors carry GPU UUIDs; ``ForkingPickler.loads`` reads them."""
    buf = io.BytesIO()
    _pickler_class()(buf).dump(obj)
    return buf.getvalue()
