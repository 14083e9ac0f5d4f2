"""Fixtures for the rollout tests: real stub-engine processes, real smg routers, real embedded engines.

All servers bind 127.0.0.1 on OS-chosen free ports and are stopped at teardown.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rollout_helpers import _NO_PROXY, REPO, http_json, wait_http_ok  # noqa: F401

STUB = REPO / "benchmarks" / "stub_engine.py"


class StubEngineProc:
    """One ``benchmarks/stub_engine.py`` process."""

    def __init__(self) -> None:
        from agentrl.rollout.router import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(STUB), "--port", str(self.port)],
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self) -> StubEngineProc:
        wait_http_ok(self.url + "/health", proc=self.proc)
        return self

    def stats(self) -> dict:
        return http_json(self.url + "/stub_stats")  # type: ignore[return-value]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def stub_engines() -> Iterator[Callable[[int], list[StubEngineProc]]]:
    """Factory: ``stub_engines(n)`` starts n stub engines (started in parallel) and returns them healthy."""
    started: list[StubEngineProc] = []

    def start(n: int) -> list[StubEngineProc]:
        new = [StubEngineProc() for _ in range(n)]
        started.extend(new)
        return [s.wait() for s in new]

    yield start
    for stub in started:
        stub.kill()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny random-init Qwen2 + test tokenizer, written once per test session."""
    from agentrl.models.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))
