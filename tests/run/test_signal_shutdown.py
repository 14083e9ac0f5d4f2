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


class StoppedRun:
    """One ``agentrl train`` subprocess with its own labelled container, output dir and close marker."""

    def __init__(self, tmp_path: Path, cache_dir: Path, sig: int) -> None:
        self.sig, self.name = sig, signal.Signals(sig).name
        label = uuid.uuid4().hex
        module = f"signal_env_{label[:8]}"
        self.dir = tmp_path / self.name
        self.dir.mkdir()
        self.closed_mark = self.dir / "close_resources_ran"
        (self.dir / f"{module}.py").write_text(
            USER_MODULE.replace("@LABEL@", label).replace("@CLOSED@", str(self.closed_mark)))
        self.mine = {"label": [f"agentrl.test={label}"]}
        self.out = self.dir / "run"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.dir), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "agentrl.cli", "train", "--env", f"{module}:Echo", "--tasks", f"{module}:tasks",
               "--output-dir", str(self.out), "--cache_dir", str(cache_dir), "--steps", "50",
               "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2",
               "--rollout.max_new_tokens", "8", "--eval.num_tasks", "2", "--eval.every", "100", "--sync_mode", "disk"]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=REPO, preexec_fn=_ignore_sigint)
        self.seen: dict[int, str] = {}
        self.in_grpo: float | None = None
        self.output, self.took, self.leftovers = "", None, []

    def poll_into_grpo(self, docker_api) -> bool:
        """Records the run's processes; True once step 0 is checkpointed and a rollout uses the container."""
        for p in _descendants(self.proc.pid):
            with contextlib.suppress(psutil.Error):
                self.seen[p.pid] = " ".join(p.cmdline())[:120]
        if self.in_grpo is None and (self.out / "checkpoints" / "latest").exists() \
                and docker_api.containers(filters=self.mine):
            self.in_grpo = time.monotonic() - self.started
        if self.in_grpo is None and self.proc.poll() is not None:
            pytest.fail(f"{self.name} run exited before GRPO:\n{self.proc.stdout.read()[-4000:]}")
        return self.in_grpo is not None

    def cleanup(self, docker_api) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.leftovers = docker_api.containers(all=True, filters=self.mine)
        for c in self.leftovers:  # do not leave them to the next test, whatever happened
            docker_api.remove_container(c["Id"], force=True)


def test_a_stop_signal_in_grpo_stops_the_run_and_closes_environment_resources(tmp_path, docker_api, cache_dir):
    """SIGINT and SIGTERM, each to its own run; both runs start together so the suite pays one start-up."""
    shm_before = set(Path("/dev/shm").glob("agentrl-weights-*"))
    runs = [StoppedRun(tmp_path, cache_dir, signal.SIGINT)]
    try:
        # The second run starts once the first has built the shared tiny base model in cache_dir.
        deadline = time.monotonic() + 400
        while not list(cache_dir.glob("tiny-*/config.json")) and time.monotonic() < deadline:
            runs[0].poll_into_grpo(docker_api)
            time.sleep(0.3)
        runs.append(StoppedRun(tmp_path, cache_dir, signal.SIGTERM))
        waiting = list(runs)
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not r.poll_into_grpo(docker_api)]
            for run in runs:
                if run not in waiting and run.took is None:
                    time.sleep(1.0)  # into step 1's rollout
                    run.poll_into_grpo(docker_api)
                    sent = time.monotonic()
                    os.kill(run.proc.pid, run.sig)
                    run.output, _ = run.proc.communicate(timeout=EXIT_BOUND_S + 60)
                    run.took = time.monotonic() - sent
            time.sleep(0.3)
        if waiting:
            pytest.fail(f"never reached GRPO: {[r.name for r in waiting]}")
    finally:
        for run in runs:
            run.cleanup(docker_api)
    for run in runs:
        _check_stopped(run, shm_before)


def _check_stopped(run: StoppedRun, shm_before: set[Path]) -> None:
    name, output, out, proc = run.name, run.output, run.out, run.proc
    print(f"{name}: GRPO after {run.in_grpo:.1f} s, stopped {run.took:.1f} s after the signal")
    assert proc.returncode == 128 + run.sig, output[-4000:]
    assert run.took < EXIT_BOUND_S, f"took {run.took:.1f} s to stop:\n{output[-4000:]}"
    assert f"{name} received: stopping the run" in output
    assert f"{name}: every process of the run stopped" in output and f"stopped by {name}" in output
    assert run.closed_mark.exists(), "the environment's close_resources() did not run"
    assert run.leftovers == [], "the environment's container was left"
    time.sleep(1.0)
    alive = [f"{pid}: {c}" for pid, c in run.seen.items() if psutil.pid_exists(pid)
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
