"""Server processes die with the process that started them, even by SIGKILL; a stop reaches their children;
logs land in ``log_dir``. Real processes throughout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from agentrl.engine.process import start_tied_process, stop_process_group

REPO = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """No such process, or only a zombie left for whatever reaps orphans here."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """The pids still running after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if not gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def kill_leftovers(pids: list[int]) -> None:
    """Clean-up after a failed assertion: SIGKILL whatever of ``pids`` still runs."""
    for pid in pids:
        if not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run_parent(script: str, timeout: float = 180.0) -> tuple[subprocess.Popen, dict]:
    """Run ``script`` in a child Python; return it and the JSON line it prints once its servers are up."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + timeout
    line = ""
    while not line and time.monotonic() < deadline and parent.poll() is None:
        line = parent.stdout.readline()
    if not line:
        parent.kill()
        raise AssertionError(f"parent printed nothing (exit code {parent.poll()})")
    return parent, json.loads(line)


def test_a_stop_reaches_the_servers_children(tmp_path):
    log = tmp_path / "leader.log"
    leader = start_tied_process(
        [sys.executable, "-c", "import subprocess, time; c = subprocess.Popen(['sleep', '300']); print(c.pid, flush=True); time.sleep(300)"],
        log_path=log)
    deadline = time.monotonic() + 30
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(log.read_text())
    assert os.getpgid(child) == leader.pid  # the server's child is in the server's group
    stop_process_group(leader, ((signal.SIGTERM, 5.0),))
    assert leader.returncode == -signal.SIGTERM
    assert wait_gone([child]) == []


def test_engine_dies_when_its_parent_is_sigkilled_and_logs_to_log_dir(tiny_model, tmp_path):
    logs = tmp_path / "logs"
    parent, info = run_parent(f"""
        import json, time
        from agentrl.engine.launch import EngineProcess
        eng = EngineProcess({str(tiny_model)!r}, extra_args=["--log-level", "info"], log_dir={str(logs)!r})
        eng.start().wait_healthy(timeout=180)
        print(json.dumps({{"pid": eng.pid, "port": eng.port, "log": str(eng.log_path)}}), flush=True)
        time.sleep(600)
    """)
    try:
        assert not gone(info["pid"])
        assert Path(info["log"]) == logs / f"engine-{info['port']}.log"
        assert "Uvicorn running" in Path(info["log"]).read_text()
        parent.kill()  # SIGKILL: no finally, no atexit, no stop()
        parent.wait(10)
        assert wait_gone([info["pid"]]) == [], "the engine outlived its SIGKILLed parent"
    finally:
        parent.kill()
        kill_leftovers([info["pid"]])


def test_engine_without_log_dir_logs_to_a_temp_file(tmp_path):
    from agentrl.engine.launch import EngineProcess

    eng = EngineProcess(tmp_path / "no_such_model")
    try:
        assert eng.log_path.name.startswith(f"agentrl-engine-{eng.port}-") and eng.log_path.exists()
    finally:
        eng.log_path.unlink()
