"""Weight payloads for ``/update_weights_from_tensor``, checkpoint reading, the weights checksum, and
the smg fan-out selector that reaches every engine's weight routes at once.

``/update_weights_from_tensor`` body (SGLang's shape)::

    {"serialized_named_tensors": [S], "load_format": F, "flush_cache": true, "weight_version": "v3"}

``S`` is one string per tensor-parallel rank (the embedded engine has one rank, so one string):

* ``load_format: "safetensors"`` (agentrl's default, works between any two processes on any host):
  ``S = base64(safetensors.torch.save(named_tensors))``. Costs one copy through the HTTP body.
* ``load_format: null`` (SGLang's default): ``S = base64(ForkingPickler(list[(name, tensor)]))`` as
  SGLang's ``MultiprocessingSerializer`` writes it: torch's multiprocessing reductions put CUDA tensors
  in CUDA IPC handles (naming the GPU by UUID, :mod:`agentrl.engine.cuda_ipc`) and CPU tensors in shared memory. For CPU tensors the sender must use the
  ``file_system`` sharing strategy (the default ``file_descriptor`` one passes fds that only live over a
  Unix socket); :func:`serialize_named_tensors` sets it. The sender must keep the tensors alive until the
  request returns. Both sides must trust each other: this is pickle (as in SGLang), so the route takes it
  only from a caller presenting the run's secret (:mod:`agentrl.engine.server`).

* ``load_format: "flat_buckets"`` (agentrl's extension, used only with engines whose ``/server_info``
  says ``"engine": "agentrl-embedded"``): ``S = base64(ForkingPickler(P))`` with
  ``P = {"owner": str, "buckets": [{"key": str | None, "flat": 1-D tensor, "entries": [[name, shape,
  offset, numel], ...]}], "drop_kept": bool}`` (offsets in elements). One handle per bucket instead of
  one per tensor, and no per-tensor unpickling. CUDA buckets with a ``key`` are kept open by the engine
  under ``(owner, key)`` so the next sync from the same persistent staging buffer hits torch's IPC
  cache instead of mapping the memory again (the sender must synchronise before sending: a cache hit
  does not wait on the sender's event); ``drop_kept`` (with no buckets) lets go of the owner's buffers.
  A repeat of the kept layout (same owner, keys, memory and entries) reuses the views and the checked
  copy plan of the last one (:class:`FlatLayoutCache`). The answer carries ``weight_version``: the
  version the engine holds once the update is in (the sender needs no ``/server_info`` round trip).

Use :func:`serialize_named_tensors` / :func:`update_weights_from_tensor_body` (or
:func:`flat_buckets_body`) on the trainer side.

Checksum (``GET /weights_checksum`` and :func:`weights_checksum`): xxh3_64 of each parameter's raw
bytes (contiguous, native little-endian, its own dtype) in HF ``named_parameters`` order; the total is
xxh3_64 over ``name \\0 dtype \\0 shape \\0 per-tensor digest`` of every parameter in that order.

File manifest (:data:`CHECKSUM_MANIFEST`, written by :func:`write_checksum_manifest` next to the weight
files a sender puts on disk): ``{"algorithm": "xxh3_64", "files": {name: {"bytes": n, "xxh3_64": hex}}}``.
:func:`read_checkpoint` verifies it before reading any tensor; a damaged, truncated, missing or unlisted
weight file is a ``ValueError`` naming the file, and so is a directory without a manifest unless the caller
says it is absent on purpose.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FLAT_BUCKETS = "flat_buckets"
FORMATS = ("safetensors", None, FLAT_BUCKETS)
EMBEDDED_ENGINE = "agentrl-embedded"  # ``/server_info``'s ``engine``: the engines that take FLAT_BUCKETS
CHECKSUM_MANIFEST = "agentrl-checksums.json"
_CHUNK = 16 << 20

# smg's RL fan-out (``POST /v1/rl/engine/<path>?selector=...`` on a router started with ``--enable-rl``)
# requires a label selector; this one matches every registered worker (no worker has that engine name),
# whatever engine smg detected it as. The one definition for every fan-out client.
RL_FANOUT_SELECTOR = "engine!=agentrl-none"


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], fmt: str | None = "safetensors") -> str:
    """Serialise ``(name, tensor)`` pairs as one ``serialized_named_tensors`` entry (see module doc)."""
    items = [(name, t) for name, t in named_tensors]
    if fmt == "safetensors":
        from safetensors.torch import save

        # a copy each: safetensors refuses tensors that share storage (views into one flat bucket)
        data = save({name: t.detach().to("cpu", copy=True).contiguous() for name, t in items})
        return base64.b64encode(data).decode("ascii")
    if fmt is None:
        import torch.multiprocessing as mp  # registers torch's reductions with ForkingPickler

        from agentrl.engine.cuda_ipc import dumps

        mp.set_sharing_strategy("file_system")
        return base64.b64encode(dumps([(name, t.detach()) for name, t in items])).decode("ascii")
    raise ValueError(f"unknown load_format {fmt!r}; use 'safetensors' or None (flat buckets: flat_buckets_body)")


def update_weights_from_tensor_body(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    weight_version: str | None = None,
    fmt: str | None = "safetensors",
    flush_cache: bool = True,
) -> dict[str, Any]:
    """The JSON body of one ``/update_weights_from_tensor`` call."""
    return {
        "serialized_named_tensors": [serialize_named_tensors(named_tensors, fmt)],
        "load_format": fmt,
        "flush_cache": flush_cache,
        "weight_version": weight_version,
    }


FlatEntry = tuple[str, tuple[int, ...], int, int]  # name, shape, offset and numel in elements


def flat_buckets_body(
    buckets: Iterable[tuple[str | None, torch.Tensor, Iterable[FlatEntry]]],
    *,
    owner: str,
    weight_version: str | None = None,
    flush_cache: bool = True,
    drop_kept: bool = False,
) -> dict[str, Any]:
    """The body of one ``/update_weights_from_tensor`` call in the ``flat_buckets`` format (module doc):
    ``buckets`` are ``(key, flat, entries)``; the sender keeps every ``flat`` alive until the answer."""
    import torch.multiprocessing as mp

    from agentrl.engine.cuda_ipc import dumps

    mp.set_sharing_strategy("file_system")
    payload = {
        "owner": owner,
        "buckets": [{"key": key, "flat": flat.detach(), "entries": [[n, list(s), o, k] for n, s, o, k in entries]}
                    for key, flat, entries in buckets],
        "drop_kept": drop_kept,
    }
    return {
        "serialized_named_tensors": [base64.b64encode(dumps(payload)).decode("ascii")],
        "load_format": FLAT_BUCKETS,
        "flush_cache": flush_cache,
        "weight_version": weight_version,
    }


@dataclass
class FlatBuckets:
    """A received ``flat_buckets`` payload: named views into the flat buffers, and the buffers by key.

    ``layout``: what makes two payloads the same layout (owner, and each bucket's key, memory, size, dtype
    and entries), or ``None`` when a bucket has no key (fresh memory: nothing to reuse)."""

    owner: str
    tensors: dict[str, torch.Tensor]
    keyed: dict[str, torch.Tensor]
    drop_kept: bool
    layout: tuple | None = None


def _decode(payload: str | bytes) -> bytes:
    try:
        return base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    except ValueError as exc:
        raise ValueError(f"serialized_named_tensors is not valid base64: {exc}") from None


def _layout_of(owner: str, buckets: list) -> tuple | None:
    """The layout key of unpickled buckets (see :class:`FlatBuckets`), ``None`` unless every one is keyed."""
    import torch

    parts = []
    for bucket in buckets:
        flat = bucket.get("flat") if isinstance(bucket, dict) else None
        if not isinstance(flat, torch.Tensor) or bucket.get("key") is None:
            return None
        # the entries as unpickled (lists): the next payload's are compared with them in C, no loop here
        parts.append((str(bucket["key"]), flat.data_ptr(), flat.numel(), flat.dtype, str(flat.device),
                      bucket.get("entries")))
    return (owner, tuple(parts)) if parts else None


def deserialize_flat_buckets(payload: str | bytes, cache: FlatLayoutCache | None = None) -> FlatBuckets:
    """Inverse of :func:`flat_buckets_body`'s payload; ``ValueError`` naming what is malformed.

    With ``cache``: a payload of the layout received last (same owner, keys, memory and entries: the
    sender's persistent staging, still mapped here) reuses that payload's checked views instead of
    building one per entry again."""
    import math
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    data = _decode(payload)
    try:
        raw = ForkingPickler.loads(data)  # trusted trainer only, as in SGLang
    except Exception as exc:
        raise ValueError(f"flat_buckets payload could not be unpickled: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("buckets"), list) or not isinstance(raw.get("owner"), str):
        raise ValueError("a flat_buckets payload is a dict with 'owner' (str) and 'buckets' (list)")
    layout = _layout_of(raw["owner"], raw["buckets"]) if cache is not None else None
    if layout is not None:
        hit = cache.get(layout)
        if hit is not None:
            return FlatBuckets(raw["owner"], hit.tensors, hit.keyed, bool(raw.get("drop_kept", False)), layout)
    tensors: dict[str, torch.Tensor] = {}
    keyed: dict[str, torch.Tensor] = {}
    for i, bucket in enumerate(raw["buckets"]):
        flat = bucket.get("flat") if isinstance(bucket, dict) else None
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"bucket {i}: 'flat' must be a contiguous 1-D tensor")
        entries = bucket.get("entries")
        if not isinstance(entries, list):
            raise ValueError(f"bucket {i}: 'entries' must be a list")
        for entry in entries:
            try:
                name, shape, offset, numel = entry
                shape, offset, numel = tuple(int(d) for d in shape), int(offset), int(numel)
            except (TypeError, ValueError):
                raise ValueError(f"bucket {i}: entry {entry!r} is not [name, shape, offset, numel]") from None
            if not isinstance(name, str) or name in tensors:
                raise ValueError(f"bucket {i}: entry name {name!r} is not a new string")
            if numel != math.prod(shape) or offset < 0 or offset + numel > flat.numel() or min(shape, default=1) < 0:
                raise ValueError(f"{name}: elements {offset}..{offset + numel} of shape {shape} do not fit "
                                 f"a bucket of {flat.numel()}")
            tensors[name] = flat[offset : offset + numel].view(shape)
        key = bucket.get("key")
        if key is not None:
            keyed[str(key)] = flat
    return FlatBuckets(raw["owner"], tensors, keyed, bool(raw.get("drop_kept", False)), layout)


class CopyPlan:
    """The copies of one received layout into a model's tensors, grouped once: a fused ``_foreach_copy_``
    per (device, dtype), a plain copy where device or dtype differ. ``targets`` are the model's live
    tensors (``state_dict(keep_vars=True)``: parameters whose ``.data`` may be swapped, as releasing and
    resuming memory does, are still the objects written)."""

    def __init__(self, targets: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
        groups: dict[tuple[Any, Any], tuple[list, list]] = {}
        self.others: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pairs = [(targets[name], src) for name, src in tensors.items()]
        for dst, src in self.pairs:
            if src.device == dst.device and src.dtype == dst.dtype:
                dsts, srcs = groups.setdefault((dst.device, dst.dtype), ([], []))
                dsts.append(dst)
                srcs.append(src)
            else:
                self.others.append((dst, src))
        self.groups = list(groups.values())
        self.devices = sorted({dst.device for dst, _ in self.pairs if dst.device.type == "cuda"}, key=str)

    def still_fits(self) -> bool:
        """Whether every target still has its source's shape (a swapped ``.data`` could differ)."""
        return all(dst.shape == src.shape for dst, src in self.pairs)

    def __call__(self) -> None:
        """Copy (bitwise where dtypes match) and wait until the copies are on the device."""
        import torch

        with torch.no_grad():
            for dsts, srcs in self.groups:
                torch._foreach_copy_(dsts, srcs)
            for dst, src in self.others:
                dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
        for device in self.devices:
            torch.cuda.synchronize(device)


@dataclass
class CachedLayout:
    tensors: dict[str, torch.Tensor]
    keyed: dict[str, torch.Tensor]
    plan: CopyPlan | None = None
    model: Any = None  # the model ``plan`` was checked against


class FlatLayoutCache:
    """The last kept ``flat_buckets`` layout with its views and its checked :class:`CopyPlan`, so a
    repeat sync from the same staging buffers costs no per-tensor Python (views, name and shape checks,
    grouping). Holds at most one layout; holding it keeps its buffers mapped, so :meth:`clear` it when
    the engine lets go of the sender's buffers."""

    def __init__(self) -> None:
        self._layout: tuple | None = None
        self._entry: CachedLayout | None = None

    def get(self, layout: tuple) -> CachedLayout | None:
        return self._entry if layout == self._layout else None

    def put(self, received: FlatBuckets) -> CachedLayout:
        """Remember ``received`` (a keyed layout) unless it is the one held; returns its entry."""
        if received.layout is None:
            raise ValueError("only payloads whose buckets are all keyed can be cached")
        if received.layout != self._layout or self._entry is None:
            self._layout, self._entry = received.layout, CachedLayout(received.tensors, received.keyed)
        return self._entry

    @property
    def owner(self) -> str | None:
        """The sender whose layout is held."""
        return None if self._layout is None else self._layout[0]

    def clear(self) -> None:
        self._layout = self._entry = None


def deserialize_named_tensors(payload: str | bytes, fmt: str | None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`serialize_named_tensors` (and of ``flat_buckets`` payloads, as named views);
    raises ``ValueError`` on a malformed payload."""
    if fmt == FLAT_BUCKETS:
        return deserialize_flat_buckets(payload).tensors
    raw = _decode(payload)
    if fmt == "safetensors":
        from safetensors.torch import load

        try:
            return dict(load(raw))
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"serialized_named_tensors is not a safetensors payload: {exc}") from None
    if fmt is None:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing as mp

        mp.set_sharing_strategy("file_system")
        try:
            items = ForkingPickler.loads(raw)  # trusted trainer only, as in SGLang
        except Exception as exc:
            raise ValueError(f"serialized_named_tensors could not be unpickled: {exc}") from None
        if isinstance(items, dict):
            items = list(items.items())
        return {str(name): t for name, t in items}
    raise ValueError(f"unsupported load_format {fmt!r}; use one of {FORMATS}")


def file_digest(path: str | Path) -> str:
    """xxh3_64 of a file's bytes (read in chunks)."""
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksum_manifest(directory: str | Path, files: Iterable[str | Path]) -> Path:
    """Write :data:`CHECKSUM_MANIFEST` for ``files`` (inside ``directory``); returns its path."""
    directory = Path(directory)
    entries = {}
    for f in files:
        f = directory / Path(f).name
        entries[f.name] = {"bytes": f.stat().st_size, "xxh3_64": file_digest(f)}
    path = directory / CHECKSUM_MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"algorithm": "xxh3_64", "files": entries}, indent=1))
    tmp.rename(path)  # never seen half-written
    return path


