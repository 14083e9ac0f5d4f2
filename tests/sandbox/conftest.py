"""Fixtures for the sandbox tests.

Tests marked ``docker`` need a running engine and the base image: with the ``CI`` environment variable
set they FAIL when either is missing (CI must not silently skip the sandbox), elsewhere they skip with
the reason. bubblewrap tests skip when bwrap cannot create namespaces here (and fail under CI).
"""

from __future__ import annotations

import functools
import os

import pytest


@functools.cache
def docker_problem() -> str | None:
    from agentrl.sandbox.engine_setup import docker_problem as problem

    return problem()


@functools.cache
def bwrap_problem() -> str | None:
    from agentrl.sandbox.bwrap_sandbox import bwrap_available

    return None if bwrap_available() else "bubblewrap missing or cannot create namespaces here"


def _require(problem: str | None) -> None:
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {problem}", pytrace=False)
    pytest.skip(problem)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("docker") is not None:
        _require(docker_problem())


@pytest.fixture(scope="session")
def require_bwrap() -> None:
    _require(bwrap_problem())


@pytest.fixture(params=[pytest.param("docker", marks=pytest.mark.docker), "bwrap"])
def backend(request) -> str:
    """Run a test once per backend; the docker run carries the docker mark (fail under CI, else skip)."""
    if request.param == "bwrap":
        _require(bwrap_problem())
    return request.param


@pytest.fixture(scope="session")
def pools():
    """One small pool per backend for the whole session (created on first use)."""
    from agentrl.sandbox import SandboxPool

    made: dict[str, SandboxPool] = {}

    def get(backend: str) -> SandboxPool:
        if backend == "bwrap":
            _require(bwrap_problem())
        if backend not in made:
            made[backend] = SandboxPool(size=2, backend=backend).start()
        return made[backend]

    yield get
    for pool in made.values():
        pool.close()
