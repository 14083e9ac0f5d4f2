"""Byte-wise weight delta: wire format and the receiver side (verify, then write bits).

A delta turns the weights an engine holds (``base_version``) into the trainer's new weights
(``new_version``). Every tensor is handled as raw bits: its storage is viewed as a signed integer dtype of
the same width, and the receiver only *stores* bits (``flat[idx] = values``, ``flat ^= xor`` or a full
copy), never adds or multiplies, so an engine can never drift from the trainer by rounding.

Layout of one payload (all integers little-endian)::

    MAGIC (8 bytes: b"ARLDELT1")
    u64 header_len, header (UTF-8 JSON, see below)
    u64 body_len,   body (one zstd frame holding every tensor's sections back to back)
    u64 xxh3_64 of every byte above (catches flipped bytes and truncation before anything is parsed)

Header: ``{"format": 1, "base_version", "new_version", "raw_body_len", "tensors": [entry, ...]}`` with one
entry per tensor: ``name``, ``dtype`` (``str(torch.dtype)``), ``shape``, ``encoding``, ``count`` (changed
elements; the element count for ``xor``/``raw``), ``sections`` (byte length of each section, in order),
``base_xxh`` (xxh3_64 of the bits the sender diffed against; ``null`` for ``raw``) and ``new_xxh`` (xxh3_64
of the resulting bits).

Encodings and their sections (``w`` = element width in bytes; value planes are byte-shuffled, i.e. all
first bytes, then all second bytes, ... which lets zstd see the mostly-equal sign/exponent bytes together):

* ``int32``: absolute int32 indices, then values.
* ``gap16``: per changed element ``gap = idx - prev_idx - 1`` (``prev_idx`` starts at -1) as uint16;
  gaps >= 0xFFFF are written as the escape 0xFFFF and the full gap goes to a separate uint32 escape
  stream (a separate stream keeps decoding vectorised). Sections: gaps, escapes, values.
* ``gap32``: the same with uint32 gaps and a uint64 escape stream (escape 0xFFFFFFFF).
* ``xor``: every element's ``old ^ new``; the receiver XORs it in. For dense changes.
* ``raw``: every element's new bits (no base needed: used where the sender keeps no snapshot).

The receiver (:func:`apply_delta`) verifies everything first -- framing checksum, header, versions, names,
dtypes, shapes, index bounds and order, and the xxh3 of each base tensor -- and only then writes. After
writing it checks each tensor's ``new_xxh`` and restores the old bits of every tensor if one differs, so
a rejected delta always leaves the engine on its old weights.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

MAGIC = b"ARLDELT1"
FORMAT = 1
ENCODINGS = ("int32", "gap16", "gap32", "xor", "raw")
GAP16_ESCAPE = 0xFFFF
GAP32_ESCAPE = 0xFFFFFFFF
_U64 = struct.Struct("<Q")


class DeltaError(ValueError):
    """A delta payload was rejected; the receiving weights were left untouched."""


class DeltaCorruptError(DeltaError):
    """The payload's bytes are damaged (checksum, truncation, undecodable header or body)."""


class DeltaVersionError(DeltaError):
    """The delta is based on a different weight version than the receiver holds (out of order)."""


class DeltaMismatchError(DeltaError):
    """The delta does not fit the receiver's tensors (unknown name, dtype, shape, index out of range)."""


class DeltaChecksumError(DeltaError):
    """A tensor's bits before or after applying differ from what the sender diffed against or produced."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    count: int
    sections: tuple[int, ...]
    base_xxh: int | None
    new_xxh: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "encoding": self.encoding,
            "count": self.count,
            "sections": list(self.sections),
            "base_xxh": self.base_xxh,
            "new_xxh": self.new_xxh,
        }


@dataclass(frozen=True)
class DeltaHeader:
    base_version: str | None
    new_version: str
    raw_body_len: int
    tensors: tuple[TensorEntry, ...]


# ---------------------------------------------------------------- bit views and checksums


def int_view_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype of the same width as ``dtype`` (what tensors are diffed and written as)."""
    import torch

    width = torch.empty((), dtype=dtype).element_size()
    try:
        return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    except KeyError:
        raise DeltaMismatchError(f"no integer view for dtype {dtype} ({width} bytes)") from None


def flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer *view* (no copy) of a contiguous tensor's storage."""
    if not tensor.is_contiguous():
        raise DeltaMismatchError("delta needs contiguous tensors")
    t = tensor.detach().reshape(-1)
    if t.dtype == _torch().bool:
        return t.view(_torch().uint8)
    return t.view(int_view_dtype(t.dtype))


def bits_checksum(tensor: torch.Tensor) -> int:
    """xxh3_64 of a tensor's bits (moved to CPU if needed)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(memoryview(flat_bits(tensor).cpu().numpy()).cast("B"))


def shuffle_bytes(values: np.ndarray) -> bytes:
    """Byte planes of an integer array: all first bytes, then all second bytes, ..."""
    width = values.dtype.itemsize
    if width == 1 or values.size == 0:
        return values.tobytes()
    return values.view("u1").reshape(-1, width).T.tobytes()


def unshuffle_bytes(data: bytes | memoryview, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`shuffle_bytes`."""
    import numpy as np

    dtype = np.dtype(dtype)
    raw = np.frombuffer(data, dtype=np.uint8)
    if len(raw) % dtype.itemsize:
        raise DeltaCorruptError(f"value section of {len(raw)} bytes is not a multiple of {dtype.itemsize}")
    if dtype.itemsize == 1:
        return raw.copy().view(dtype)  # writable, like the shuffled branch
    return raw.reshape(dtype.itemsize, -1).T.copy().view(dtype).reshape(-1)  # copy: C order, writable


def _torch():
    import torch

    return torch


# ---------------------------------------------------------------- framing


def frame(header: Mapping[str, Any], body: bytes) -> bytes:
    """Wrap a header and a compressed body into a checksummed payload."""
    import xxhash

    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    parts = [MAGIC, _U64.pack(len(header_bytes)), header_bytes, _U64.pack(len(body)), body]
    digest = xxhash.xxh3_64()
    for p in parts:
        digest.update(p)
    parts.append(_U64.pack(digest.intdigest()))
    return b"".join(parts)


