"""The ``tensor`` transport: flattened per-dtype buckets handed to ``/update_weights_from_tensor`` without
a disk trip (full weights only: the engine route takes tensors); the ``tensor`` mode.

Handles (``handles=``; the ``tensor`` mode also reads its old spelling ``transport=cuda_ipc``):

* ``"shm"`` (CPU, same host): each bucket lives in a shared-memory segment; the request carries only
  pickled handles (SGLang's ``MultiprocessingSerializer`` format, ``load_format: null``) to per-tensor
  views of it, so the engine maps the segment and copies straight out of it.
* ``"cuda_ipc"`` (GPU, colocated): the same request with buckets on the GPU; torch's reductions turn
  each bucket's storage into one CUDA IPC handle. Buckets are persistent staging buffers reused across
  syncs, so the engine opens each handle once (torch caches opened handles by storage) and later syncs
  are device-to-device copies. Needs the engine on the same GPU(s); not runnable on CPU-only machines
  (bitwise on one H200: ``benchmarks/gpu_sync_check.py --mode ipc``). Shared-memory segments, in
  contrast, are made fresh for every sync.
* ``"safetensors"`` (any host): each bucket serialised into the HTTP body (one extra copy).

Layout (``flat=``): with ``None`` (the default) every engine whose ``/server_info`` names it
``agentrl-embedded`` gets whole buckets (``load_format: "flat_buckets"``, :mod:`agentrl.engine.weight_loading`):
one handle per bucket instead of one per tensor, and for ``cuda_ipc`` one bucket per dtype, all in ONE
request whose handles the engine keeps open across syncs (the staging buffers persist), so a sync is one
staging copy (fused, into views kept from the last sync of the same tensors), one request and one fused
copy on the engine (whose views and checks are kept too). The engines' answers say which version they
now hold, so the sync's version check asks no engine again. Other engines (SGLang) get SGLang's per-tensor list;
``flat=True`` / ``False`` forces either.

The version is set with the last request only, so engines report the new version only once they hold
every bucket. Buckets are kept alive until the engines answer (the engine reads from them). ``Sent.details
["timings"]`` splits the seconds: ``stage_s`` (copies into the buckets, until on the device),
``export_s`` (handles and request bodies), ``request_s`` (the engines' answers), and the slowest engine's
own ``ipc_open_s`` / ``check_s`` / ``wait_s`` / ``copy_s`` / ``version_s`` summed over requests.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import Field

from agentrl.weights.bucket import DEFAULT_BUCKET_BYTES, Bucket, make_buckets
from agentrl.weights.engines import CallResult, raise_errors
from agentrl.weights.sync import Preset
from agentrl.weights.transport import Sent, Transport, TransportOptions, WeightSyncError

if TYPE_CHECKING:
    import torch

Handles = Literal["shm", "cuda_ipc", "safetensors"]
HANDLES: tuple[str, ...] = get_args(Handles)


class StagingBuffers:
    """Bucket buffers kept across syncs (same layout each time), so handles stay valid and open once."""

    def __init__(self, device: str, *, shared: bool, persistent: bool) -> None:
        self.device = device
        self.shared = shared
        self.persistent = persistent
        self._buffers: dict[tuple[int, str, int], torch.Tensor] = {}
        self.keys: dict[int, str] = {}  # data_ptr of a persistent buffer -> its stable key (for the engine)

    def allocate(self, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Persistent buffer ``index`` for a bucket of ``numel`` elements of ``dtype`` (made on first use)."""
        key = (index, str(dtype), numel)
        buf = self._buffers.get(key)
        if buf is None:
            import torch

            buf = torch.empty(numel, dtype=dtype, device=self.device)
            if self.shared and buf.device.type == "cpu":
                buf.share_memory_()
            if self.persistent:
                self._buffers[key] = buf
                self.keys[buf.data_ptr()] = f"{index}:{key[1]}:{numel}"
        return buf

    def key_of(self, flat: torch.Tensor) -> str | None:
        """The stable key of a persistent buffer (``None`` for a fresh one)."""
        return self.keys.get(flat.data_ptr()) if self.persistent else None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
        self.keys.clear()


class TensorOptions(TransportOptions):
    """Options of the ``tensor`` transport."""

    handles: Handles = Field("shm", description="shm (CPU, same host), cuda_ipc (GPU, colocated) or safetensors (in the body)")
    bucket_bytes: int = Field(DEFAULT_BUCKET_BYTES, ge=1, description="size of one flattened bucket")
    device: str | None = Field(None, description="where buckets are staged (null: cuda for cuda_ipc, else cpu)")
    flat: bool | None = Field(None, description="whole buckets (true) or SGLang's per-tensor list (false); null: "
                              "whole buckets to engines that take them")


