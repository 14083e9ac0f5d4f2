"""The real smg router (as :class:`~agentrl.rollout.router.SmgRouter` runs it) accepts the embedded engine
as a worker, routes /generate to it unchanged and fans control calls out with the run's secret."""

from __future__ import annotations

import shutil

import httpx
import pytest

from agentrl.engine.auth import auth_headers
from agentrl.rollout.router import SmgRouter

pytestmark = pytest.mark.skipif(shutil.which("smg") is None, reason="smg binary not installed")


@pytest.fixture(scope="module")
def router(server):
    with SmgRouter([server.url], secret=server.secret) as r:
        yield r.url


def test_worker_is_registered_with_its_local_model_path(router, server, tiny_model):
    (worker,) = httpx.get(router + "/workers", headers=auth_headers(server.secret)).json()["workers"]
    assert worker["url"] == server.url
    assert worker["labels"]["model_path"] == str(tiny_model)
    assert worker["labels"]["weight_version"] == server.engine.weight_version


def test_generate_through_smg_equals_direct(router, server):
    body = {"input_ids": [1, 11, 12, 13], "return_logprob": True, "rid": "via-smg",
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [2], "top_k": -1}}
    via = httpx.post(router + "/generate", json=body, headers={"X-SMG-Routing-Key": "session-1"}, timeout=60)
    assert via.status_code == 200, via.text
    direct = httpx.post(server.url + "/generate", json={**body, "rid": "direct"}, timeout=60).json()
    out = via.json()
    assert out["output_ids"] == direct["output_ids"]
    assert out["meta_info"]["id"] == "via-smg"
    pairs = zip(out["meta_info"]["output_token_logprobs"], direct["meta_info"]["output_token_logprobs"], strict=True)
    # the direct call reuses the routed call's KV (prefix cache): equal up to float rounding
    assert all(abs(a[0] - b[0]) < 1e-5 and a[1:] == b[1:] for a, b in pairs)
    assert out["meta_info"]["cached_tokens"] >= 0 and out["meta_info"]["weight_version"] == server.engine.weight_version


def test_stream_through_smg(router):
    body = {"input_ids": [1, 11, 12], "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    r = httpx.post(router + "/generate", json=body, headers={"X-SMG-Routing-Key": "s2"}, timeout=60)
    assert r.status_code == 200
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4


def test_rl_fanout_reaches_the_engine(router, server):
    """smg --enable-rl: /v1/rl/engine/<path>?selector=<label selector> fans out to matching workers."""
    fan = {"selector": "worker_type=regular"}  # every regular worker
    auth = auth_headers(server.secret)
    r = httpx.post(router + "/v1/rl/engine/pause_generation", params=fan, json={"mode": "in_place"}, timeout=30,
                   headers=auth)
    assert r.status_code == 200 and r.json()["succeeded"] == 1, r.text
    assert server.engine.scheduler.paused
    r = httpx.post(router + "/v1/rl/engine/update_weight_version", params=fan,
                   json={"new_version": "via-router", "abort_all_requests": False}, timeout=30, headers=auth)
    assert r.status_code == 200 and r.json()["succeeded"] == 1, r.text
    r = httpx.post(router + "/v1/rl/engine/continue_generation", params=fan, json={}, timeout=30, headers=auth)
    assert r.status_code == 200 and not server.engine.scheduler.paused
    out = httpx.post(router + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                     headers={"X-SMG-Routing-Key": "s3"}, timeout=60).json()
    assert out["meta_info"]["weight_version"] == "via-router"


def test_router_control_plane_needs_the_secret(router, server):
    """Without the secret a local client can neither list or add workers nor fan out (pause, pickle...)."""
    fan = {"selector": "worker_type=regular"}
    for method, path, body in [("GET", "/workers", None), ("POST", "/workers", {"url": "http://127.0.0.1:9"}),
                               ("POST", "/v1/rl/engine/pause_generation", {})]:
        for headers in ({}, auth_headers("wrong")):
            r = httpx.request(method, router + path, params=fan, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, r.text)
    assert not server.engine.scheduler.paused
    # /generate stays open: clients and the gateway need no secret
    r = httpx.post(router + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                   timeout=60)
    assert r.status_code == 200, r.text