def _unframe(payload: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    import xxhash

    view = memoryview(payload)
    if len(view) < len(MAGIC) + 3 * _U64.size:
        raise DeltaCorruptError(f"payload of {len(view)} bytes is too short to be a delta")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise DeltaCorruptError("payload does not start with the delta magic (not a delta, or wrong format)")
    (expected,) = _U64.unpack(view[-_U64.size :])
    if xxhash.xxh3_64_intdigest(view[: -_U64.size]) != expected:
        raise DeltaCorruptError("payload checksum mismatch (flipped or truncated bytes)")
    pos = len(MAGIC)
    (header_len,) = _U64.unpack(view[pos : pos + 8])
    pos += 8
    if pos + header_len + 8 > len(view) - 8:
        raise DeltaCorruptError("header length runs past the end of the payload")
    try:
        header = json.loads(bytes(view[pos : pos + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeltaCorruptError(f"undecodable header: {exc}") from None
    pos += header_len
    (body_len,) = _U64.unpack(view[pos : pos + 8])
    pos += 8
    if pos + body_len != len(view) - 8:
        raise DeltaCorruptError("body length does not match the payload size")
    return header, view[pos : pos + body_len]


def _parse_header(raw: dict[str, Any]) -> DeltaHeader:
    try:
        if raw["format"] != FORMAT:
            raise DeltaCorruptError(f"unsupported delta format {raw['format']!r} (this engine reads {FORMAT})")
        tensors = tuple(
            TensorEntry(
                name=str(t["name"]),
                dtype=str(t["dtype"]),
                shape=tuple(int(s) for s in t["shape"]),
                encoding=str(t["encoding"]),
                count=int(t["count"]),
                sections=tuple(int(s) for s in t["sections"]),
                base_xxh=None if t["base_xxh"] is None else int(t["base_xxh"]),
                new_xxh=int(t["new_xxh"]),
            )
            for t in raw["tensors"]
        )
        base = raw["base_version"]
        return DeltaHeader(
            base_version=None if base is None else str(base),
            new_version=str(raw["new_version"]),
            raw_body_len=int(raw["raw_body_len"]),
            tensors=tensors,
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, DeltaError):
            raise
        raise DeltaCorruptError(f"malformed delta header: {exc!r}") from None


def read_delta_header(payload: bytes | memoryview) -> DeltaHeader:
    """Check a payload's framing and return its header (without touching any weights)."""
    raw, _ = _unframe(payload)
    return _parse_header(raw)


# ---------------------------------------------------------------- index codecs


def decode_indices(encoding: str, sections: list[memoryview], count: int, numel: int) -> np.ndarray:
    """Absolute int64 indices from an index encoding; checks bounds and strict order."""
    import numpy as np

    def arr(data: memoryview, dtype: str) -> np.ndarray:
        if len(data) % np.dtype(dtype).itemsize:
            raise DeltaCorruptError(f"{encoding} section length {len(data)} is not a multiple of {dtype}")
        return np.frombuffer(data, dtype=dtype)

    if encoding == "int32":
        idx = arr(sections[0], "<i4").astype(np.int64)
    elif encoding in ("gap16", "gap32"):
        gap_dtype, esc_dtype, escape = (
            ("<u2", "<u4", GAP16_ESCAPE) if encoding == "gap16" else ("<u4", "<u8", GAP32_ESCAPE)
        )
        gaps = arr(sections[0], gap_dtype).astype(np.int64)
        escapes = arr(sections[1], esc_dtype)
        is_escape = gaps == escape
        if int(is_escape.sum()) != len(escapes):
            raise DeltaCorruptError(f"{encoding}: {int(is_escape.sum())} escapes but {len(escapes)} escaped gaps")
        if len(escapes) and int(escapes.max()) >= numel:
            raise DeltaMismatchError(f"{encoding}: escaped gap beyond the tensor's {numel} elements")
        gaps[is_escape] = escapes.astype(np.int64)
        idx = np.cumsum(gaps + 1) - 1
    else:
        raise DeltaCorruptError(f"unknown index encoding {encoding!r}")
    if len(idx) != count:
        raise DeltaCorruptError(f"{encoding}: header says {count} changed elements, indices hold {len(idx)}")
    if count:
        if int(idx[0]) < 0 or int(idx[-1]) >= numel:
            raise DeltaMismatchError(f"index out of range for a tensor of {numel} elements")
        if count > 1 and not bool((np.diff(idx) > 0).all()):
            raise DeltaCorruptError("indices are not strictly increasing")
    return idx


# ---------------------------------------------------------------- receiver


@dataclass
class _Planned:
    entry: TensorEntry
    target: torch.Tensor  # flat integer view of the receiver's parameter
    index: torch.Tensor | None  # sparse encodings
    values: torch.Tensor  # values (sparse), xor mask or raw bits


def _split(body: memoryview, entry: TensorEntry, offset: int) -> list[memoryview]:
    out = []
    for length in entry.sections:
        if length < 0 or offset + length > len(body):
            raise DeltaCorruptError(f"{entry.name}: section runs past the end of the body")
        out.append(body[offset : offset + length])
        offset += length
    return out


def _plan(entry: TensorEntry, param: torch.Tensor, sections: list[memoryview]) -> _Planned:
    import numpy as np
    import torch

    if entry.dtype != str(param.dtype):
        raise DeltaMismatchError(f"{entry.name}: delta dtype {entry.dtype} but engine holds {param.dtype}")
    if entry.shape != tuple(param.shape):
        raise DeltaMismatchError(
            f"{entry.name}: delta shape {list(entry.shape)} but engine holds {list(param.shape)}"
        )
    target = flat_bits(param)
    numel = target.numel()
    np_dtype = np.dtype(str(target.dtype).removeprefix("torch."))
    expected_sections = {"int32": 2, "gap16": 3, "gap32": 3, "xor": 1, "raw": 1}.get(entry.encoding)
    if expected_sections is None:
        raise DeltaCorruptError(f"{entry.name}: unknown encoding {entry.encoding!r}")
    if len(sections) != expected_sections:
        raise DeltaCorruptError(f"{entry.name}: {entry.encoding} needs {expected_sections} sections")
    values = torch.from_numpy(unshuffle_bytes(sections[-1], np_dtype))
    index = None
    if entry.encoding in ("xor", "raw"):
        if len(values) != numel or entry.count != numel:
            raise DeltaMismatchError(f"{entry.name}: {entry.encoding} holds {len(values)} of {numel} elements")
    else:
        index = torch.from_numpy(decode_indices(entry.encoding, sections[:-1], entry.count, numel))
        if len(values) != entry.count:
            raise DeltaCorruptError(f"{entry.name}: {entry.count} indices but {len(values)} values")
    if entry.encoding == "raw":
        if bits_checksum(values) != entry.new_xxh:
            raise DeltaChecksumError(f"{entry.name}: raw bits do not match their checksum")
    elif entry.count and bits_checksum(target) != entry.base_xxh:
        raise DeltaChecksumError(
            f"{entry.name}: the engine's current bits differ from the base the delta was computed against"
        )
    device = target.device
    return _Planned(entry, target, None if index is None else index.to(device), values.to(device))


def apply_delta(
    named_params: Mapping[str, torch.Tensor], payload: bytes | memoryview, *, base_version: str | None
) -> DeltaHeader:
    """Apply a delta payload to ``named_params`` in place, all or nothing.

    ``base_version`` is the weight version the receiver holds now; the payload must be based on it
    (``None`` skips the version check; the per-tensor base checksums still apply). Raises a
    :class:`DeltaError` subclass -- and leaves every tensor unchanged -- on corrupt, out-of-order or
    mismatched payloads. Returns the header (``new_version`` is the version now held).
    """
    raw_header, body = _unframe(payload)
    header = _parse_header(raw_header)
    if base_version is not None and header.base_version != base_version:
        raise DeltaVersionError(
            f"out-of-order delta: it turns version {header.base_version!r} into {header.new_version!r}, "
            f"but the engine holds version {base_version!r}"
        )
    planned = _plan_all(header, _decompress(header, body), named_params)  # phase 1: verify; nothing written
    _write_all(planned)  # phase 2: write, verify the result, undo everything on a mismatch
    return header


def _decompress(header: DeltaHeader, body: bytes | memoryview) -> memoryview:
    import zstandard

    try:
        plain = zstandard.ZstdDecompressor().decompress(bytes(body), max_output_size=header.raw_body_len)
    except zstandard.ZstdError as exc:
        raise DeltaCorruptError(f"body does not decompress: {exc}") from None
    if len(plain) != header.raw_body_len:
        raise DeltaCorruptError(f"body decompressed to {len(plain)} bytes, header says {header.raw_body_len}")
    return memoryview(plain)


def _plan_all(header: DeltaHeader, plain_view: memoryview, named_params: Mapping[str, torch.Tensor]) -> list[_Planned]:
    """Every tensor's write, checked against the engine's tensors; tied weights (one storage) written once."""
    planned: list[_Planned] = []
    seen: set[str] = set()
    by_storage: dict[tuple, TensorEntry] = {}
    offset = 0
    for entry in header.tensors:
        if entry.name in seen:
            raise DeltaCorruptError(f"{entry.name}: listed twice")
        seen.add(entry.name)
        if entry.name not in named_params:
            raise DeltaMismatchError(f"{entry.name}: no such tensor in the engine")
        sections = _split(plain_view, entry, offset)
        offset += sum(entry.sections)
        param = named_params[entry.name]
        key = (param.untyped_storage().data_ptr(), param.storage_offset(), tuple(param.shape), param.dtype)
        if key in by_storage:
            if by_storage[key].new_xxh != entry.new_xxh:
                raise DeltaMismatchError(
                    f"{entry.name} shares storage with {by_storage[key].name} but the delta gives them different bits"
                )
            continue
        by_storage[key] = entry
        planned.append(_plan(entry, param, sections))
    if offset != len(plain_view):
        raise DeltaCorruptError(f"{len(plain_view) - offset} trailing body bytes not claimed by any tensor")
    return planned


def _write_all(planned: list[_Planned]) -> None:
    """Write every planned tensor, remembering how to undo; check the bits; undo everything on any failure."""
    import torch

    undo: list[tuple[_Planned, torch.Tensor | None]] = []
    with torch.no_grad():
        try:
            for p in planned:
                if p.entry.encoding == "xor":
                    p.target.bitwise_xor_(p.values)
                    undo.append((p, None))  # XOR is its own inverse
                elif p.entry.encoding == "raw":
                    undo.append((p, p.target.clone()))
                    p.target.copy_(p.values)
                elif p.entry.count:
                    assert p.index is not None
                    undo.append((p, p.target[p.index].clone()))
                    p.target[p.index] = p.values
            for p, _ in undo:
                if p.entry.encoding != "raw" and bits_checksum(p.target) != p.entry.new_xxh:
                    raise DeltaChecksumError(f"{p.entry.name}: bits after applying do not match the sender's")
        except BaseException:
            for p, old in reversed(undo):
                if p.entry.encoding == "xor":
                    p.target.bitwise_xor_(p.values)
                elif p.entry.encoding == "raw":
                    p.target.copy_(old)
                else:
                    p.target[p.index] = old
            raise