class TensorTransport(Transport):
    """``tensor`` (see module doc)."""

    name = "tensor"
    carries = frozenset({"full"})
    Options = TensorOptions
    host_local = True  # shared memory and CUDA IPC handles open only on the sender's host

    def __init__(self, engines: Any, options: TensorOptions | None = None, **values: Any) -> None:
        super().__init__(engines, options, **values)
        self.handles = self.options.handles
        self._takes_flat: dict[str, bool] = {}  # engine URL -> whether it took flat buckets (asked once)
        self._kept_by: set[str] = set()  # engines holding our CUDA buckets open (dropped on close)
        self._staged: tuple[list, list[Bucket], list[torch.Tensor]] | None = None  # see _stage
        self.owner = f"{os.uname().nodename}:{os.getpid()}:{id(self):x}"
        staging_device = self.options.device or ("cuda" if self.handles == "cuda_ipc" else "cpu")
        # CPU shared-memory segments are made fresh per sync: with torch's file_system sharing, a reused
        # segment could no longer be opened by the engine on the next sync (observed: "unable to open
        # shared memory object ... No such file or directory").
        self.staging = StagingBuffers(staging_device, shared=self.handles == "shm", persistent=self.handles == "cuda_ipc")

    def takes_flat(self, urls: Sequence[str]) -> bool:
        """Whether every engine at ``urls`` takes ``flat_buckets`` (asked once per engine, see module doc)."""
        if self.handles == "safetensors":
            return False
        if self.options.flat is not None:
            return self.options.flat
        from agentrl.engine.weight_loading import EMBEDDED_ENGINE

        unknown = [u for u in urls if u not in self._takes_flat]
        if unknown:
            for result in self.engines.call_all("/server_info", urls=unknown):
                value = result.value if isinstance(result.value, dict) else {}
                self._takes_flat[result.url] = value.get("engine") == EMBEDDED_ENGINE
        return all(self._takes_flat.get(u, False) for u in urls)

    def send_full(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str, urls: Sequence[str]) -> Sent:
        fmt = "safetensors" if self.handles == "safetensors" else None
        timings = {"stage_s": 0.0, "export_s": 0.0, "request_s": 0.0}
        flat = self.takes_flat(urls)
        start = time.perf_counter()
        buckets = self._stage(tensors, fmt, one_per_dtype=flat and self.handles == "cuda_ipc")
        on_cuda = sorted({b.flat.device for b in buckets if b.flat.device.type == "cuda"}, key=str)
        if on_cuda:
            import torch

            for device in on_cuda:
                torch.cuda.synchronize(device)  # copies must land before the engine reads
        timings["stage_s"] = time.perf_counter() - start
        # cuda_ipc: all buckets in one request (persistent staging, handles kept open); shm and safetensors:
        # a request per bucket, so only one bucket's segment or body exists at a time.
        groups = [buckets] if flat and self.handles == "cuda_ipc" and buckets else [[b] for b in buckets]
        sent = 0
        for i, group in enumerate(groups):
            last = i == len(groups) - 1
            began = time.perf_counter()
            body = self._body(group, weight_version if last else None, fmt, flat=flat, flush=self.options.flush_cache and last)
            requested = time.perf_counter()
            timings["export_s"] += requested - began
            try:
                results = raise_errors(self.engines.call_all("/update_weights_from_tensor", body, urls=urls))
            except Exception as exc:
                raise WeightSyncError(f"tensor sync of {weight_version!r}, request {i} of {len(groups)}: {exc}") from exc
            timings["request_s"] += time.perf_counter() - requested
            _add_engine_timings(timings, results)
            if last:  # the version each engine holds after the last request (agentrl's engines say)
                versions = {r.url: r.value.get("weight_version") for r in results if isinstance(r.value, dict)}
            sent += sum(b.nbytes for b in group) if fmt is None else len(body["serialized_named_tensors"][0])
            if flat and on_cuda:
                self._kept_by.update(urls)
        if not buckets:
            versions = {}
            self.engines.call_all("/update_weight_version", {"new_version": weight_version}, urls=urls)
        details = {"handles": self.handles, "buckets": len(buckets), "requests": len(groups),
                   "layout": "flat_buckets" if flat else "per_tensor", "staging_bytes": self.staging.nbytes,
                   "timings": {k: round(v, 6) for k, v in timings.items()},
                   "engine_versions": {u: str(v) for u, v in versions.items() if isinstance(v, str)}}
        return Sent(sent, list(urls), details)

    def _stage(self, tensors: list[tuple[str, torch.Tensor]], fmt: str | None, *, one_per_dtype: bool) -> list[Bucket]:
        """The buckets of this sync, filled. Persistent CUDA staging of the same tensors as last time
        (names, shapes, dtypes, devices) reuses the buckets and their per-tensor views: one fused copy,
        no per-tensor Python. ``one_per_dtype``: every dtype in one bucket (persistent buffers sent all
        at once: ``bucket_bytes`` bounds nothing there, and fewer buckets mean fewer handles)."""
        import torch

        if fmt == "safetensors":
            return list(make_buckets(tensors, bucket_bytes=self.options.bucket_bytes))
        signature = [(name, t.shape, t.dtype, t.device) for name, t in tensors] if self.staging.persistent else None
        if signature is not None and self._staged is not None and self._staged[0] == signature:
            _, buckets, views = self._staged
            with torch.no_grad():
                torch._foreach_copy_(views, [t for _, t in tensors])
            return buckets
        limit = max(self.options.bucket_bytes, sum(t.numel() * t.element_size() for _, t in tensors)) if one_per_dtype \
            else self.options.bucket_bytes
        buckets = list(make_buckets(tensors, bucket_bytes=limit, allocate=self.staging.allocate))
        devices = {t.device for _, t in tensors}
        if signature is not None and devices == {b.flat.device for b in buckets} and len(devices) == 1:
            views = [b.flat[e.offset : e.offset + e.numel].view(e.shape) for b in buckets for e in b.entries]
            by_name = dict(zip((e.name for b in buckets for e in b.entries), views, strict=True))
            self._staged = (signature, buckets, [by_name[name] for name, _ in tensors])  # in the tensors' order
        return buckets

    def _body(self, group: list[Bucket], weight_version: str | None, fmt: str | None, *, flat: bool,
              flush: bool) -> dict[str, Any]:
        from agentrl.engine.weight_loading import flat_buckets_body, update_weights_from_tensor_body

        # The engine owns the payload format (SGLang's): safetensors bytes, or ForkingPickler handles
        # (shared-memory file names for CPU storages, CUDA IPC handles for GPU ones).
        if flat:
            return flat_buckets_body(
                [(self.staging.key_of(b.flat), b.flat, [(e.name, e.shape, e.offset, e.numel) for e in b.entries])
                 for b in group],
                owner=self.owner, weight_version=weight_version, flush_cache=flush)
        named = [pair for b in group for pair in b.named_tensors()]
        return update_weights_from_tensor_body(named, weight_version=weight_version, fmt=fmt, flush_cache=flush)

    def close(self) -> None:
        if self._kept_by:  # let the engines unmap our staging buffers, so their memory can be freed
            from agentrl.engine.weight_loading import flat_buckets_body

            body = flat_buckets_body([], owner=self.owner, flush_cache=False, drop_kept=True)
            self.engines.call_all("/update_weights_from_tensor", body, urls=sorted(self._kept_by))
            self._kept_by.clear()
        self._staged = None
        self.staging.clear()


def _add_engine_timings(timings: dict[str, float], results: list[CallResult]) -> None:
    """Add the slowest engine's own timings (``timings`` in its answer) of one request."""
    answered = [r.value.get("timings") for r in results if isinstance(r.value, dict)]
    for key in sorted({k for t in answered if isinstance(t, dict) for k in t}):
        values = [float(t[key]) for t in answered if isinstance(t, dict) and isinstance(t.get(key), int | float)]
        if values:
            timings[key] = timings.get(key, 0.0) + max(values)


class TensorSync(Preset):
    """The ``tensor`` mode: full weights over :class:`TensorTransport`; ``transport`` may name its handles (the
    old spelling, ``{"transport": "cuda_ipc"}``)."""

    default_transport = "tensor"

    @classmethod
    def normalize(cls, values: dict[str, Any]) -> dict[str, Any]:
        if values.get("transport") in HANDLES:
            if "handles" in values:
                raise ValueError("sync_options: transport names the handles; give handles once")
            return {**values, "transport": cls.default_transport, "handles": values["transport"]}
        return values
