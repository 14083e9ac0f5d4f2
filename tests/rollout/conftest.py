"""Fixtures for the rollout tests: real stub-engine processes, real smg routers, real embedded engines.

All servers bind 127.0.0.1 on OS-chosen free ports and are stopped at teardown.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUB = REPO / "benchmarks" / "stub_engine.py"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url: str, body: object = None, method: str | None = None, timeout: float = 10.0) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"} if data else {})
    with _NO_PROXY.open(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def wait_http_ok(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with _NO_PROXY.open(url, timeout=2.0) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout} s")
        time.sleep(0.05)


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
