"""Diff live tensors against a flat snapshot in ONE kernel launch per buffer (CUDA, through Triton).

:meth:`agentrl.weights.delta.FlatBuffers.diff` compares two buffers of one layout, so the new bits had to
be staged into a second buffer first (a fused copy: a third of the diff's bytes and, on an H200, about
a third of its time). :class:`LiveDiff` reads the trainer's tensors where they are instead: a table of
their addresses (refreshed each call: one small host-to-device copy) and a chunk table built once per
layout (which tensor, where in it; every chunk of :data:`CHUNK` elements lies inside one tensor, and
the snapshot places every tensor on a ``DIFF_BLOCK`` boundary). Each program compares one chunk of a
live tensor with its place in the snapshot, writes the changed flags into the layout's mask buffer
and its count into one slot; a running sum over the slots gives each tensor's count (one sync).

Triton is imported only when a kernel is launched (it ships with PyTorch's CUDA wheels; without it, or
off CUDA, :func:`available` is False and the caller stages as before). Exactness: the kernel compares
integer bit patterns, so masks and counts are exactly those of ``old_bits != new_bits``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CHUNK = 4096  # elements per program: 8 KB of bf16 per operand, 32 elements per thread at 4 warps
_ALIGN = 16  # bytes; the vectorised path needs every live tensor to start on such an address

_kernel: Any = None


def available(device: torch.device) -> bool:
    """Whether :class:`LiveDiff` can run on ``device`` (CUDA with Triton importable)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def _build_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def live_diff(ptrs, offsets, numels, chunk_tensor, chunk_start, snap, mask, counts,
                  CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(chunk_tensor + pid)
        start = tl.load(chunk_start + pid)
        left = tl.load(numels + t) - start
        dst = tl.load(offsets + t) + start
        new_p = tl.load(ptrs + t).to(snap.dtype) + start  # an int64 address -> the buffer's element pointer
        old_p = snap + dst
        mask_p = mask + dst
        if ALIGNED:  # chunks start on CHUNK, tensors on 256 elements: 16-byte vector loads and stores
            new_p = tl.multiple_of(new_p, 16)
            old_p = tl.multiple_of(old_p, 16)
            mask_p = tl.multiple_of(mask_p, 16)
        idx = tl.arange(0, CHUNK)
        if left >= CHUNK:  # a whole chunk: no bounds mask (a mask of unknown divisibility stops vectorising)
            ne = tl.load(new_p + idx) != tl.load(old_p + idx)
            tl.store(mask_p + idx, ne.to(tl.uint8))
        else:  # a tensor's last, partial chunk
            valid = idx < left
            ne = (tl.load(new_p + idx, mask=valid, other=0) != tl.load(old_p + idx, mask=valid, other=0)) & valid
            tl.store(mask_p + idx, ne.to(tl.uint8), mask=valid)
        tl.store(counts + pid, tl.sum(ne.to(tl.int32), axis=0))

    return live_diff


class LiveDiff:
    """The chunk tables of one buffer of a flat layout: ``entries`` are its ``(offset, numel)`` spans
    (offsets on ``DIFF_BLOCK`` boundaries, in the layout's order), on ``device``."""

    def __init__(self, entries: Sequence[tuple[int, int]], device: torch.device) -> None:
        import torch

        self.device = device
        self.n = len(entries)
        offsets = torch.tensor([o for o, _ in entries], dtype=torch.int64)
        numels = torch.tensor([n for _, n in entries], dtype=torch.int64)
        chunks = (numels + CHUNK - 1) // CHUNK
        first = torch.cat([chunks.new_zeros(1), chunks.cumsum(0)])
        total = int(first[-1])
        tensor = torch.repeat_interleave(torch.arange(self.n), chunks)
        start = (torch.arange(total) - first[:-1].repeat_interleave(chunks)) * CHUNK
        self.chunks = total
        self.offsets, self.numels = offsets.to(device), numels.to(device)
        self.chunk_tensor, self.chunk_start = tensor.to(torch.int32).to(device), start.to(device)
        self.bounds = torch.stack([first[:-1], first[1:]], 1).to(device)  # each tensor's chunk range
        self.counts = torch.empty(max(total, 1), dtype=torch.int32, device=device)
        self._addresses: tuple[int, ...] | None = None  # the last call's, with their device copy
        self._ptrs: torch.Tensor | None = None
        self._aligned = False

    def __call__(self, snap_bits: torch.Tensor, mask: torch.Tensor, addresses: Sequence[int]) -> list[int]:
        """Write ``live[i] != snapshot`` into ``mask`` (bool, the buffer's length) at each tensor's span and
        return each tensor's count. ``snap_bits``: the snapshot buffer as its integer view; ``addresses``:
        the live tensors' ``data_ptr()`` in layout order (contiguous, of the buffer's dtype and on its
        device: the caller checks)."""
        global _kernel
        import torch

        if len(addresses) != self.n:
            raise ValueError(f"{len(addresses)} tensors for a layout of {self.n}")
        if self.chunks == 0:
            return [0] * self.n
        if _kernel is None:
            _kernel = _build_kernel()
        key = tuple(addresses)
        if key != self._addresses:  # the same tensors as last time (the usual case): no copy
            self._ptrs = torch.tensor(key, dtype=torch.int64).to(self.device)
            self._addresses = key
            self._aligned = all(a % _ALIGN == 0 for a in key)
        aligned = self._aligned and snap_bits.data_ptr() % _ALIGN == 0 and mask.data_ptr() % _ALIGN == 0
        _kernel[(self.chunks,)](self._ptrs, self.offsets, self.numels, self.chunk_tensor, self.chunk_start,
                                snap_bits, mask.view(torch.uint8), self.counts, CHUNK=CHUNK, ALIGNED=aligned,
                                num_warps=4)
        running = torch.cat([self.counts.new_zeros(1, dtype=torch.int64), self.counts[: self.chunks].cumsum(0)])
        return (running[self.bounds[:, 1]] - running[self.bounds[:, 0]]).tolist()
