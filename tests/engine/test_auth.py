"""Weight-update and control routes need the run's secret; generation and information routes stay open.

A pickle from a plain local HTTP client once ran a shell command in the engine: now it is refused before
anything is read, in-process and in a real engine process.
"""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path

import httpx
import pytest

from agentrl.engine.auth import SECRET_ENV, auth_headers

# Routes a client may call without the secret; every other route must refuse it. /token_logprobs scores
# given ids with the weights being served: a read-only forward like /generate, so it is open as /generate is.
OPEN = {"/generate", "/token_logprobs", "/health", "/health_generate", "/model_info", "/get_model_info", "/server_info",
        "/get_server_info", "/get_load", "/metrics", "/get_weight_version", "/weights_checksum"}


class Shell:
    """Unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def pickle_body(marker: Path) -> dict:
    payload = base64.b64encode(pickle.dumps([("model.embed_tokens.weight", Shell(marker))])).decode()
    return {"serialized_named_tensors": [payload], "load_format": None, "weight_version": "pwned"}


def control_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every declared route outside :data:`OPEN`, from the app's OpenAPI schema."""
    paths = app.openapi()["paths"]
    return [(sorted(ops)[-1].upper(), path) for path, ops in paths.items() if path not in OPEN]


def test_every_route_but_the_open_ones_needs_the_secret(server, anonymous, client):
    routes = control_routes(server.server.config.app)
    assert len(routes) >= 14 and ("POST", "/update_weights_from_tensor") in routes
    version = client.get("/get_weight_version").json()["weight_version"]
    for method, path in routes:
        for headers in ({}, auth_headers("not-the-secret"), {"Authorization": f"Basic {server.secret}"}):
            r = anonymous.request(method, path, json={}, headers=headers)
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert "secret" in r.json()["error"]["message"] and r.headers["www-authenticate"] == "Bearer"
    assert not server.engine.scheduler.paused and server.engine.weight_version == version
    # the secret opens them (a body error is past the guard)
    assert client.post("/pause_generation", json={"mode": "sideways"}).status_code == 400


def test_open_routes_need_no_secret(anonymous):
    r = anonymous.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    for path in ("/health", "/model_info", "/server_info", "/get_weight_version"):
        assert anonymous.get(path).status_code == 200, path


def test_pickle_without_the_secret_is_never_unpickled(anonymous, tmp_path):
    marker = tmp_path / "pwned"
    r = anonymous.post("/update_weights_from_tensor", json=pickle_body(marker))
    assert r.status_code == 401
    assert not marker.exists()


def test_an_engine_without_a_secret_disables_control_routes(server):
    from fastapi.testclient import TestClient

    from agentrl.engine.server import create_app

    app = create_app(server.engine)  # no secret: its guard refuses even the run's secret
    r = TestClient(app).post("/flush_cache", headers=auth_headers(server.secret))  # no lifespan: engine untouched
    assert r.status_code == 401 and "without a secret" in r.json()["error"]["message"]


@pytest.mark.timeout(240)
def test_engine_process_gets_the_secret_in_its_environment_not_its_command_line(tiny_model, tmp_path):
    from agentrl.engine.launch import EngineProcess

    marker = tmp_path / "pwned"
    with EngineProcess(tiny_model, secret="s3cret-for-this-test", threads=1) as eng:
        cmdline = Path(f"/proc/{eng.pid}/cmdline").read_bytes()
        assert b"s3cret-for-this-test" not in cmdline  # every local user can read a command line
        r = httpx.post(eng.url + "/update_weights_from_tensor", json=pickle_body(marker), timeout=30)
        assert r.status_code == 401 and not marker.exists()
        r = httpx.post(eng.url + "/flush_cache", headers=auth_headers(eng.secret), timeout=30)
        assert r.status_code == 200
        assert httpx.get(eng.url + "/server_info", timeout=30).json()["cpu_threads"] == 1
    assert os.environ.get(SECRET_ENV) != "s3cret-for-this-test"  # ours is untouched


def test_non_loopback_bind_warns():
    from agentrl.engine.launch import non_loopback_warning

    assert non_loopback_warning("127.0.0.1") is None and non_loopback_warning("::1") is None
    assert non_loopback_warning("localhost") is None
    assert "other machines" in non_loopback_warning("0.0.0.0")