def verify_checksum_manifest(directory: str | Path, weight_files: Iterable[Path]) -> bool:
    """Check ``weight_files`` against the directory's manifest; ``False`` when there is none. Raises
    ``ValueError`` naming the first file that is unlisted, missing, of another size or other bytes."""
    directory = Path(directory)
    path = directory / CHECKSUM_MANIFEST
    if not path.exists():
        return False
    try:
        manifest = json.loads(path.read_text())
        entries = manifest["files"]
        if manifest.get("algorithm") != "xxh3_64" or not isinstance(entries, dict):
            raise ValueError("unknown algorithm or no file list")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a valid checksum manifest: {exc}") from None
    unlisted = sorted({f.name for f in weight_files} - entries.keys())
    if unlisted:
        raise ValueError(f"{directory / unlisted[0]} is not listed in {CHECKSUM_MANIFEST}")
    for name, entry in sorted(entries.items()):
        f = directory / name
        if not f.is_file():
            raise ValueError(f"{f} is listed in {CHECKSUM_MANIFEST} but missing")
        size = f.stat().st_size
        if size != entry.get("bytes"):
            raise ValueError(f"{f} has {size} bytes, the manifest says {entry.get('bytes')} (truncated or padded)")
        if file_digest(f) != entry.get("xxh3_64"):
            raise ValueError(f"{f} fails its checksum: its bytes changed after it was written")
    return True


