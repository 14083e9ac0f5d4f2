"""EngineProcess and ``python -m agentrl.engine``: a real subprocess in its own process group."""

from __future__ import annotations

import os

import httpx
import pytest

from agentrl.engine.launch import EngineProcess, EngineStartError, free_port


def test_engine_process_lifecycle(tiny_model, tmp_path):
    log = tmp_path / "engine.log"
    eng = EngineProcess(tiny_model, extra_args=["--weight-version", "w0", "--max-batch-size", "3", "--log-level", "info"], log_path=log)
    assert eng.url == f"http://127.0.0.1:{eng.port}" and not eng.alive
    eng.start().wait_healthy(timeout=180)  # generous: CI machines may be busy
    try:
        assert eng.alive
        assert os.getpgid(eng.pid) == eng.pid  # its own process group
        info = httpx.get(eng.url + "/server_info").json()
        assert info["weight_version"] == "w0" and info["max_running_requests"] == 3
        assert info["model_path"] == os.path.abspath(tiny_model)
        out = httpx.post(eng.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}).json()
        assert out["meta_info"]["completion_tokens"] == 3 and out["meta_info"]["weight_version"] == "w0"
        assert "Uvicorn running" in log.read_text()
        eng.kill()  # a crash, as failure tests simulate it
        assert not eng.alive and eng.proc.returncode == -9
        with pytest.raises(httpx.ConnectError):
            httpx.get(eng.url + "/health", timeout=1)
    finally:
        eng.stop()  # idempotent after kill


def test_context_manager_reports_a_crashed_start(tmp_path):
    eng = EngineProcess(tmp_path / "no_such_model", port=free_port())
    with pytest.raises(EngineStartError, match="exited with code 2") as err, eng:
        pass
    assert "no_such_model" in str(err.value) and "config.json" in str(err.value)  # the log tail says why
    assert not eng.alive
