"""The ``delta`` payload: only the bits that changed since the version the engines acknowledged.

The sender keeps a :class:`~agentrl.weights.delta.Snapshot` of the last acknowledged weights (bounded by
``snapshot_budget_bytes``; tensors beyond it travel ``raw``) and encodes one delta payload
(:mod:`agentrl.engine.delta` format) that any transport carrying ``"delta"`` moves: ``disk`` (a file and
``/update_weights_from_delta``, the default) or ``broadcast`` (one ``uint8`` tensor over the process
group and ``/update_weights_from_delta_distributed``). Full syncs go over the same transport.

An engine that refuses a delta -- corrupt, out of order, a base that is not what the snapshot says --
keeps its old weights; this sender then gives those engines full weights, so every sync still ends with
all engines on the new version. A transport that can reach some engines (``disk``) sends them to exactly
the refusing ones; a collective (``broadcast``) needs every member, so all engines receive the full
weights (the ones that took the delta get the same bits again).

The first sync (no acknowledged snapshot yet) is a full sync. A sync that fails outright invalidates the
snapshot, so the next one is full again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from agentrl.engine.weight_loading import EMBEDDED_ENGINE
from agentrl.weights.delta import Snapshot, encode_delta
from agentrl.weights.engines import CallResult
from agentrl.weights.sync import PayloadOptions, SyncReport, WeightSync
from agentrl.weights.transport import WeightSyncError

if TYPE_CHECKING:
    import torch


class DeltaOptions(PayloadOptions):
    """The ``delta`` payload's own options."""

    snapshot_budget_bytes: int = Field(8 << 30, ge=0, description="bytes of the last acknowledged weights kept to diff "
                                       "against; tensors beyond it travel raw")
    snapshot_device: str | None = Field("cpu", description="where the snapshot lives (null: next to the trainer's tensors, "
                                        "e.g. on the GPU for a fast diff)")
    encoding: Literal["auto", "int32", "gap16", "gap32", "xor", "raw"] = Field("auto", description="how changed positions are coded")
    level: int = Field(1, ge=1, le=22, description="zstd level (1: on bf16 deltas as small as 3, and 3x faster)")


class DeltaSync(WeightSync):
    """``delta`` (see module doc); its options are :class:`DeltaOptions` plus the transport's."""

    payload = "delta"
    Options = DeltaOptions
    needs_engine = EMBEDDED_ENGINE  # the delta routes are agentrl's engine's (SGLang has none)

    def __init__(self, engine_urls: Sequence[str], **values: Any) -> None:
        super().__init__(engine_urls, **values)
        self.snapshot = Snapshot(self.options.snapshot_budget_bytes, device=self.options.snapshot_device)
        self.encoding = self.options.encoding
        self.level = self.options.level

    def _push(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        try:
            if not self.snapshot.valid:
                report = self.push_full(tensors, weight_version)
                report.fallback = "no acknowledged snapshot yet (first sync)"
            else:
                report = self._push_delta(tensors, weight_version)
        except Exception:
            self.snapshot.invalidate()
            raise
        self.snapshot.record(tensors, weight_version)
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
            diffs=self.snapshot.diffs(tensors),  # one fused pass when the snapshot is flat (all in budget)
        )
        results, sent = self.deliver(payload, {"weight_version": weight_version, "base_version": base})
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
            full = self.push_full(tensors, weight_version, rejected)
            report.bytes_sent += full.bytes_sent
            report.fallback = "; ".join(f"{r.url}: {r.error.message}" for r in failed)
            report.details["rejected_engines"] = rejected
            report.details["full_sync_engines"] = full.engines
        return report

    def deliver(self, payload: bytes, body: dict[str, Any]) -> tuple[list[CallResult], int]:
        """Hand ``payload`` to every engine over the transport; each engine's answer and the bytes sent."""
        return self.via.send_delta(payload, body), len(payload)

    def close(self) -> None:
        super().close()
        self.snapshot.clear()
