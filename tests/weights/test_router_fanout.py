"""Senders through smg's RL fan-out (real ``smg launch --enable-rl`` in front of real engine processes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from weights_sync_helpers import CorruptingDeltaSync, Trainer, assert_engines_equal

from agentrl.rollout.router import SmgRouter
from agentrl.weights.sync import WeightSyncError, make_sync


def record_fanouts(sync, monkeypatch) -> list[str]:
    """The paths the sender sends through the router (so a test can tell the router was used)."""
    paths: list[str] = []
    original = sync.engines.fanout

    def fanout(path, body):
        paths.append(path)
        return original(path, body)

    monkeypatch.setattr(sync.engines, "fanout", fanout)
    return paths


@pytest.fixture(scope="module")
def router(engine_urls) -> Iterator[SmgRouter]:
    with SmgRouter(engine_urls, enable_rl=True) as r:
        yield r


@pytest.mark.parametrize(
    ("mode", "options", "fanned"),
    [
        ("disk", {}, "/update_weights_from_disk"),
        ("delta", {}, "/update_weights_from_delta"),
        # the router must call every engine at once: each joins the broadcast before answering
        ("delta", {"transport": "broadcast"}, "/update_weights_from_delta_distributed"),
    ],
)
def test_syncs_through_the_router_fan_out_are_bitwise(
    mode, options, fanned, router, engine_urls, trainer: Trainer, monkeypatch
) -> None:
    tag = f"fan-{mode}-{options.get('transport', 'disk')}"
    with make_sync(mode, engine_urls, router_url=router.url, **options) as sync:
        fanouts = record_fanouts(sync, monkeypatch)
        for k in (1, 2):
            trainer.step()
            report = sync.sync(trainer.named_tensors(), f"{tag}-{k}")
            assert_engines_equal(engine_urls, trainer, f"{tag}-{k}")
        assert report.fallback is None
        assert fanned in fanouts


def test_engine_refusals_come_back_per_engine_through_the_router(router, engine_urls, trainer: Trainer) -> None:
    with CorruptingDeltaSync(engine_urls, router_url=router.url) as sync:
        trainer.step()
        sync.sync(trainer.named_tensors(), "fan-corrupt-1")
        trainer.step()
        report = sync.sync(trainer.named_tensors(), "fan-corrupt-2")
        # each engine's 400 is read from the router's answer: a refusal, so a full sync, not a failure
        assert "checksum" in report.fallback
        assert sorted(report.details["rejected_engines"]) == sorted(engine_urls)
        assert_engines_equal(engine_urls, trainer, "fan-corrupt-2")


def test_an_engine_the_router_does_not_know_fails_the_sync(engine_urls, trainer: Trainer) -> None:
    with (
        SmgRouter(engine_urls[:1], enable_rl=True) as lonely,
        make_sync("disk", engine_urls, router_url=lonely.url) as sync,
        pytest.raises(WeightSyncError, match="has no such worker"),
    ):
        sync.sync(trainer.named_tensors(), "fan-missing-1")
