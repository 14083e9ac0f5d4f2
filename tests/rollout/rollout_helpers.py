"""HTTP helpers shared by the rollout tests (a uniquely named module: several test folders have a
``conftest``, so ``from conftest import ...`` resolves to whichever folder pytest imported first)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


def seconds_until(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` holds, polled every 0.1 s; an assertion error after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"not within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - start