def read_checkpoint(model_dir: str | Path, *, require_manifest: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` (or ``pytorch_model*.bin``) files of an HF model directory,
    checked against its checksum manifest first. A directory without one is refused (``ValueError``)
    unless ``require_manifest`` is False (its bytes are then read unchecked). A missing directory or no
    weight files is ``FileNotFoundError``; a damaged file ``ValueError`` naming it."""
    import torch

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model_path {str(path)!r} is not a directory")
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin files in {str(path)!r}")
    if not verify_checksum_manifest(path, files) and require_manifest:
        raise ValueError(f"{str(path)!r} has no {CHECKSUM_MANIFEST}, so its bytes cannot be checked; write one "
                         "(write_checksum_manifest) or say it is absent on purpose ('allow_missing_manifest': true)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file

                tensors.update(load_file(str(f)))
            else:
                tensors.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as exc:  # safetensors and torch raise their own types for damaged files
            raise ValueError(f"cannot read {f}: {type(exc).__name__}: {exc}") from None
    return tensors


def tensor_digest(t: torch.Tensor) -> str:
    import torch
    import xxhash

    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_hexdigest(raw.tobytes())


def weights_checksum(named_params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Per-parameter and total checksum (see module docstring) -- the same on trainer and engine."""
    import xxhash

    total = xxhash.xxh3_64()
    per: dict[str, str] = {}
    for name, t in named_params:
        digest = tensor_digest(t)
        per[name] = digest
        meta = json.dumps([name, str(t.dtype), list(t.shape), digest])
        total.update(meta.encode())
    return {"algorithm": "xxh3_64", "total": total.hexdigest(), "parameters": per}
