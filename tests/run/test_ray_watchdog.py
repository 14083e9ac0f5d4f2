"""A SIGKILLed ``agentrl train`` on a local Ray cluster leaves no process of that cluster (gcs_server,
raylet, dashboard agent, runtime-env agent, workers, engines): its watchdog stops them. A process that only
names the session dir (a ``tail -f`` of its log) is not Ray's, and stays."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 20.0  # the watchdog's SIGTERM grace is 3 s; the rest is for a loaded 2-core machine

USER_MODULE = '''
from agentrl.envs import Environment, tool


class Echo(Environment):
    max_turns = 1

    def reset(self, task):
        return [{"role": "user", "content": "Say red."}]

    @tool
    def say(self, word: str) -> str:
        """Say a word.

        Args:
            word: the word.
        """
        self.done = True
        return word

    def reward(self):
        return 1.0


def tasks(n, *, seed, split):
    return [{"word": "red"} for _ in range(n)]
'''


def _names(proc: psutil.Process, session_dir: str) -> bool:
    """What a user's ps scan finds: the session dir in the command line or among the open files."""
    try:
        return any(session_dir in a for a in proc.cmdline()) or \
            any(f.path.startswith(session_dir) for f in proc.open_files())
    except psutil.Error:
        return False


def _alive(pids: set[int]) -> list[str]:
    left = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid}: {' '.join(p.cmdline())[:120]}")
    return left


def _start_train(tmp_path: Path) -> subprocess.Popen:
    (tmp_path / "user_echo_kill.py").write_text(USER_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "--env", "user_echo_kill:Echo", "--tasks", "user_echo_kill:tasks",
           "--output-dir", str(tmp_path / "run"), "--cache_dir", str(tmp_path / "cache"), "--steps", "50",
           "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2",
           "--rollout.max_new_tokens", "8", "--eval.num_tasks", "2", "--eval.every", "100"]
    with open(tmp_path / "train.log", "w") as log:  # a file, not a pipe: nothing blocks the run on a full pipe
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def test_a_sigkilled_train_leaves_no_process_of_its_ray_session(tmp_path: Path) -> None:
    proc = _start_train(tmp_path)
    bystander = None
    try:
        deadline = time.monotonic() + 400
        while not (tmp_path / "run" / "checkpoints" / "latest").exists():  # step 0 saved: GRPO under way
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run never reached GRPO:\n{(tmp_path / 'train.log').read_text()[-4000:]}")
            time.sleep(0.3)
        sessions = list(Path("/tmp/ray").glob(f"session_*_{proc.pid}"))  # Ray names the dir after the driver's pid
        assert len(sessions) == 1, sessions
        session_dir = str(sessions[0].resolve())
        seen = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        seen |= {p.pid for p in psutil.process_iter() if _names(p, session_dir)} - {proc.pid}
        assert len(seen) >= 5, seen  # gcs, raylet, agents, workers: the scan sees the cluster
        bystander = subprocess.Popen(["tail", "-f", f"{session_dir}/logs/raylet.out"], stdout=subprocess.DEVNULL)
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        left = _alive(seen)
        while left and time.monotonic() < killed + GONE_WITHIN_S:
            time.sleep(0.5)
            left = _alive(seen | {p.pid for p in psutil.process_iter() if _names(p, session_dir)} - {bystander.pid})
        assert left == [], f"left running {GONE_WITHIN_S:.0f} s after SIGKILL: {left}"
        print(f"no process of {session_dir} left {time.monotonic() - killed:.1f} s after SIGKILL")
        assert bystander.poll() is None, "the watchdog killed a process that only reads the session's log"
        time.sleep(1.0)  # the watchdog prints after its last check
        assert "of its Ray session" in (tmp_path / "train.log").read_text()  # the watchdog's line, on the run's stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        if bystander is not None:
            bystander.kill()
