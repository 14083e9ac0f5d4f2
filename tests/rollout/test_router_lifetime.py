"""The smg router dies with the process that started it, even by SIGKILL, and logs to ``log_dir``; a SIGTERM
to a process holding a RolloutManager leaves no engine or router behind. Real processes throughout."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_process_lifetime import gone, kill_leftovers, run_parent, wait_gone  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_router_dies_when_its_parent_is_sigkilled_and_logs_to_log_dir(tmp_path):
    logs = tmp_path / "logs"
    parent, info = run_parent(f"""
        import json, time
        from agentrl.rollout.router import SmgRouter
        router = SmgRouter([], log_dir={str(logs)!r}).start()
        print(json.dumps({{"pid": router.pid, "port": router.port, "log": str(router.log_path)}}), flush=True)
        time.sleep(600)
    """)
    try:
        assert not gone(info["pid"])
        assert Path(info["log"]) == logs / f"router-{info['port']}.log" and Path(info["log"]).exists()
        parent.kill()  # SIGKILL: no finally, no atexit, no stop()
        parent.wait(10)
        assert wait_gone([info["pid"]]) == [], "the router outlived its SIGKILLed parent"
        assert Path(info["log"]).exists()  # a log in log_dir is the run's: kept
    finally:
        parent.kill()
        kill_leftovers([info["pid"]])


def test_router_stop_keeps_a_log_dir_log_and_deletes_a_temp_one(tmp_path):
    from agentrl.rollout.router import SmgRouter

    kept = SmgRouter([], log_dir=tmp_path)
    with kept:
        path = kept.log_path
    assert path == tmp_path / f"router-{kept.port}.log" and path.exists()
    temp = SmgRouter([])
    with temp:
        path = temp.log_path
        assert path.exists() and path.parent != tmp_path
    assert not path.exists()


def test_sigterm_to_a_process_holding_a_rollout_manager_leaves_no_server(tiny_model_dir, tmp_path):
    logs = tmp_path / "logs"
    parent, _ = run_parent(f"""
        import time
        from agentrl.engine.process import exit_on_sigterm
        from agentrl.envs.arithmetic import ArithmeticToolEnv
        from agentrl.rollout.manager import RolloutManager, RolloutSettings
        exit_on_sigterm()
        with RolloutManager({str(tiny_model_dir)!r}, ArithmeticToolEnv, RolloutSettings(num_engines=1),
                            log_dir={str(logs)!r}):
            print("{{}}", flush=True)
            time.sleep(600)
    """)
    servers = psutil.Process(parent.pid).children(recursive=True)
    pids = [p.pid for p in servers]
    try:
        assert len(servers) >= 2, [p.cmdline() for p in servers]  # the engine and the router, at least
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 128 + signal.SIGTERM  # the handler's SystemExit, not the default death
        assert wait_gone(pids) == [], [p.cmdline() for p in servers if not gone(p.pid)]
        names = sorted(p.name for p in logs.iterdir())
        assert len(names) == 2 and names[0].startswith("engine-") and names[1].startswith("router-"), names
    finally:
        parent.kill()
        kill_leftovers(pids)
