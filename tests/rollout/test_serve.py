"""``agentrl serve``: engines + router from one command; prints the router URL; Ctrl-C stops every child."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from rollout_helpers import REPO

from agentrl.engine.auth import SECRET_ENV, auth_headers
from agentrl.rollout.client import RolloutClient
from agentrl.rollout.router import free_port
from agentrl.rollout.serve import main as serve_main

pytestmark = pytest.mark.timeout(300)


SECRET = "serve-test-secret"


def _workers(url: str) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(url + "/workers", headers=auth_headers(SECRET))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as resp:
        return json.loads(resp.read())["workers"]


def _serve(model_dir, port: int, *extra: str) -> tuple[subprocess.Popen, queue.Queue[str], queue.Queue[str]]:
    """``agentrl serve`` in its own session with a known secret; its stdout and stderr lines."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "serve", "--model", str(model_dir), "--engines", "2",
         "--port", str(port), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, SECRET_ENV: SECRET})
    out: queue.Queue[str] = queue.Queue()
    err: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [out.put(line) for line in proc.stdout], daemon=True).start()
    threading.Thread(target=lambda: [err.put(line) for line in proc.stderr], daemon=True).start()
    return proc, out, err


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/nonexistent/model"], "is not a directory"),
        (["--model", "{tmp}"], "has no config.json"),
        (["--model", "{model}", "--engines", "0"], "--engines must be >= 1"),
        (["--model", "{model}", "--port", "70000"], "--port must be in"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    argv = [a.format(tmp=tmp_path, model=tmp_path / "m") for a in argv]
    assert serve_main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_serve_prints_url_serves_restarts_a_dead_engine_and_ctrl_c_stops_all(tiny_model_dir):
    """One ``serve --restart-dead-engines`` (each start costs two engines): the printed URL serves through
    the router; a SIGKILLed engine is reported removed, restarted and is ready again; Ctrl-C then exits 0
    and nothing listens on the router's or the engines' ports, the restarted engine's included."""
    port = free_port()
    proc, lines, err = _serve(tiny_model_dir, port, "--restart-dead-engines")
    try:
        url = lines.get(timeout=240).strip()
        assert url == f"http://127.0.0.1:{port}"
        workers = _workers(url)
        engine_ports = [int(w["url"].rsplit(":", 1)[1]) for w in workers]
        assert len(engine_ports) == 2 and all(w["status"] == "ready" for w in workers)

        async def two_sessions():
            async with RolloutClient(url) as client:
                return await asyncio.gather(*(
                    client.generate([1, 5, 6], {"max_new_tokens": 2, "ignore_eos": True}, session_id=f"serve-{i}") for i in range(4)))

        results = asyncio.run(two_sessions())
        assert all(len(r.turn.output_ids) == 2 and r.turn.weight_version is not None for r in results)

        _kill_an_engine_and_see_it_restarted(proc, url, err)

        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers
        assert proc.wait(timeout=60) == 0
        _assert_nothing_listens([port, *engine_ports])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kill_an_engine_and_see_it_restarted(proc: subprocess.Popen, url: str, err: queue.Queue[str]) -> None:
    victim = _workers(url)[0]["url"]
    port_arg = victim.rsplit(":", 1)[1]
    (engine,) = [c for c in psutil.Process(proc.pid).children(recursive=True)
                 if "agentrl.engine" in c.cmdline() and port_arg in c.cmdline()]
    engine.kill()
    seen: list[str] = []
    deadline = time.monotonic() + 200
    while not any(f"{victim}: restarted" in line for line in seen) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            seen.append(err.get(timeout=1))
    assert any(f"{victim}: removed" in line for line in seen), seen
    assert any(f"{victim}: restarted" in line for line in seen), seen
    assert victim in {w["url"] for w in _workers(url) if w["status"] == "ready" and w["is_healthy"]}


def _assert_nothing_listens(ports: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(_listening(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_listening(p) for p in ports)


@pytest.mark.slow
def test_engine_that_cannot_load_the_model_fails_serve_cleanly(tmp_path, capsys):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no-such-architecture"}')
    port = free_port()
    assert serve_main(["--model", str(model), "--engines", "1", "--port", str(port),
                       "--startup-timeout", "200"]) == 1
    err = capsys.readouterr().err
    assert "EngineStartError" in err and "exited" in err
    assert not _listening(port)  # the router was never started


@pytest.mark.slow
def test_kill_9_of_serve_leaves_nothing_serving(tiny_model_dir):
    port = free_port()
    proc, lines, err = _serve(tiny_model_dir, port)
    try:
        url = lines.get(timeout=240).strip()
        engine_ports = [int(w["url"].rsplit(":", 1)[1]) for w in _workers(url)]
        assert len(engine_ports) == 2
        proc.kill()  # SIGKILL: no handler, no finally clause runs
        proc.wait(timeout=10)
        _assert_nothing_listens([port, *engine_ports])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
