"""The coding agent's sandboxes when the Docker daemon restarts mid-episode (no live-restore, as
``agentrl sandbox setup`` starts it: every container stops with the daemon). The episode in flight fails
with ``SandboxFailure`` -- counted, no sample, never a reward of 0 -- and the pools recover: the next episode,
once the daemon answers again, gets a fresh working sandbox and is graded; no container (not even a
stopped one) is left once the pools close.

The daemon is restarted the way it is run here: SIGTERM to the pid in /var/run/docker.pid, then
:func:`agentrl.sandbox.engine_setup.start_dockerd` (what ``agentrl sandbox setup`` runs), which waits until
it answers. A restart stops every container of the engine, so these tests skip when the engine holds a
container that is not theirs and whose owner is alive (someone else's run), or when this is not root.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from agentrl.envs import generate_rollout, run_episode
from agentrl.envs.formats import HermesFormat, ToolCall
from agentrl.envs.scripted import ScriptedPolicy
from agentrl.rollout.buffer import DataBuffer
from examples.coding_agent import function_env, oneliners
from examples.coding_agent.function_env import LABELS, FunctionEnv, SandboxFailure, expert_replies, make_tasks

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "tests" / "assets" / "tiny_tokenizer"
PID_FILE = Path("/var/run/docker.pid")
FMT = HermesFormat()


def docker_api():
    from agentrl.sandbox.docker_client import docker_client

    return docker_client().api


def _others_containers() -> list[str]:
    """Containers a restart would kill that are not this process's: live owners, or no agentrl owner."""
    from agentrl.sandbox.labels import OWNER_PID, owner_alive

    others = []
    for c in docker_api().containers():  # running ones: a restart only stops those
        labels = c.get("Labels") or {}
        if labels.get(OWNER_PID) != str(os.getpid()) and (OWNER_PID not in labels or owner_alive(labels)):
            others.append(f"{c['Names'][0].lstrip('/')} (owner pid {labels.get(OWNER_PID, '?')})")
    return others


@pytest.fixture(scope="module")
def restartable() -> None:
    from agentrl.sandbox.engine_setup import docker_problem

    problem = docker_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {problem}", pytrace=False)
        pytest.skip(problem)
    if os.geteuid() != 0 or not PID_FILE.exists():
        pytest.skip("restarting dockerd needs root and the daemon's pid file (a daemon `agentrl sandbox setup` started)")


@pytest.fixture
def alone(restartable) -> None:
    """Checked before each test: another run's containers would die with the daemon."""
    others = _others_containers()
    if others:
        pytest.skip(f"the engine runs containers of others, which a restart would stop: {others[:3]}")


def restart_dockerd(stop_timeout_s: float = 60.0) -> float:
    """Stop dockerd (SIGTERM: it stops every container, then exits) and start it again as ``agentrl
    sandbox setup`` does, returning once it answers; returns the seconds it did not answer."""
    import psutil

    from agentrl.sandbox.engine_setup import start_dockerd

    pid = int(PID_FILE.read_text().strip())
    down = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    deadline = down + stop_timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        raise RuntimeError(f"dockerd (pid {pid}) did not exit within {stop_timeout_s:.0f} s of SIGTERM")
    assert start_dockerd(wait_s=60.0), "a daemon answered although the old one had exited"
    return time.monotonic() - down


def _in_background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised by the test after join
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    from agentrl.envs.render import ChatRenderer

    return ChatRenderer(AutoTokenizer.from_pretrained(TOKENIZER_DIR))


@pytest.fixture
def sandboxes(alone):
    """An agent pool and a pooled grader of this test; after it, no container (not even a stopped one) or
    volume of this process is left."""
    from agentrl.sandbox import PooledGrader, SandboxPool
    from agentrl.sandbox.backend import make_sandbox

    pool = SandboxPool(size=2, factory=lambda: make_sandbox("docker", labels=LABELS, role="pool"))
    grader = PooledGrader(size=1, backend="docker", labels=LABELS, max_uses=100)
    with pool, grader:
        yield pool, grader
    mine = {"label": [f"agentrl.example={LABELS['agentrl.example']}", f"agentrl.owner_pid={os.getpid()}"]}
    left = docker_api().containers(all=True, filters=mine)
    assert left == [], f"left after the pools closed: {[(c['Names'], c['State']) for c in left]}"
    assert not docker_api().volumes(filters=mine).get("Volumes")


def call(name: str, **arguments) -> str:
    return FMT.render_calls([ToolCall(name, arguments)])


def _rollout(renderer, env_cls, task, replies, sandboxes, n: int):
    """``n`` episodes of ``task``, one after the other (the second starts after the first has ended)."""
    pool, grader = sandboxes
    policy = ScriptedPolicy(renderer.tokenizer, replies)
    return asyncio.run(generate_rollout(functools.partial(env_cls, pool=pool, grader=grader), [task], policy,
                                        renderer, n_samples_per_task=n, concurrency=1))


