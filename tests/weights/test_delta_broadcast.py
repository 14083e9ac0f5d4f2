"""The delta mode over the broadcast process group (gloo on CPU) against real engine processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from weights_sync_helpers import Trainer, assert_engines_equal, control_post, corrupt, engine_checksum

from agentrl.weights.delta_sync import DeltaSync
from agentrl.weights.engines import CallResult
from agentrl.weights.sync import make_sync


class RecordingDeltaSync(DeltaSync):
    """Remembers each payload it broadcast and what the engines held right after receiving it."""

    def __init__(self, *args: Any, corrupt: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.corrupt = corrupt
        self.sent: list[bytes] = []
        self.held_after: list[list[dict]] = []

    def deliver(self, payload: bytes, body: dict[str, Any]) -> tuple[list[CallResult], int]:
        if self.corrupt:
            payload = corrupt(payload)
        self.sent.append(payload)
        results, sent = super().deliver(payload, body)
        self.held_after.append([engine_checksum(u) for u in self.engine_urls])
        return results, sent


def test_make_sync_selects_the_broadcast_transport(engine_urls) -> None:
    with make_sync("delta", engine_urls, transport="broadcast") as sync:
        assert isinstance(sync, DeltaSync) and sync.transport == "broadcast" and sync.root is None


def test_delta_payload_travels_over_the_group_and_bytes_are_reported(engine_urls, trainer: Trainer) -> None:
    with RecordingDeltaSync(engine_urls, transport="broadcast") as sync:
        trainer.step()
        first = sync.sync(trainer.named_tensors(), "bdelta-1")
        assert "first sync" in first.fallback and first.details["backend"] == "gloo"
        assert sync.sent == []  # the first sync is a full broadcast of the tensors
        trainer.step()
        report = sync.sync(trainer.named_tensors(), "bdelta-2")
        assert report.fallback is None and report.details["transport"] == "broadcast"
        assert sync.sent and report.bytes_sent == len(sync.sent[-1])
        assert 0 < report.bytes_sent < report.full_bytes
        assert_engines_equal(engine_urls, trainer, "bdelta-2")


def test_sparse_change_sends_a_small_payload_over_the_group(engine_urls, trainer: Trainer) -> None:
    with DeltaSync(engine_urls, transport="broadcast") as sync:
        sync.sync(trainer.named_tensors(), "bsparse-1")
        with torch.no_grad():
            for _, p in trainer.model.named_parameters():
                p.view(-1)[:: max(1, p.numel() // 3)] += 0.5
        report = sync.sync(trainer.named_tensors(), "bsparse-2")
        assert report.fallback is None and report.bytes_sent < report.full_bytes / 50
        assert_engines_equal(engine_urls, trainer, "bsparse-2")


def test_corrupt_payload_over_the_group_is_rejected_old_weights_stay_then_full_sync(
    engine_urls, trainer: Trainer
) -> None:
    with RecordingDeltaSync(engine_urls, transport="broadcast", corrupt=True) as sync:
        trainer.step()
        sync.sync(trainer.named_tensors(), "bcorrupt-1")
        held = [engine_checksum(u) for u in engine_urls]
        trainer.step()
        report = sync.sync(trainer.named_tensors(), "bcorrupt-2")
        # Right after the corrupt broadcast every engine still held version 1, bit for bit.
        assert [(h["total"], h["weight_version"]) for h in sync.held_after[-1]] == [
            (h["total"], "bcorrupt-1") for h in held
        ]
        assert "checksum" in report.fallback and "old weights kept" in report.fallback
        assert sorted(report.details["rejected_engines"]) == sorted(engine_urls)
        assert report.bytes_sent > len(sync.sent[-1])  # the delta plus the full broadcast
        assert_engines_equal(engine_urls, trainer, "bcorrupt-2")
        # The group still works after a rejection: the next delta goes through.
        sync.corrupt = False
        trainer.step()
        assert sync.sync(trainer.named_tensors(), "bcorrupt-3").fallback is None
        assert_engines_equal(engine_urls, trainer, "bcorrupt-3")


def test_out_of_order_delta_over_the_group_is_refused_and_replaced(engine_urls, trainer: Trainer) -> None:
    with RecordingDeltaSync(engine_urls, transport="broadcast") as sync:
        trainer.step()
        sync.sync(trainer.named_tensors(), "border-1")
        control_post(engine_urls[0] + "/update_weight_version", {"new_version": "elsewhere"})
        trainer.step()
        report = sync.sync(trainer.named_tensors(), "border-2")
        assert report.details["rejected_engines"] == [engine_urls[0]]
        assert "out-of-order" in report.fallback
        # the refusing engine kept its weights; the other one took the delta
        assert sync.held_after[-1][0]["weight_version"] == "elsewhere"
        assert sync.held_after[-1][1]["weight_version"] == "border-2"
        assert report.details["full_sync_engines"] == engine_urls  # a collective reaches every engine
        assert_engines_equal(engine_urls, trainer, "border-2")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"group_name": "g"}, "nbytes"),
        ({"group_name": "g", "nbytes": 0}, "nbytes"),
        ({"group_name": "g", "nbytes": "12"}, "nbytes"),
        ({"group_name": "no-such-group", "nbytes": 16}, "no weights update group"),
    ],
)
def test_bad_distributed_delta_calls_are_refused_before_any_broadcast(engine_urls, body, needle) -> None:
    before = engine_checksum(engine_urls[0])
    r = control_post(engine_urls[0] + "/update_weights_from_delta_distributed", body)
    assert r.status_code == 400 and needle in r.text
    assert engine_checksum(engine_urls[0]) == before


def test_unknown_transport_and_misplaced_directory_are_rejected(engine_urls, tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown weight-sync transport .pigeon."):
        DeltaSync(engine_urls, transport="pigeon")
    with pytest.raises(ValueError, match="disk transport"):
        DeltaSync(engine_urls, transport="broadcast", directory=tmp_path)
