"""Delta mode: send only the bits that changed since the version the engines acknowledged.

The sender keeps a :class:`~agentrl.weights.delta.Snapshot` of the last acknowledged weights (bounded by
``snapshot_budget_bytes``; tensors beyond it travel ``raw``), encodes a delta payload
(:mod:`agentrl.engine.delta` format), writes it to a file (tmpfs when available) and asks each engine to
apply it with ``/update_weights_from_delta``. An engine that refuses it -- corrupt, out of order, a base
that is not what the snapshot says -- keeps its old weights; this sender then gives exactly those
engines a full sync (disk), so every sync still ends with all engines on the new version.

The first sync (no acknowledged snapshot yet) is a full sync. A sync that fails outright invalidates the
snapshot, so the next one is full again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.weights.bucket import unique_named_tensors
from agentrl.weights.delta import Snapshot, encode_delta
from agentrl.weights.disk_sync import DiskSync, default_weights_root
from agentrl.weights.sync import SyncReport, WeightSync, WeightSyncError, full_bytes

if TYPE_CHECKING:
    import torch

DEFAULT_SNAPSHOT_BUDGET = 8 << 30


class DeltaSync(WeightSync):
    """``delta`` mode over files.

    ``encoding``: ``auto`` or one of ``int32``, ``gap16``, ``gap32``, ``xor``, ``raw``. ``level``: zstd
    level (default 1: on bf16 deltas as small as level 3, and 3x faster). ``snapshot_device``: where the
    snapshot lives (``None``: next to the trainer's tensors, e.g. on the GPU for a fast diff).
    """

    mode = "delta"

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        directory: str | Path | None = None,
        snapshot_budget_bytes: int = DEFAULT_SNAPSHOT_BUDGET,
        snapshot_device: str | None = "cpu",
        encoding: str = "auto",
        level: int = 1,
        flush_cache: bool = True,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(engine_urls, timeout=timeout)
        self._owns_root = directory is None
        self.root = Path(directory) if directory is not None else default_weights_root(self)
        self.root.mkdir(parents=True, exist_ok=True)
        self.snapshot = Snapshot(snapshot_budget_bytes, device=snapshot_device)
        self.encoding = encoding
        self.level = level
        self.flush_cache = flush_cache
        self.full_sync = DiskSync(engine_urls, directory=self.root / "full", flush_cache=flush_cache, timeout=timeout)

    def _push(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        unique = unique_named_tensors(tensors)
        try:
            if not self.snapshot.valid:
                report = self.full_sync.push_to(unique, weight_version, self.engine_urls)
                report.mode, report.fallback = self.mode, "no acknowledged snapshot yet (first sync)"
            else:
                report = self._push_delta(unique, weight_version)
        except Exception:
            self.snapshot.invalidate()
            raise
        self.snapshot.record(unique, weight_version)
        report.full_bytes = full_bytes(unique)
        report.details["snapshot_bytes"] = self.snapshot.bytes_used
        return report

    def _push_delta(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        base = self.snapshot.version
        payload, stats = encode_delta(
            self.snapshot.triples(tensors),
            base_version=base,
            new_version=weight_version,
            encoding=self.encoding,
            level=self.level,
        )
        path = self.root / f"delta-{os.getpid()}-{id(self)}.bin"
        self.write_payload(payload, path)
        body = {"path": str(path), "weight_version": weight_version, "base_version": base}
        try:
            results = self.engines.call_all("/update_weights_from_delta", body)
        finally:
            path.unlink(missing_ok=True)
        failed = [r for r in results if r.error is not None]
        unreachable = [r for r in failed if not r.error.rejected]
        if unreachable:
            raise WeightSyncError(f"delta sync of {weight_version!r} failed: {unreachable[0].error}")
        report = SyncReport(
            self.mode,
            weight_version,
            len(payload),
            stats.full_bytes,
            0.0,
            details={
                "changed_fraction": stats.changed_fraction,
                "encoded_bytes": stats.raw_bytes,
                "encodings": stats.encodings,
            },
        )
        if failed:
            # The engines kept their old weights; bring exactly those up to date with full weights.
            rejected = [r.url for r in failed]
            full = self.full_sync.push_to(tensors, weight_version, rejected)
            report.bytes_sent += full.bytes_sent
            report.fallback = "; ".join(f"{r.url}: {r.error.message}" for r in failed)
            report.details["full_sync_engines"] = rejected
        return report

    def write_payload(self, payload: bytes, path: Path) -> None:
        """Write the payload where the engines read it (renamed into place: never seen half-written)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(payload)
        tmp.rename(path)

    def close(self) -> None:
        super().close()
        self.full_sync.close()
        self.snapshot.clear()
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
