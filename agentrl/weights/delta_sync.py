"""Delta mode: send only the bits that changed since the version the engines acknowledged.

The sender keeps a :class:`~agentrl.weights.delta.Snapshot` of the last acknowledged weights (bounded by
``snapshot_budget_bytes``; tensors beyond it travel ``raw``) and encodes a delta payload
(:mod:`agentrl.engine.delta` format). Transports (``transport=``):

* ``"disk"`` (default): the payload is written to a file (tmpfs when available) and each engine applies
  it with ``/update_weights_from_delta``. Full syncs go through :class:`~agentrl.weights.disk_sync.DiskSync`.
* ``"broadcast"``: no file. The sender opens a process group with every engine, exactly as the
  ``broadcast`` mode does (``/init_weights_update_group``; ``gloo`` on CPU, ``nccl`` for CUDA tensors),
  posts ``/update_weights_from_delta_distributed`` (``group_name``, ``nbytes``, ``base_version``,
  ``weight_version``) to every engine and broadcasts the payload from rank 0 as one ``uint8`` tensor.
  Full syncs are :class:`~agentrl.weights.broadcast_sync.BroadcastSync` over the same group.

An engine that refuses a delta -- corrupt, out of order, a base that is not what the snapshot says --
keeps its old weights; this sender then gives those engines a full sync, so every sync still ends with
all engines on the new version. Over ``disk`` exactly the refusing engines get it; over ``broadcast`` a
collective needs every member, so all engines receive the full weights (the ones that took the delta
get the same bits again). As in the ``broadcast`` mode, an engine that refuses the call before joining
the collective (no such group, a malformed body) leaves rank 0 waiting until ``group_timeout_s``.

The first sync (no acknowledged snapshot yet) is a full sync. A sync that fails outright invalidates the
snapshot, so the next one is full again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.weights.bucket import DEFAULT_BUCKET_BYTES, unique_named_tensors
from agentrl.weights.delta import Snapshot, encode_delta
from agentrl.weights.engines import CallResult
from agentrl.weights.sync import SyncReport, WeightSync, WeightSyncError, full_bytes

if TYPE_CHECKING:
    import torch

    from agentrl.weights.broadcast_sync import BroadcastSync
    from agentrl.weights.disk_sync import DiskSync

DEFAULT_SNAPSHOT_BUDGET = 8 << 30
TRANSPORTS = ("disk", "broadcast")


class DeltaSync(WeightSync):
    """``delta`` mode (see module doc).

    ``encoding``: ``auto`` or one of ``int32``, ``gap16``, ``gap32``, ``xor``, ``raw``. ``level``: zstd
    level (default 1: on bf16 deltas as small as level 3, and 3x faster). ``snapshot_device``: where the
    snapshot lives (``None``: next to the trainer's tensors, e.g. on the GPU for a fast diff).
    ``transport``: ``disk`` or ``broadcast``. ``directory`` is for ``disk``; ``bucket_bytes``,
    ``backend``, ``master_address`` and ``group_timeout_s`` for ``broadcast`` (as in that mode).
    """

    mode = "delta"

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        transport: str = "disk",
        directory: str | Path | None = None,
        snapshot_budget_bytes: int = DEFAULT_SNAPSHOT_BUDGET,
        snapshot_device: str | None = "cpu",
        encoding: str = "auto",
        level: int = 1,
        flush_cache: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        backend: str | None = None,
        master_address: str = "127.0.0.1",
        group_timeout_s: float = 600.0,
        timeout: float = 600.0,
        router_url: str | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown delta transport {transport!r}; choose from {TRANSPORTS}")
        if transport == "broadcast" and directory is not None:
            raise ValueError("'directory' is for the disk transport; the broadcast transport writes no files")
        super().__init__(engine_urls, timeout=timeout, router_url=router_url)
        self.transport = transport
        self.snapshot = Snapshot(snapshot_budget_bytes, device=snapshot_device)
        self.encoding = encoding
        self.level = level
        self.flush_cache = flush_cache
        self._owns_root = False
        self.root: Path | None = None
        self.full_sync: DiskSync | BroadcastSync
        self._backend = backend or "gloo"  # broadcast: set from the tensors' device on every sync
        if transport == "disk":
            from agentrl.weights.disk_sync import DiskSync, default_weights_root

            self._owns_root = directory is None
            self.root = Path(directory) if directory is not None else default_weights_root(self)
            self.root.mkdir(parents=True, exist_ok=True)
            self.full_sync = DiskSync(
                engine_urls, directory=self.root / "full", flush_cache=flush_cache, timeout=timeout, router_url=router_url
            )
        else:
            from agentrl.weights.broadcast_sync import BroadcastSync

            self.full_sync = BroadcastSync(
                engine_urls,
                bucket_bytes=bucket_bytes,
                backend=backend,
                master_address=master_address,
                # one group per sender: a group left behind by a crashed sender never blocks a new one
                group_name=f"agentrl_delta_{os.getpid()}_{id(self):x}",
                group_timeout_s=group_timeout_s,
                flush_cache=flush_cache,
                timeout=timeout,
                router_url=router_url,
            )

    def _push(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        unique = unique_named_tensors(tensors)
        if self.transport == "broadcast":
            self._backend = self.full_sync.backend_for(unique)
        try:
            if not self.snapshot.valid:
                report = self._full(unique, weight_version, self.engine_urls)
                report.mode, report.fallback = self.mode, "no acknowledged snapshot yet (first sync)"
            else:
                report = self._push_delta(unique, weight_version)
        except Exception:
            self.snapshot.invalidate()
            raise
        self.snapshot.record(unique, weight_version)
        report.full_bytes = full_bytes(unique)
        report.details["snapshot_bytes"] = self.snapshot.bytes_used
        report.details["transport"] = self.transport
        return report

    def _full(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str, urls: Sequence[str]) -> SyncReport:
        """A full sync of the engines at ``urls`` (over ``broadcast``: of every engine, see module doc)."""
        if self.transport == "disk":
            return self.full_sync.push_to(tensors, weight_version, urls)
        return self.full_sync.push(tensors, weight_version)

    def _push_delta(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        base = self.snapshot.version
        payload, stats = encode_delta(
            self.snapshot.triples(tensors),
            base_version=base,
            new_version=weight_version,
            encoding=self.encoding,
            level=self.level,
        )
        body = {"weight_version": weight_version, "base_version": base}
        results, sent = self.deliver(payload, body)
        failed = [r for r in results if r.error is not None]
        unreachable = [r for r in failed if not r.error.rejected]
        if unreachable:
            raise WeightSyncError(f"delta sync of {weight_version!r} failed: {unreachable[0].error}")
        report = SyncReport(
            self.mode,
            weight_version,
            sent,
            stats.full_bytes,
            0.0,
            details={
                "changed_fraction": stats.changed_fraction,
                "encoded_bytes": stats.raw_bytes,
                "encodings": stats.encodings,
            },
        )
        if failed:
            # The refusing engines kept their old weights; bring them up to date with full weights.
            rejected = [r.url for r in failed]
            full = self._full(tensors, weight_version, rejected)
            report.bytes_sent += full.bytes_sent
            report.fallback = "; ".join(f"{r.url}: {r.error.message}" for r in failed)
            report.details["rejected_engines"] = rejected
            report.details["full_sync_engines"] = rejected if self.transport == "disk" else self.engine_urls
        return report

    def deliver(self, payload: bytes, body: dict[str, Any]) -> tuple[list[CallResult], int]:
        """Hand ``payload`` to every engine over the transport; each engine's answer and the bytes sent."""
        if self.transport == "disk":
            return self._deliver_file(payload, body), len(payload)
        return self._deliver_broadcast(payload, body), len(payload)

    def _deliver_file(self, payload: bytes, body: dict[str, Any]) -> list[CallResult]:
        assert self.root is not None
        path = self.root / f"delta-{os.getpid()}-{id(self)}.bin"
        self.write_payload(payload, path)
        try:
            return self.engines.call_all("/update_weights_from_delta", {**body, "path": str(path)})
        finally:
            path.unlink(missing_ok=True)

    def _deliver_broadcast(self, payload: bytes, body: dict[str, Any]) -> list[CallResult]:
        from agentrl.engine.weight_group import broadcast_bytes

        group_sync = self.full_sync
        group = group_sync.ensure_group(self._backend)
        device = _device_for(group_sync.group_backend)
        body = {**body, "group_name": group_sync.group_name, "nbytes": len(payload)}
        answers = self.engines.submit_all("/update_weights_from_delta_distributed", body)
        try:
            # Every engine joins the broadcast before judging the payload (rank 0 would stall otherwise).
            broadcast_bytes(payload, group, device)
        except Exception as exc:
            group_sync.close_group()
            raise WeightSyncError(f"broadcasting the delta failed: {exc}") from exc
        results = answers()
        if any(r.error is not None and not r.error.rejected for r in results):
            group_sync.close_group()  # an engine failed inside the collective: the group is not trusted
        return results

    def write_payload(self, payload: bytes, path: Path) -> None:
        """Write the payload where the engines read it (renamed into place: never seen half-written)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(payload)
        tmp.rename(path)

    def close(self) -> None:
        super().close()
        self.full_sync.close()
        self.snapshot.clear()
        if self._owns_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def _device_for(backend: str | None) -> Any:
    """Where the payload tensor must live for ``backend`` (NCCL only moves CUDA tensors)."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
