"""Sender side of the byte-wise delta: diff against a bounded snapshot, encode, compress.

The wire format and the receiver live in :mod:`agentrl.engine.delta` (the engine must decode; a lower
layer may not import this one). Here: :func:`encode_tensor` (one tensor, one encoding),
:func:`encode_delta` (a whole payload) and :class:`Snapshot` (the bits the engines last acknowledged,
kept within a byte budget; tensors beyond the budget are sent ``raw``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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


def _flat_bit_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each ``(old, new)`` pair as flat bit views, refused unless both have the same shape, dtype and device."""
    bits = []
    for old, new in pairs:
        a, b = flat_bits(old), flat_bits(new)
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            raise ValueError(f"cannot diff {old.dtype}{list(old.shape)} against {new.dtype}{list(new.shape)}")
        bits.append((a, b))
    return bits


def changed_indices_many(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, group_elements: int = 1 << 30
) -> list[torch.Tensor]:
    """:func:`changed_indices` of every ``(old, new)`` pair, with two device syncs per group of tensors
    instead of one per tensor: each pair's comparison is written into one flat mask (``group_elements``
    at most; a larger tensor is its own group), one ``nonzero`` finds every change, and the positions are
    split back per tensor. On a GPU the per-tensor syncs, not the bytes, are what a diff of hundreds of
    tensors costs."""
    import torch

    bits = _flat_bit_pairs(pairs)
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


DIFF_BLOCK = 256  # elements per partial count of diff_many (each tensor starts on a block)


@dataclass
class Diff:
    """Where the bits of ``old`` and ``new`` differ: ``mask`` (flat bool, a view into its group's buffer)
    and ``count`` (how many elements differ)."""

    mask: torch.Tensor
    count: int


