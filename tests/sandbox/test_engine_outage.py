"""A container engine that stops answering (a dockerd restart) while sandboxes are removed: the removal is
kept and retried when the engine answers again, so no stopped container outlives the pool that owned it.
(The real restart, mid-episode, is ``tests/examples/test_coding_agent_dockerd_restart.py``.)"""

from __future__ import annotations

import uuid

import pytest
import requests

from agentrl.sandbox import DockerSandbox, SandboxPool
from agentrl.sandbox import docker_sandbox as ds

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


class EngineDown:
    """The engine's API for one sandbox, refusing every removal while ``down`` (what the SDK raises when
    the daemon's socket has no listener)."""

    def __init__(self, api) -> None:
        self._api, self.down = api, True

    def __getattr__(self, name: str):
        attr = getattr(self._api, name)
        if name in ("remove_container", "remove_volume"):
            def refused(*args, **kwargs):
                if self.down:
                    raise requests.exceptions.ConnectionError("connection refused (engine down)")
                return attr(*args, **kwargs)
            return refused
        return attr


class ClientWith:
    def __init__(self, client, api) -> None:
        self._client, self.api = client, api

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def _ours(api, label: str) -> tuple[list, list]:
    containers = api.containers(all=True, filters={"label": f"agentrl.test={label}"})
    volumes = api.volumes(filters={"label": f"agentrl.test={label}"}).get("Volumes") or []
    return containers, volumes


def test_a_removal_refused_by_a_down_engine_is_retried_when_it_answers():
    from agentrl.sandbox.docker_client import docker_client

    label = uuid.uuid4().hex
    real = docker_client()
    engine = EngineDown(real.api)
    victim = DockerSandbox(labels={"agentrl.test": label}, client=ClientWith(real, engine))
    try:
        victim.start()
        victim.close()  # the engine refuses: nothing removed, the sandbox is closed all the same
        containers, volumes = _ours(real.api, label)
        assert len(containers) == 1 and len(volumes) == 1 and not victim.alive
        assert ds.remove_deferred() == 2  # still down: both kept
        engine.down = False
        with DockerSandbox(labels={"agentrl.test": label}):  # the next sandbox's start retries them
            containers, volumes = _ours(real.api, label)
            assert len(containers) == 1 and f"/{victim.name}" not in containers[0]["Names"]  # only the new one
            assert victim.volume_name not in {v["Name"] for v in volumes}
        assert _ours(real.api, label) == ([], [])
    finally:
        engine.down = False
        ds.remove_deferred()


def test_a_pool_replacing_sandboxes_during_an_outage_leaves_none_after_close():
    from agentrl.sandbox.docker_client import docker_client

    label = uuid.uuid4().hex
    real = docker_client()
    engine = EngineDown(real.api)
    pool = SandboxPool(size=1, factory=lambda: DockerSandbox(labels={"agentrl.test": label},
                                                              client=ClientWith(real, engine)))
    try:
        engine.down = False
        sandbox = pool.acquire()
        engine.down = True
        sandbox.close()  # as if the container died, then its removal was refused
        pool.release(sandbox)  # not alive: replaced; the old one's removal is refused again
        assert len(_ours(real.api, label)[0]) == 2
        engine.down = False
        pool.close()
        assert _ours(real.api, label) == ([], [])
    finally:
        engine.down = False
        pool.close()
        ds.remove_deferred()


def test_a_pool_that_could_not_warm_while_the_engine_was_down_warms_once_it_answers():
    from agentrl.sandbox import SandboxError
    from agentrl.sandbox.docker_client import docker_client

    label = uuid.uuid4().hex
    down = [True]

    def factory():
        if down[0]:
            raise SandboxError("could not start a sandbox: engine down")
        return DockerSandbox(labels={"agentrl.test": label})

    pool = SandboxPool(size=2, factory=factory)
    try:
        with pytest.raises(SandboxError, match="could not warm the pool"):
            pool.acquire(timeout=5)
        down[0] = False  # the engine answers again: the same pool warms on the next acquire
        with pool.session(timeout=60) as sandbox:
            assert sandbox.healthy()
    finally:
        pool.close()
    assert _ours(docker_client().api, label) == ([], [])


def test_a_grade_that_gets_no_grading_sandbox_in_time_is_a_sandbox_error():
    from agentrl.sandbox import PooledGrader, SandboxError

    with PooledGrader(size=1, backend="docker", acquire_timeout=1.0) as grader:
        held = grader.pool.acquire()  # the only grading sandbox is busy (or being replaced) throughout
        try:
            with pytest.raises(SandboxError, match="no grading sandbox within 1 s"):
                grader.grade({"solution.py": "x = 1\n"}, {"test_solution.py": "def test_x():\n    pass\n"})
        finally:
            grader.pool.release(held)


class AnswerLost:
    """The engine's API for one sandbox whose create request the engine carries out but whose answer the
    client never gets (the daemon goes away between the two)."""

    def __init__(self, api) -> None:
        self._api = api

    def __getattr__(self, name: str):
        attr = getattr(self._api, name)
        if name == "create_container":
            def lost(*args, **kwargs):
                attr(*args, **kwargs)
                raise requests.exceptions.ConnectionError("Connection aborted (answer lost)")
            return lost
        return attr


def test_a_container_created_whose_answer_was_lost_is_removed_by_name():
    from agentrl.sandbox.base import SandboxError
    from agentrl.sandbox.docker_client import docker_client

    label = uuid.uuid4().hex
    real = docker_client()
    sb = DockerSandbox(labels={"agentrl.test": label}, client=ClientWith(real, AnswerLost(real.api)))
    with pytest.raises(SandboxError, match="answer lost"):
        sb.start()
    assert _ours(real.api, label) == ([], [])  # the engine made it; start() removed it by its name