def _assert_failed_and_dropped(result, match: str) -> None:
    failed = [e for e in result.episodes if e.metrics.error]
    assert len(failed) == 1 and failed[0].metrics.error.startswith("SandboxFailure"), failed[0].metrics.error
    assert match in failed[0].metrics.error
    assert failed[0].samples == []  # nothing of it is trained: no reward, not a reward of 0
    summary = result.summary()
    assert summary["failed"] == 1 and summary["failure_reasons"] == {"SandboxFailure": 1}
    kept = DataBuffer(lambda group: True).kept([[s for e in group for s in e.samples] for group in result.groups])
    assert [s.reward for group in kept for s in group] == [1.0]  # the group trains on the episode after the restart
    assert FunctionEnv.rollout_metrics()["sandbox/failed_episodes"] == 1


def test_a_dockerd_restart_between_write_and_run_tests_fails_the_episode(renderer, sandboxes):
    """Episode 1 writes the correct body; the daemon restarts before its run_tests (every container stops):
    SandboxFailure, counted, dropped. Episode 2, after the daemon answers again, gets a new sandbox, runs
    the same script and is graded 1.0."""
    task = make_tasks(1, seed=11)[0]
    restarts: list[float] = []

    class Env(FunctionEnv):
        async def write(self, code):
            result = await FunctionEnv.write(self, code)
            if not restarts:
                restarts.append(await asyncio.to_thread(restart_dockerd))
            return result

    function_env.METER.report()  # count from here
    result = _rollout(renderer, Env, task, expert_replies(task), sandboxes, n=2)
    assert len(restarts) == 1
    _assert_failed_and_dropped(result, "run_tests")
    first, second = result.episodes
    assert first.metrics.error and second.metrics.reward == 1.0


def test_a_dockerd_restart_mid_grade_fails_the_episode(renderer, sandboxes):
    """Episode 1's solution is correct and slow; the daemon restarts while its hidden tests run in the
    grading container: SandboxFailure ("grading failed"), counted, dropped -- not a failing grade. Episode
    2 (the expert's fast body), once the daemon is back, is graded 1.0 by the recovered grader pool."""
    task = make_tasks(1, seed=12)[0]
    slow = "import time\ntime.sleep(20)\n" + oneliners.solution_body(task)

    def grading_now() -> bool:
        mine = {"label": ["agentrl.role=grader", f"agentrl.owner_pid={os.getpid()}"]}
        for container in docker_api().containers(filters=mine):
            processes = docker_api().top(container["Id"]).get("Processes") or []
            if any("grade_runner" in " ".join(p) for p in processes):  # ps cuts the command line
                return True
        return False

    def restart_mid_grade() -> float:
        deadline = time.monotonic() + 120
        while not grading_now():
            if time.monotonic() > deadline:
                raise RuntimeError("no grade ran within 120 s")
            time.sleep(0.05)
        return restart_dockerd()

    restarter, restarted = _in_background(restart_mid_grade)
    calls = {"n": 0}

    def replies(prompt: str, turn: int) -> str:  # episode 1: the slow body; episode 2: the expert
        script = [call("write", code=slow), call("submit")] if calls["n"] < 2 else expert_replies(task)
        calls["n"] += 1
        return script[min(turn, len(script) - 1)]

    class Env(FunctionEnv):
        async def reward(self):
            try:
                return await FunctionEnv.reward(self)
            finally:
                await asyncio.to_thread(restarter.join, 120)  # episode 2 starts with the daemon back

    function_env.METER.report()
    result = _rollout(renderer, Env, task, replies, sandboxes, n=2)
    assert "error" not in restarted, restarted.get("error")
    assert "value" in restarted  # the restart happened during episode 1's grade
    _assert_failed_and_dropped(result, "grading failed")
    assert result.episodes[1].metrics.reward == 1.0


def test_an_episode_run_while_the_daemon_is_down_fails_then_the_pool_recovers(renderer, sandboxes):
    """The daemon stops between write and run_tests and stays down while the episode goes on: its
    run_tests and its end fail it (SandboxFailure; the pool cannot even replace the sandbox yet, and
    says so); once the daemon is started again, the next episode gets a working sandbox."""
    from agentrl.sandbox.engine_setup import start_dockerd

    pool, _ = sandboxes
    task = make_tasks(1, seed=13)[0]
    stopped: list[int] = []

    def stop_dockerd() -> None:
        import psutil

        pid = int(PID_FILE.read_text().strip())
        os.kill(pid, signal.SIGTERM)
        psutil.Process(pid).wait(60)
        stopped.append(pid)

    class Env(FunctionEnv):
        async def write(self, code):
            result = await FunctionEnv.write(self, code)
            if not stopped:
                await asyncio.to_thread(stop_dockerd)
            return result

    try:
        policy = ScriptedPolicy(renderer.tokenizer, expert_replies(task))
        env = Env(pool=pool, grader=sandboxes[1])
        with pytest.raises(SandboxFailure, match="run_tests"):
            asyncio.run(run_episode(env, task, policy, renderer, session_id="down"))
    finally:
        start_dockerd(wait_s=60.0)
    result = _rollout(renderer, FunctionEnv, task, expert_replies(task), sandboxes, n=1)
    assert [e.metrics.reward for e in result.episodes] == [1.0]
    with pool.session() as fresh:
        assert fresh.healthy()
