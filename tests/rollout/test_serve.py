"""``agentrl serve``: engines + router from one command; prints the router URL; Ctrl-C stops every child."""

from __future__ import annotations

import asyncio
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from rollout_helpers import REPO, http_json

from agentrl.rollout.client import RolloutClient
from agentrl.rollout.router import free_port
from agentrl.rollout.serve import main as serve_main

pytestmark = pytest.mark.timeout(300)


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
def test_serve_prints_url_serves_through_router_and_ctrl_c_stops_all(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "serve", "--model", str(tiny_model_dir), "--engines", "2",
         "--port", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        url = lines.get(timeout=240).strip()
        assert url == f"http://127.0.0.1:{port}"
        workers = http_json(url + "/workers")["workers"]
        engine_ports = [int(w["url"].rsplit(":", 1)[1]) for w in workers]
        assert len(engine_ports) == 2 and all(w["status"] == "ready" for w in workers)

        async def two_sessions():
            async with RolloutClient(url) as client:
                return await asyncio.gather(*(
                    client.generate([1, 5, 6], {"max_new_tokens": 2, "ignore_eos": True}, session_id=f"serve-{i}") for i in range(4)))

        results = asyncio.run(two_sessions())
        assert all(len(r.turn.output_ids) == 2 and r.turn.weight_version is not None for r in results)

        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(_listening(p) for p in [port, *engine_ports]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_listening(p) for p in [port, *engine_ports])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
