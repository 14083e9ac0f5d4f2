"""Sender side of the byte-wise delta: diff against a bounded snapshot, encode, compress.

The wire format and the receiver live in :mod:`agentrl.engine.delta` (the engine must decode; a lower
layer may not import this one). Here: :func:`encode_tensor` (one tensor, one encoding),
:func:`encode_delta` (a whole payload) and :class:`Snapshot` (the bits the engines last acknowledged,
kept within a byte budget; tensors beyond the budget are sent ``raw``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentrl.engine.delta import (
    ENCODINGS,
    FORMAT,
    GAP16_ESCAPE,
    GAP32_ESCAPE,
    TensorEntry,
    bits_checksum,
    flat_bits,
    frame,
    shuffle_bytes,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

# Above this changed fraction a dense XOR plane is smaller after zstd than indices plus values: unchanged
# elements XOR to zero bytes, which zstd all but erases (measured: at 2% changed bf16 elements XOR and
# gap16 are even, at 15% XOR is 1.4x smaller; benchmarks/weights_bench.py).
XOR_DENSITY = 0.02


@dataclass
class EncodedTensor:
    entry: TensorEntry
    sections: list[bytes]
    changed: int  # elements whose bits differ (all of them for ``raw``)

    @property
    def raw_bytes(self) -> int:
        return sum(len(s) for s in self.sections)


def changed_indices(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat int64 positions where the bits of ``old`` and ``new`` differ (on their device)."""
    a, b = flat_bits(old), flat_bits(new)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot diff {old.dtype}{list(old.shape)} against {new.dtype}{list(new.shape)}")
    return (a != b).nonzero().reshape(-1)


def changed_indices_many(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, group_elements: int = 1 << 30
) -> list[torch.Tensor]:
    """:func:`changed_indices` of every ``(old, new)`` pair, with two device syncs per group of tensors
    instead of one per tensor: each pair's comparison is written into one flat mask (``group_elements``
    at most; a larger tensor is its own group), one ``nonzero`` finds every change, and the positions are
    split back per tensor. On a GPU the per-tensor syncs, not the bytes, are what a diff of hundreds of
    tensors costs."""
    import torch

    bits = []
    for old, new in pairs:
        a, b = flat_bits(old), flat_bits(new)
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            raise ValueError(f"cannot diff {old.dtype}{list(old.shape)} against {new.dtype}{list(new.shape)}")
        bits.append((a, b))
    out: list[torch.Tensor] = []
    start = 0
    while start < len(bits):
        end, total = start, 0
        device = bits[start][1].device
        while end < len(bits) and bits[end][1].device == device and (
                end == start or total + bits[end][1].numel() <= group_elements):
            total += bits[end][1].numel()
            end += 1
        mask = torch.empty(total, dtype=torch.bool, device=device)
        offset = 0
        for a, b in bits[start:end]:
            torch.ne(a, b, out=mask[offset : offset + a.numel()])
            offset += a.numel()
        index = mask.nonzero().reshape(-1)
        sizes = [a.numel() for a, _ in bits[start:end]]
        bounds = torch.tensor(list(itertools.accumulate(sizes)), device=device)
        cuts = torch.searchsorted(index, bounds).tolist()
        first = base = 0
        for cut, size in zip(cuts, sizes, strict=True):
            out.append(index[first:cut] - base)
            first, base = cut, base + size
        start = end
    return out


def choose_encoding(changed: int, numel: int, max_gap: int) -> str:
    """Pick the encoding that is smallest in practice for this change pattern."""
    if numel == 0 or changed / numel > XOR_DENSITY:
        return "xor"
    if numel > 2**31 - 1 or max_gap >= 2**32:
        return "gap32"
    return "gap16"


def _gaps(index: np.ndarray) -> np.ndarray:
    import numpy as np

    return np.diff(index, prepend=-1) - 1


def encode_indices(encoding: str, index: np.ndarray) -> list[bytes]:
    """Index sections for ``int32``, ``gap16`` or ``gap32`` (see :mod:`agentrl.engine.delta`)."""
    import numpy as np

    if encoding == "int32":
        if len(index) and int(index[-1]) > 2**31 - 1:
            raise ValueError("int32 indices cannot address a tensor of more than 2**31 elements")
        return [index.astype("<i4").tobytes()]
    gaps = _gaps(index)
    gap_dtype, esc_dtype, escape = (
        ("<u2", "<u4", GAP16_ESCAPE) if encoding == "gap16" else ("<u4", "<u8", GAP32_ESCAPE)
    )
    long_gap = gaps >= escape
    escapes = gaps[long_gap]
    if encoding == "gap16" and len(escapes) and int(escapes.max()) >= 2**32:
        raise ValueError("gap16 escapes hold at most 32-bit gaps; use gap32")
    stream = np.where(long_gap, escape, gaps)
    return [stream.astype(gap_dtype).tobytes(), escapes.astype(esc_dtype).tobytes()]


