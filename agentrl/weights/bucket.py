"""Flattened per-dtype buckets of named tensors, with the metadata to unflatten them.

Sending a few large contiguous buffers instead of hundreds of small tensors is what makes tensor and
broadcast sync fast: one IPC handle, one shared-memory segment or one collective per bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies inside its bucket (offsets in elements)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "offset": self.offset, "numel": self.numel}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BucketEntry:
        return cls(str(raw["name"]), tuple(int(s) for s in raw["shape"]), int(raw["offset"]), int(raw["numel"]))


@dataclass
class Bucket:
    """One flat 1-D tensor of a single dtype holding several named tensors back to back."""

    flat: torch.Tensor
    entries: list[BucketEntry]

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def metadata(self) -> dict[str, Any]:
        """JSON-able description: dtype, element count and entries."""
        return {
            "dtype": str(self.flat.dtype).removeprefix("torch."),
            "numel": self.flat.numel(),
            "entries": [e.to_json() for e in self.entries],
        }

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views into :attr:`flat`, one per entry, in their original shapes (no copy)."""
        return unflatten(self.flat, self.entries)


def unflatten(flat: torch.Tensor, entries: Iterable[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Named views of ``flat`` described by ``entries``; checks that each fits."""
    out = []
    for e in entries:
        if e.offset < 0 or e.offset + e.numel > flat.numel():
            raise ValueError(f"{e.name}: elements {e.offset}..{e.offset + e.numel} outside a bucket of {flat.numel()}")
        out.append((e.name, flat[e.offset : e.offset + e.numel].view(e.shape)))
    return out


def make_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    device: torch.device | str | None = None,
    allocate: Callable[[int, torch.dtype, int], torch.Tensor] | None = None,
) -> Iterator[Bucket]:
    """Group tensors by dtype into flat buckets of at most ``bucket_bytes`` (a larger tensor gets its own).

    Tensors keep their relative order within a dtype. ``device``: where buckets are built (default: the
    first tensor's device). ``allocate(bucket_index, dtype, numel)``: returns the flat tensor to fill
    (e.g. a persistent shared-memory or CUDA staging buffer) instead of a fresh one.
    """
    import torch

    for index, items in enumerate(plan_buckets(named_tensors, bucket_bytes=bucket_bytes)):
        dtype = items[0][1].dtype
        total = sum(t.numel() for _, t in items)
        if allocate is not None:
            flat = allocate(index, dtype, total)
        else:
            flat = torch.empty(total, dtype=dtype, device=device if device is not None else items[0][1].device)
        entries, offset, views, sources = [], 0, [], []
        for name, t in items:
            views.append(flat[offset : offset + t.numel()])
            sources.append(t.detach().reshape(-1))
            entries.append(BucketEntry(name, tuple(t.shape), offset, t.numel()))
            offset += t.numel()
        with torch.no_grad():
            if all(src.device == flat.device for src in sources):
                torch._foreach_copy_(views, sources)  # one fused launch on CUDA instead of one per tensor
            else:
                for view, src in zip(views, sources, strict=True):
                    view.copy_(src)
        yield Bucket(flat, entries)


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors (without copying) into per-dtype groups of at most ``bucket_bytes`` each.

    The same grouping as :func:`make_buckets`, in the order buckets are completed.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[list[tuple[str, torch.Tensor]]] = []
    pending: dict[Any, list[tuple[str, torch.Tensor]]] = {}
    pending_bytes: dict[Any, int] = {}
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        dtype = tensor.dtype
        if dtype in pending and pending_bytes[dtype] + size > bucket_bytes:
            groups.append(pending.pop(dtype))
            pending_bytes.pop(dtype)
        pending.setdefault(dtype, []).append((name, tensor))
        pending_bytes[dtype] = pending_bytes.get(dtype, 0) + size
    groups.extend(pending.values())
    return groups


def unique_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Drop later names that alias an earlier tensor (tied embeddings): engines tie them themselves."""
    seen: set[tuple[int, int, tuple[int, ...], Any]] = set()
    out = []
    for name, t in named_tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out
