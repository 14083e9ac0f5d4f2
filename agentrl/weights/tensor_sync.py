"""The ``tensor`` transport: flattened per-dtype buckets handed to ``/update_weights_from_tensor`` without
a disk trip (full weights only: the engine route takes tensors); the ``tensor`` mode.

Handles (``handles=``; the ``tensor`` mode's ``transport=``):

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

The version is set with the last bucket only, so engines report the new version only once they hold
every bucket. Buckets are kept alive until the engines answer (the engine reads from them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agentrl.weights.bucket import DEFAULT_BUCKET_BYTES, make_buckets
from agentrl.weights.engines import EngineClient, raise_errors
from agentrl.weights.sync import FullSync
from agentrl.weights.transport import Sent, Transport, WeightSyncError

if TYPE_CHECKING:
    import torch

HANDLES = ("shm", "cuda_ipc", "safetensors")


class StagingBuffers:
    """Bucket buffers kept across syncs (same layout each time), so handles stay valid and open once."""

    def __init__(self, device: str, *, shared: bool, persistent: bool) -> None:
        self.device = device
        self.shared = shared
        self.persistent = persistent
        self._buffers: dict[tuple[int, str, int], torch.Tensor] = {}

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
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


class TensorTransport(Transport):
    """``tensor`` (see module doc). ``bucket_bytes``: size of one flattened bucket; ``device``: where the
    buckets are staged (default: ``cuda`` for ``cuda_ipc``, else ``cpu``)."""

    name = "tensor"
    carries = frozenset({"full"})

    def __init__(
        self,
        engines: EngineClient,
        *,
        handles: str = "shm",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        if handles not in HANDLES:
            raise ValueError(f"unknown tensor transport {handles!r}; choose from {HANDLES}")
        super().__init__(engines)
        self.handles = handles
        self.bucket_bytes = bucket_bytes
        self.flush_cache = flush_cache
        staging_device = device or ("cuda" if handles == "cuda_ipc" else "cpu")
        # CPU shared-memory segments are made fresh per sync: with torch's file_system sharing, a reused
        # segment could no longer be opened by the engine on the next sync (observed: "unable to open
        # shared memory object ... No such file or directory").
        self.staging = StagingBuffers(staging_device, shared=handles == "shm", persistent=handles == "cuda_ipc")

    def send_full(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str, urls: Sequence[str]) -> Sent:
        from agentrl.engine.weight_loading import update_weights_from_tensor_body

        fmt = "safetensors" if self.handles == "safetensors" else None
        allocate = None if fmt == "safetensors" else self.staging.allocate
        buckets = list(make_buckets(tensors, bucket_bytes=self.bucket_bytes, allocate=allocate))
        sent = 0
        for i, staged in enumerate(buckets):
            if staged.flat.device.type == "cuda":
                import torch

                torch.cuda.synchronize(staged.flat.device)  # copies must land before the engine reads
            last = i == len(buckets) - 1
            # The engine owns the payload format (SGLang's): safetensors bytes, or ForkingPickler handles
            # (shared-memory file names for CPU storages, CUDA IPC handles for GPU ones).
            body = update_weights_from_tensor_body(
                staged.named_tensors(),
                weight_version=weight_version if last else None,
                fmt=fmt,
                flush_cache=self.flush_cache and last,
            )
            try:
                raise_errors(self.engines.call_all("/update_weights_from_tensor", body, urls=urls))
            except Exception as exc:
                raise WeightSyncError(f"tensor sync of {weight_version!r}, bucket {i}: {exc}") from exc
            sent += staged.nbytes if fmt is None else len(body["serialized_named_tensors"][0])
        if not buckets:
            self.engines.call_all("/update_weight_version", {"new_version": weight_version}, urls=urls)
        details = {"handles": self.handles, "buckets": len(buckets), "staging_bytes": self.staging.nbytes}
        return Sent(sent, list(urls), details)

    def close(self) -> None:
        self.staging.clear()


class TensorSync(FullSync):
    """The ``tensor`` mode: full weights over :class:`TensorTransport`; ``transport`` picks its handles."""

    def __init__(self, engine_urls: Sequence[str], *, transport: str = "shm", **options: Any) -> None:
        super().__init__(engine_urls, transport=TensorTransport, handles=transport, **options)