def encode_tensor(name: str, old: torch.Tensor | None, new: torch.Tensor, encoding: str = "auto") -> EncodedTensor:
    """Encode how ``old`` becomes ``new`` (``old=None``: send ``raw`` bits)."""
    import torch

    new_bits = flat_bits(new)
    numel = new_bits.numel()
    new_xxh = bits_checksum(new_bits)
    if old is None or encoding == "raw":
        values = new_bits.cpu().numpy()
        entry = TensorEntry(name, str(new.dtype), tuple(new.shape), "raw", numel, (values.nbytes,), None, new_xxh)
        return EncodedTensor(entry, [shuffle_bytes(values)], numel)
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(f"{name}: snapshot {old.dtype}{list(old.shape)} vs new {new.dtype}{list(new.shape)}")
    old_bits = flat_bits(old).to(new_bits.device)
    base_xxh = bits_checksum(old_bits)
    if encoding not in (*ENCODINGS, "auto"):
        raise ValueError(f"unknown delta encoding {encoding!r}; choose from {ENCODINGS} or 'auto'")
    differs = old_bits != new_bits
    changed = int(torch.count_nonzero(differs))  # ~30x faster than bool .sum() on CPU
    index_t = None
    if encoding == "auto":
        # Dense changes: XOR without ever materialising indices. Sparse: indices are few, gaps cheap.
        if numel == 0 or changed / numel > XOR_DENSITY:
            encoding = "xor"
        else:
            index_t = differs.nonzero().reshape(-1)
            max_gap = int((index_t.diff(prepend=index_t.new_tensor([-1])) - 1).max()) if changed else 0
            encoding = choose_encoding(changed, numel, max_gap)
    if encoding == "xor":
        xor = (old_bits ^ new_bits).cpu().numpy()
        sections = [shuffle_bytes(xor)]
        count = numel
    else:
        if index_t is None:
            index_t = differs.nonzero().reshape(-1)
        index = index_t.cpu().numpy()
        values = new_bits[index_t].cpu().numpy()
        sections = [*encode_indices(encoding, index), shuffle_bytes(values)]
        count = changed
    entry = TensorEntry(
        name, str(new.dtype), tuple(new.shape), encoding, count, tuple(len(s) for s in sections), base_xxh, new_xxh
    )
    return EncodedTensor(entry, sections, changed)


@dataclass
class DeltaStats:
    """What one payload holds: element counts and bytes before and after compression."""

    numel: int = 0
    changed: int = 0
    full_bytes: int = 0
    raw_bytes: int = 0
    payload_bytes: int = 0
    encodings: dict[str, int] = field(default_factory=dict)

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0


def encode_delta(
    tensors: Iterable[tuple[str, torch.Tensor | None, torch.Tensor]],
    *,
    base_version: str | None,
    new_version: str,
    encoding: str = "auto",
    level: int = 1,
    threads: int = 0,
) -> tuple[bytes, DeltaStats]:
    """Build one payload from ``(name, old_or_None, new)`` triples; returns it with its stats.

    Tensors whose bits did not change are left out (the receiver keeps them as they are).
    """
    import zstandard

    stats = DeltaStats()
    entries: list[dict] = []
    compressor = zstandard.ZstdCompressor(level=level, threads=threads)
    chunks = compressor.chunker()
    compressed: list[bytes] = []
    for name, old, new in tensors:
        encoded = encode_tensor(name, old, new, encoding)
        e = encoded.entry
        stats.numel += new.numel()
        stats.full_bytes += new.numel() * new.element_size()
        stats.changed += encoded.changed
        if encoded.changed == 0:
            continue
        stats.encodings[e.encoding] = stats.encodings.get(e.encoding, 0) + 1
        stats.raw_bytes += encoded.raw_bytes
        entries.append(e.to_json())
        for section in encoded.sections:
            compressed.extend(chunks.compress(section))
    compressed.extend(chunks.finish())
    header = {
        "format": FORMAT,
        "base_version": base_version,
        "new_version": new_version,
        "raw_body_len": stats.raw_bytes,
        "tensors": entries,
    }
    payload = frame(header, b"".join(compressed))
    stats.payload_bytes = len(payload)
    return payload, stats


class Snapshot:
    """Copies of the bits the engines acknowledged last, bounded by ``budget_bytes``.

    Tensors are kept in arrival order until the budget is spent; the rest are sent ``raw`` in every
    delta (so a budget of 0 turns the delta into a full sync). ``device`` is where copies live
    (``None``: next to the source tensors, e.g. on the GPU for a fast diff).
    """

    def __init__(self, budget_bytes: int, *, device: str | None = "cpu") -> None:
        self.budget_bytes = budget_bytes
        self.device = device
        self.version: str | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    @property
    def bytes_used(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def valid(self) -> bool:
        return self.version is not None

    def get(self, name: str) -> torch.Tensor | None:
        return self._tensors.get(name) if self.valid else None

    def invalidate(self) -> None:
        """Forget the acknowledged version (the next sync must be full); keeps the buffers for reuse."""
        self.version = None

    def clear(self) -> None:
        self.version = None
        self._tensors.clear()

    def record(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Remember ``named_tensors`` as acknowledged ``version`` (copying into existing buffers)."""
        used = 0
        kept: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            size = tensor.numel() * tensor.element_size()
            if used + size > self.budget_bytes:
                continue
            device = tensor.device if self.device is None else self.device
            old = self._tensors.get(name)
            if old is not None and old.shape == tensor.shape and old.dtype == tensor.dtype and old.device == device:
                old.copy_(tensor.detach())
                kept[name] = old
            else:
                kept[name] = tensor.detach().to(device, copy=True).contiguous()
            used += size
        self._tensors = kept
        self.version = version

    def triples(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor | None, torch.Tensor]]:
        """``(name, snapshot_or_None, new)`` for :func:`encode_delta`."""
        for name, tensor in named_tensors:
            yield name, self.get(name), tensor