def diff_many(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, group_elements: int = 1 << 30
) -> list[Diff]:
    """The changed-element mask and count of every ``(old, new)`` pair in one fused pass per group of
    tensors, with ONE device sync per group and no ``nonzero``: each pair's comparison is written into a
    flat mask where every tensor starts on a :data:`DIFF_BLOCK` boundary (``group_elements`` at most; a
    larger tensor is its own group), one reduction counts each block, and each tensor's count is a
    difference of the blocks' running sum. That is all an encoder needs to pick an encoding per tensor
    (the XOR plane of a dense one is ``old ^ new``; a sparse one's indices are its mask's ``nonzero``)."""
    import torch

    bits = _flat_bit_pairs(pairs)
    out: list[Diff] = []
    start = 0
    while start < len(bits):
        device = bits[start][1].device
        end, offsets, total = start, [], 0
        while end < len(bits) and bits[end][1].device == device:
            padded = -(-bits[end][1].numel() // DIFF_BLOCK) * DIFF_BLOCK
            if end > start and total + padded > group_elements:
                break
            offsets.append(total)
            total += padded
            end += 1
        group = bits[start:end]
        aligned = all(a.numel() % DIFF_BLOCK == 0 for a, _ in group)
        # padding between tensors must read as unchanged; without padding nothing needs clearing
        mask = (torch.empty if aligned else torch.zeros)(total, dtype=torch.bool, device=device)
        for (a, b), offset in zip(group, offsets, strict=True):
            torch.ne(a, b, out=mask[offset : offset + a.numel()])
        counts = _block_counts(mask, [(o, a.numel()) for o, (a, _) in zip(offsets, group, strict=True)])
        out.extend(Diff(mask[o : o + a.numel()], int(c)) for o, (a, _), c in zip(offsets, group, counts, strict=True))
        start = end
    return out


def _block_counts(mask: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[int]:
    """How many of ``mask`` (flat bool, every span starting on a :data:`DIFF_BLOCK` boundary, padding
    False) are set in each ``(offset, numel)`` span: one reduction per block, a running sum, one sync."""
    import torch

    # Summing the bool mask would first cast it to int64 (8x its bytes, written and read again: that
    # cast was most of the diff's time on an H200). Instead read it as int64 words of 8 flags each and sum
    # DIFF_BLOCK // 8 words per block: every byte lane then holds at most 32 (< 256, no carries), and the
    # block's count is the sum of its 8 lanes.
    lanes = mask.view(torch.uint8).view(torch.int64).view(-1, DIFF_BLOCK // 8).sum(1)
    blocks = lanes & 0xFF
    for shift in range(8, 64, 8):
        blocks += (lanes >> shift) & 0xFF
    running = torch.cat([blocks.new_zeros(1), blocks.cumsum(0)])
    bounds = torch.tensor([[o // DIFF_BLOCK, (o + n + DIFF_BLOCK - 1) // DIFF_BLOCK] for o, n in spans],
                          device=mask.device, dtype=torch.int64).reshape(-1, 2)
    return (running[bounds[:, 1]] - running[bounds[:, 0]]).tolist()


class FlatLayout:
    """Named tensors laid out in one flat buffer per (device, dtype), each starting on a
    :data:`DIFF_BLOCK` boundary (zero padding between), so two buffers of the layout are diffed in ONE
    comparison per buffer and filled in one fused copy: no per-tensor kernels, no per-tensor Python."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.signature = self.signature_of(named)
        self.groups: dict[tuple[Any, Any], list[tuple[str, tuple[int, ...], int, int]]] = {}
        sizes: dict[tuple[Any, Any], int] = {}
        for name, shape, dtype, device in self.signature:
            key = (device, dtype)
            offset, numel = sizes.get(key, 0), math.prod(shape)
            self.groups.setdefault(key, []).append((name, shape, offset, numel))
            sizes[key] = offset + -(-numel // DIFF_BLOCK) * DIFF_BLOCK
        self.sizes = sizes

    @staticmethod
    def signature_of(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple]:
        """Names, shapes, dtypes and devices (each buffer lives on its tensors' device)."""
        return [(n, tuple(t.shape), t.dtype, t.device) for n, t in named]

    def fits(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether ``named`` is exactly this layout's tensors, in its order."""
        return self.signature_of(named) == self.signature

    def allocate(self) -> FlatBuffers:
        import torch

        return FlatBuffers(self, {key: torch.zeros(max(size, DIFF_BLOCK), dtype=key[1], device=key[0])
                                  for key, size in self.sizes.items()})


class FlatBuffers:
    """One set of buffers of a :class:`FlatLayout`, with the named views into them."""

    def __init__(self, layout: FlatLayout, flats: dict[tuple[Any, Any], torch.Tensor]) -> None:
        self.layout = layout
        self.flats = flats
        self.views = {name: flats[key][offset : offset + numel].view(shape)
                      for key, entries in layout.groups.items() for name, shape, offset, numel in entries}
        self._order = [self.views[name] for name, *_ in layout.signature]
        self._live: dict[tuple[Any, Any], tuple] = {}  # diff_live's chunk tables, bit view, mask and its views

    def fill(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy ``named`` (in the layout's order and shapes) in: one fused copy (bitwise)."""
        import torch

        with torch.no_grad():
            torch._foreach_copy_(self._order, [t for _, t in named])

    def diff_live(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Diff] | None:
        """Where ``named`` (this layout's tensors, in its order) differ from these buffers, read in place:
        one kernel launch and one sync per buffer, no staging copy (:mod:`agentrl.weights.delta_kernel`).
        ``None`` where that kernel cannot run (off CUDA, no Triton, a tensor that is not contiguous): the
        caller stages the bits and uses :meth:`diff`. The masks are views into one buffer per (device,
        dtype) that the next call overwrites."""
        import torch

        from agentrl.weights import delta_kernel

        if not all(delta_kernel.available(key[0]) for key in self.layout.groups):
            return None
        addresses: dict[tuple[Any, Any], list[int]] = {key: [] for key in self.layout.groups}
        for (_, tensor), (_, _, dtype, device) in zip(named, self.layout.signature, strict=True):
            if not tensor.is_contiguous():
                return None
            addresses[(device, dtype)].append(tensor.data_ptr())
        out: dict[str, Diff] = {}
        for key, entries in self.layout.groups.items():
            if key not in self._live:  # per layout, once: the chunk tables, the mask buffer and its views
                mask = torch.zeros(self.flats[key].numel(), dtype=torch.bool, device=key[0])
                self._live[key] = (delta_kernel.LiveDiff([(o, n) for _, _, o, n in entries], key[0]),
                                   flat_bits(self.flats[key]), mask,
                                   [(name, mask[o : o + n]) for name, _, o, n in entries])
            kernel, bits, mask, views = self._live[key]
            counts = kernel(bits, mask, addresses[key])
            out.update((name, Diff(view, c)) for (name, view), c in zip(views, counts, strict=True))
        return out

    def diff(self, other: FlatBuffers) -> dict[str, Diff]:
        """Where ``other``'s bits differ from these, per name: one comparison and one sync per buffer."""
        out: dict[str, Diff] = {}
        for key, entries in self.layout.groups.items():
            a, b = flat_bits(self.flats[key]), flat_bits(other.flats[key])
            mask = a != b  # padding is zero in both: never a change
            counts = _block_counts(mask, [(o, n) for _, _, o, n in entries])
            out.update((name, Diff(mask[o : o + n], int(c))) for (name, _, o, n), c in zip(entries, counts, strict=True))
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


def _shuffled(bits: torch.Tensor) -> bytes:
    """:func:`shuffle_bytes` of an integer tensor, transposed on its device (a GPU does it in a blink; a
    host-side transpose of gigabytes took seconds)."""
    import torch

    if bits.device.type == "cpu" or bits.element_size() == 1 or bits.numel() == 0:
        return shuffle_bytes(bits.cpu().numpy())
    planes = bits.contiguous().view(torch.uint8).view(-1, bits.element_size()).t().contiguous()
    return planes.cpu().numpy().tobytes()


def encode_tensor(name: str, old: torch.Tensor | None, new: torch.Tensor, encoding: str = "auto",
                  diff: Diff | None = None) -> EncodedTensor:
    """Encode how ``old`` becomes ``new`` (``old=None``: send ``raw`` bits). ``diff``: this pair's
    :func:`diff_many` result, when already computed."""
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
    if diff is not None:
        differs, changed = diff.mask.to(new_bits.device), diff.count
    else:
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
        sections = [_shuffled(old_bits ^ new_bits)]
        count = numel
    else:
        if index_t is None:
            index_t = differs.nonzero().reshape(-1)
        index = index_t.cpu().numpy()
        sections = [*encode_indices(encoding, index), _shuffled(new_bits[index_t])]
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
    diffs: Mapping[str, Diff] | None = None,
) -> tuple[bytes, DeltaStats]:
    """Build one payload from ``(name, old_or_None, new)`` triples; returns it with its stats.

    Tensors whose bits did not change are left out (the receiver keeps them as they are). ``diffs``:
    each name's diff against its ``old`` where already known (:meth:`Snapshot.diffs`); the rest are
    diffed here with :func:`diff_many`.
    """
    import zstandard

    stats = DeltaStats()
    entries: list[dict] = []
    compressor = zstandard.ZstdCompressor(level=level, threads=threads)
    chunks = compressor.chunker()
    compressed: list[bytes] = []
    for name, old, new, diff in _with_diffs(tensors, encoding, known=diffs or {}):
        encoded = encode_tensor(name, old, new, encoding, diff)
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


def _with_diffs(
    tensors: Iterable[tuple[str, torch.Tensor | None, torch.Tensor]], encoding: str, group_elements: int = 1 << 30,
    known: Mapping[str, Diff] | None = None,
) -> Iterator[tuple[str, torch.Tensor | None, torch.Tensor, Diff | None]]:
    """The triples with their diffs (from ``known``, else :func:`diff_many`, a group of about
    ``group_elements`` at a time, so at most one group's mask is held); ``None`` where there is nothing
    to diff (no snapshot, ``raw``)."""
    known = known or {}
    pending: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []
    size = 0

    def flush() -> Iterator[tuple[str, torch.Tensor | None, torch.Tensor, Diff | None]]:
        diffable = [i for i, (name, old, new) in enumerate(pending)
                    if old is not None and encoding != "raw" and old.dtype == new.dtype and old.shape == new.shape
                    and name not in known]
        moved = {i: pending[i][1].to(pending[i][2].device) for i in diffable}  # the snapshot beside the new bits
        pairs = [(moved[i], pending[i][2]) for i in diffable]
        diffs = dict(zip(diffable, diff_many(pairs, group_elements=group_elements), strict=True))
        for i, (name, old, new) in enumerate(pending):
            yield name, moved.get(i, old), new, diffs.get(i, known.get(name) if old is not None else None)

    for triple in tensors:
        if pending and size + triple[2].numel() > group_elements:
            yield from flush()
            pending, size = [], 0
        pending.append(triple)
        size += triple[2].numel()
    if pending:
        yield from flush()


class Snapshot:
    """Copies of the bits the engines acknowledged last, bounded by ``budget_bytes``.

    Tensors are kept in arrival order until the budget is spent; the rest are sent ``raw`` in every
    delta (so a budget of 0 turns the delta into a full sync). ``device`` is where copies live
    (``None``: next to the source tensors, e.g. on the GPU for a fast diff). When every tensor fits and
    its copy stays on the tensor's device, the copies are one :class:`FlatLayout` and :meth:`diffs`
    compares a whole sync in one pass.
    """

    def __init__(self, budget_bytes: int, *, device: str | None = "cpu") -> None:
        self.budget_bytes = budget_bytes
        self.device = device
        self.version: str | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        # when every tensor fits the budget: the copies live in one FlatLayout (see diffs)
        self._flat: FlatBuffers | None = None
        self._staged: FlatBuffers | None = None  # the same layout, for the next sync's new bits
        self.last_diff: str | None = None  # how the last diffs() ran: "live" (in place), "staged" or None

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
        self._flat = self._staged = None

    def diffs(self, named_tensors: Sequence[tuple[str, torch.Tensor]], *, in_place: bool = True) -> dict[str, Diff]:
        """Each name's :class:`Diff` of ``named_tensors`` against the snapshot, in one fused pass, when the
        whole snapshot is one :class:`FlatLayout` of exactly these tensors (names, shapes, dtypes,
        devices: it is when everything fit the budget on the tensors' own device); else ``{}``
        (:func:`encode_delta` then diffs per group). On CUDA the kernel of :meth:`FlatBuffers.diff_live`
        reads the tensors in place; elsewhere the new bits are staged into a second set of the layout's
        buffers first (one fused copy; the snapshot's memory doubles while it is flat). ``last_diff``
        says which ran (``in_place=False`` stages on CUDA too). The masks are valid until the next call."""
        named = list(named_tensors)
        if not self.valid or self._flat is None or not self._flat.layout.fits(named):
            self.last_diff = None
            return {}
        live = self._flat.diff_live(named) if in_place else None
        if live is not None:
            self.last_diff = "live"
            return live
        self.last_diff = "staged"
        if self._staged is None:
            self._staged = self._flat.layout.allocate()
        self._staged.fill(named)
        return self._flat.diff(self._staged)

    def record(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Remember ``named_tensors`` as acknowledged ``version`` (copying into existing buffers)."""
        named = list(named_tensors)
        # Flat only where the copies stay beside the tensors (the diff then runs where the bits are; a CPU
        # snapshot of GPU tensors keeps the per-tensor copies, diffed on the GPU by encode_delta).
        if named and sum(t.numel() * t.element_size() for _, t in named) <= self.budget_bytes and all(
                self._beside(t.device) for _, t in named):
            self._record_flat(named, version)
            return
        self._flat = self._staged = None
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

    def _beside(self, device: torch.device) -> bool:
        """Whether copies kept on this snapshot's ``device`` stay on ``device``."""
        if self.device is None:
            return True
        import torch

        mine = torch.device(self.device)
        return mine.type == device.type and mine.index in (None, device.index)

    def _record_flat(self, named: list[tuple[str, torch.Tensor]], version: str) -> None:
        if self._flat is None or not self._flat.layout.fits(named):
            self._flat, self._staged = FlatLayout(named).allocate(), None
        self._flat.fill(named)
        self._tensors = dict(self._flat.views)
        self.version = version

    def triples(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor | None, torch.Tensor]]:
        """``(name, snapshot_or_None, new)`` for :func:`encode_delta`."""
        for name, tensor in named_tensors:
            yield name, self.get(name), tensor
