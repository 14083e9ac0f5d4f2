"""The tensor transport's layout: whole flat buckets for agentrl's engines, SGLang's per-tensor list for
others, and the time split in the report (the bits themselves: test_sync_e2e.py, tests/engine/test_weights.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentrl.engine.weight_loading import deserialize_named_tensors  # noqa: E402
from agentrl.weights.engines import CallResult  # noqa: E402
from agentrl.weights.transports.tensor import TensorTransport  # noqa: E402


class FakeEngines:
    """Answers ``/server_info`` as ``engine`` and records every other call; engines report timings."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.calls: list[tuple[str, dict | None, list[str]]] = []

    def call_all(self, path, body=None, *, urls=None):
        self.calls.append((path, body, list(urls)))
        if path == "/server_info":
            return [CallResult(u, value={"engine": self.engine, "weight_version": "x"}) for u in urls]
        return [CallResult(u, value={"success": True, "timings": {"copy_s": 0.25 * (i + 1)}}) for i, u in enumerate(urls)]


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"w{i}", torch.randn(64, 8, generator=g)) for i in range(6)] + [("ids", torch.arange(5))]


@pytest.mark.parametrize(("engine", "flat", "layout"), [
    ("agentrl-embedded", None, "flat_buckets"),
    ("sglang", None, "per_tensor"),
    ("agentrl-embedded", False, "per_tensor"),
])
def test_layout_follows_what_the_engines_take(engine, flat, layout):
    fake = FakeEngines(engine)
    transport = TensorTransport(fake, handles="shm", bucket_bytes=1024, flat=flat)
    sent = transport.send_full(tensors(), "v1", ["http://a", "http://b"])
    updates = [body for path, body, _ in fake.calls if path == "/update_weights_from_tensor"]
    assert sent.details["layout"] == layout and len(updates) == sent.details["buckets"] > 2  # shm: a request per bucket
    assert {b["load_format"] for b in updates} == {"flat_buckets" if layout == "flat_buckets" else None}
    assert [b["weight_version"] for b in updates] == [None] * (len(updates) - 1) + ["v1"]  # set with the last only
    received = {}
    for body in updates:
        received.update(deserialize_named_tensors(body["serialized_named_tensors"][0], body["load_format"]))
    assert set(received) == {n for n, _ in tensors()}
    assert all(torch.equal(received[n], t) and received[n].dtype == t.dtype for n, t in tensors())
    timings = sent.details["timings"]
    assert {"stage_s", "export_s", "request_s"} <= set(timings)
    assert timings["copy_s"] == pytest.approx(0.5 * len(updates))  # the slowest engine's, summed over requests
    transport.send_full(tensors(), "v2", ["http://a", "http://b"])
    asked = [u for path, _, urls in fake.calls if path == "/server_info" for u in urls]
    assert asked == (["http://a", "http://b"] if flat is None else [])  # asked once per engine, not per sync


def test_one_engine_that_is_not_ours_makes_the_whole_sync_per_tensor():
    fake = FakeEngines("agentrl-embedded")
    transport = TensorTransport(fake, handles="shm")
    transport._takes_flat["http://sglang"] = False
    sent = transport.send_full(tensors(), "v1", ["http://a", "http://sglang"])
    assert sent.details["layout"] == "per_tensor"


def test_safetensors_handles_never_use_flat_buckets():
    fake = FakeEngines("agentrl-embedded")
    sent = TensorTransport(fake, handles="safetensors").send_full(tensors(), "v1", ["http://a"])
    assert sent.details["layout"] == "per_tensor"
    assert not any(path == "/server_info" for path, _, _ in fake.calls)


class VersionEngines(FakeEngines):
    """An engine that answers updates with the version it then holds (``says``: what it claims)."""

    def __init__(self, engine: str, says) -> None:
        super().__init__(engine)
        self.says = says
        self.urls = ["http://a"]

    def weight_versions(self, urls=None):
        return {r.url: r.value["weight_version"] for r in self.call_all("/server_info", urls=urls)}

    def call_all(self, path, body=None, *, urls=None):
        results = super().call_all(path, body, urls=urls)
        if path == "/update_weights_from_tensor" and self.says is not None:
            for r in results:
                r.value["weight_version"] = self.says(body)
        return results


@pytest.mark.parametrize(("says", "asks_again", "ok"), [
    (lambda body: body["weight_version"] or "old", False, True),  # our engine: its answer is the check
    (None, True, False),  # an engine that does not say (SGLang): asked through /server_info ("x" there)
    (lambda body: "someone-else", False, False),  # another update got in after ours: refused
])
def test_the_update_answers_version_replaces_the_second_round_trip(says, asks_again, ok):
    from agentrl.weights.sync import WeightSyncError
    from agentrl.weights.transports.tensor import TensorSync

    sync = TensorSync(["http://a"], transport="shm")
    fake, real = VersionEngines("agentrl-embedded", says), sync.engines
    sync.engines, sync.via.engines = fake, fake
    try:
        if ok:
            assert sync.sync(tensors(), "v1").weight_version == "v1"
        else:
            with pytest.raises(WeightSyncError, match="other weight versions"):
                sync.sync(tensors(), "v1")
    finally:
        sync.via.close()
        real.close()
    infos = [path for path, _, _ in fake.calls if path == "/server_info"]
    assert len(infos) == 1 + asks_again  # the layout question once; the version question only if unanswered


def test_persistent_staging_reuses_its_buckets_for_the_same_tensors():
    """A repeat sync of the same names/shapes copies into the same buckets (no re-planning); new bits
    arrive, and a changed layout builds new buckets."""
    fake = FakeEngines("agentrl-embedded")
    transport = TensorTransport(fake, handles="shm", flat=True, bucket_bytes=1024)
    transport.staging.persistent = True  # as for cuda_ipc, on CPU memory (this test has no GPU)
    first = tensors()
    buckets = transport._stage(first, None, one_per_dtype=True)
    assert len(buckets) == 2  # float32 and int64, whatever bucket_bytes says
    second = [(n, t + 1) for n, t in first]
    again = transport._stage(second, None, one_per_dtype=True)
    assert [b.flat.data_ptr() for b in again] == [b.flat.data_ptr() for b in buckets]
    received = dict(pair for b in again for pair in b.named_tensors())
    assert all(torch.equal(received[n], t) for n, t in second)
    grown = [*second, ("extra", torch.ones(3))]
    rebuilt = transport._stage(grown, None, one_per_dtype=True)
    assert {e.name for b in rebuilt for e in b.entries} == {n for n, _ in grown}
