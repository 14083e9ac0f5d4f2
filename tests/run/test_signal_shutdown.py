"""``agentrl train`` stopped by SIGINT or SIGTERM in the middle of GRPO: it exits promptly with 128 + the
signal, saying so; the environment's ``close_resources()`` ran in the rollout actor (its labelled Docker
container is gone); no engine, router, Ray worker or other child process of the run is left, nor a
shared-memory weight copy; its logs are under the output dir; metric rows and the checkpoint are whole.

The run is started as ``cmd &`` in a script would start it: with SIGINT ignored (what the lead saw keep
training after ``kill -INT``). Its environment holds a one-container sandbox pool with a label unique to the
test, and every episode's reward runs a command in it, so a step is in flight with the container in use.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.docker]

REPO = Path(__file__).resolve().parents[2]
EXIT_BOUND_S = 60.0  # signal to exit; the shutdown takes ~10 s on an idle machine, the rest is for a loaded one

USER_MODULE = '''
import asyncio
import threading
from pathlib import Path

from agentrl.envs import Environment, tool

LABELS = {"agentrl.test": "@LABEL@"}
CLOSED_MARK = Path("@CLOSED@")  # written by close_resources(): the atexit fallback of the pool would not
_lock = threading.Lock()
_pool = None


def sandbox_pool():
    global _pool
    from agentrl.sandbox import SandboxPool
    from agentrl.sandbox.backend import make_sandbox

    with _lock:
        if _pool is None:
            _pool = SandboxPool(size=1, factory=lambda: make_sandbox("docker", labels=LABELS, role="pool"))
        return _pool


class Echo(Environment):
    max_turns = 1

    def reset(self, task):
        return [{"role": "user", "content": "Say " + task["word"] + "."}]

    @tool
    def say(self, word: str) -> str:
        """Say a word.

        Args:
            word: the word.
        """
        self.done = True
        return word

    async def reward(self):
        async with sandbox_pool().asession() as sandbox:  # the step holds the container while it runs
            res = await sandbox.arun_python("print(6 * 7)", timeout=10)
            await asyncio.sleep(0.5)
        return float(res.stdout.strip() == "42")

    @classmethod
    def close_resources(cls):
        global _pool
        with _lock:
            pool, _pool = _pool, None
        if pool is not None:
            pool.close()
            CLOSED_MARK.write_text("closed")


def tasks(n, *, seed, split):
    return [{"word": ("red", "blue")[(seed + i) % 2]} for i in range(n)]
'''


@pytest.fixture(scope="module")
def docker_api():
    from agentrl.sandbox.engine_setup import docker_problem

    problem = docker_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {problem}", pytrace=False)
        pytest.skip(problem)
    from agentrl.sandbox.docker_client import docker_client

    return docker_client().api


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One tiny base model for both runs."""
    return tmp_path_factory.mktemp("signal-cache")


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a non-interactive shell starts `cmd &`


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_in_grpo_stops_the_run_and_closes_environment_resources(tmp_path, docker_api, cache_dir, sig):
    label = uuid.uuid4().hex
    module = f"signal_env_{label[:8]}"
    closed_mark = tmp_path / "close_resources_ran"
    (tmp_path / f"{module}.py").write_text(USER_MODULE.replace("@LABEL@", label).replace("@CLOSED@", str(closed_mark)))
    shm_before = set(Path("/dev/shm").glob("agentrl-weights-*"))
    mine = {"label": [f"agentrl.test={label}"]}
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "--env", f"{module}:Echo", "--tasks", f"{module}:tasks",
           "--output-dir", str(out), "--cache_dir", str(cache_dir), "--steps", "50",
           "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2",
           "--rollout.max_new_tokens", "8", "--eval.num_tasks", "2", "--eval.every", "100", "--sync_mode", "disk"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            preexec_fn=_ignore_sigint)
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:  # GRPO: step 0 checkpointed, a rollout using the container under way
            for p in _descendants(proc.pid):
                with contextlib.suppress(psutil.Error):
                    seen[p.pid] = " ".join(p.cmdline())[:120]
            if (out / "checkpoints" / "latest").exists() and docker_api.containers(filters=mine):
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.3)
        else:
            pytest.fail("the run never reached GRPO")
        time.sleep(1.0)  # into step 1's rollout
        in_grpo = time.monotonic() - started
        assert any("agentrl.engine" in c for c in seen.values()) and any("smg" in c for c in seen.values())
        sent = time.monotonic()
        os.kill(proc.pid, sig)
        output, _ = proc.communicate(timeout=EXIT_BOUND_S + 60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        leftovers = docker_api.containers(all=True, filters=mine)
        for c in leftovers:  # do not leave them to the next test, whatever happened
            docker_api.remove_container(c["Id"], force=True)
    name = signal.Signals(sig).name
    print(f"{name}: GRPO after {in_grpo:.1f} s, stopped {took:.1f} s after the signal")
    assert proc.returncode == 128 + sig, output[-4000:]
    assert took < EXIT_BOUND_S, f"took {took:.1f} s to stop:\n{output[-4000:]}"
    assert f"{name} received: stopping the run" in output
    assert f"{name}: every process of the run stopped" in output and f"stopped by {name}" in output
    assert closed_mark.exists(), "the environment's close_resources() did not run"
    assert leftovers == [], "the environment's container was left"
    time.sleep(1.0)
    alive = [f"{pid}: {c}" for pid, c in seen.items() if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"left running after {name}: {alive}"
    assert set(Path("/dev/shm").glob("agentrl-weights-*")) <= shm_before  # no shared-memory weight copy left
    assert f"process logs in {out / 'logs'}" in output
    assert list((out / "logs").glob("engine-*.log")) and list((out / "logs").glob("router-*.log"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # every row whole
    assert rows and rows[0]["step"] == 0
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / latest).is_dir()
    assert not (out / "hf" / "final").exists()  # a stopped run exports no final policy
