"""Payload x transport: the config spellings, a user transport loaded by path, and option errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from weights_sync_helpers import Trainer, assert_engines_equal, corrupt

from agentrl.engine.weight_loading import update_weights_from_tensor_body
from agentrl.weights.delta_sync import DeltaSync
from agentrl.weights.engines import CallResult, raise_errors
from agentrl.weights.sync import FullSync, make_sync
from agentrl.weights.transport import Sent, Transport
from agentrl.weights.transports.broadcast import BroadcastTransport
from agentrl.weights.transports.disk import DiskTransport

DEAD = ["http://127.0.0.1:9"]  # construction only: nothing is sent


class BodyTransport(Transport):
    """A transport written from scratch: all tensors in one safetensors HTTP body (full weights only)."""

    name = "body"

    def send_full(self, tensors: list, weight_version: str, urls: Sequence[str]) -> Sent:
        body = update_weights_from_tensor_body(tensors, weight_version=weight_version, fmt="safetensors")
        raise_errors(self.engines.call_all("/update_weights_from_tensor", body, urls=urls))
        return Sent(len(body["serialized_named_tensors"][0]), list(urls), {"calls": 1})


class CorruptingDisk(DiskTransport):
    """The disk transport with a flipped byte in every delta it carries."""

    def send_delta(self, payload: bytes, body: dict[str, Any]) -> list[CallResult]:
        return super().send_delta(corrupt(payload), body)


@pytest.mark.parametrize(
    ("mode", "options", "cls", "transport"),
    [
        ("full", {"transport": "broadcast", "bucket_bytes": 1 << 20}, FullSync, "broadcast"),
        ("full", {"transport": "tensor", "handles": "safetensors"}, FullSync, "tensor"),
        ("full", {}, FullSync, "disk"),
        ("delta", {"transport": "disk"}, DeltaSync, "disk"),
        ("full", {"transport": f"{__name__}:BodyTransport"}, FullSync, "body"),
    ],
)
def test_every_payload_over_every_transport_that_carries_it_is_bitwise(
    mode, options, cls, transport, engine_urls, trainer: Trainer
) -> None:
    with make_sync(mode, engine_urls, **options) as sync:
        assert type(sync) is cls and sync.transport == transport
        for k in (1, 2, 3):
            trainer.step()
            report = sync.sync(trainer.named_tensors(), f"{mode}-{transport}-{k}")
            assert_engines_equal(engine_urls, trainer, f"{mode}-{transport}-{k}")
        assert report.details["payload"] == mode and report.details["transport"] == transport
        assert report.mode == (transport if mode == "full" else mode)
        assert report.bytes_sent > 0 and report.full_bytes > 0
        if mode == "delta":
            assert report.fallback is None and report.bytes_sent < report.full_bytes


def test_a_user_delta_transport_by_path_gets_refusals_replaced_by_full_weights(engine_urls, trainer: Trainer) -> None:
    with make_sync("delta", engine_urls, transport=f"{__name__}.CorruptingDisk") as sync:
        assert isinstance(sync.via, CorruptingDisk)
        trainer.step()
        sync.sync(trainer.named_tensors(), "udelta-1")
        trainer.step()
        report = sync.sync(trainer.named_tensors(), "udelta-2")
        assert "checksum" in report.fallback
        assert sorted(report.details["full_sync_engines"]) == sorted(engine_urls)
        assert_engines_equal(engine_urls, trainer, "udelta-2")


def test_old_mode_names_are_full_weight_presets() -> None:
    for mode, transport in [("disk", DiskTransport), ("broadcast", BroadcastTransport)]:
        with make_sync(mode, DEAD) as sync:
            assert isinstance(sync, FullSync) and type(sync.via) is transport and sync.mode == mode
    with make_sync("tensor", DEAD, transport="cuda_ipc", device="cpu") as sync:
        assert sync.transport == "tensor" and sync.via.handles == "cuda_ipc"
    with make_sync(DeltaSync, DEAD, transport=BroadcastTransport) as sync:
        assert sync.mode == "delta" and sync.transport == "broadcast"


def test_a_transport_that_cannot_carry_the_payload_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot carry delta payloads; choose from \['broadcast', 'disk'\]"):
        make_sync("delta", DEAD, transport="tensor")
    with pytest.raises(ValueError, match="cannot carry delta"):
        make_sync("delta", DEAD, transport=f"{__name__}:BodyTransport")


def test_an_option_of_another_transport_names_its_owner() -> None:
    with pytest.raises(ValueError, match="'directory' is an option of the disk transport"):
        make_sync("full", DEAD, transport="tensor", directory="/tmp/x")
    with pytest.raises(ValueError, match="'handles' is an option of the tensor transport"):
        make_sync("delta", DEAD, transport="broadcast", handles="shm")


def test_bad_plug_in_paths_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown weight-sync mode"):
        make_sync("carrier-pigeon", DEAD)
    with pytest.raises(ImportError, match="no attribute"):
        make_sync("full", DEAD, transport=f"{__name__}:NoSuchTransport")
    with pytest.raises(TypeError, match="not a Transport subclass"):
        make_sync("full", DEAD, transport=f"{__name__}:corrupt")
    with pytest.raises(TypeError, match="not a WeightSync subclass"):
        make_sync(f"{__name__}:BodyTransport", DEAD)
