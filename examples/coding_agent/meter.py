"""Counts and latencies of the sandbox operations an environment runs in this process, reported (and reset)
once per rollout as the run's ``env/sandbox/*`` metrics."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator

# Commands run in a sandbox, timed as they ran there: run_tests (as the tool awaited it) and the hidden-test
# run of a grade. "grade" itself is the whole reward call: copying the file out, waiting for a free grading
# sandbox, the run, the reset.
COMMANDS = ("run_tests", "grade_run")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of non-empty ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class SandboxMeter:
    """``async with meter.timed("grade"): ...`` records one operation; :meth:`report` summarises and resets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._seconds: dict[str, list[float]] = {}
        self._first: float | None = None
        self._last: float | None = None
        self.failures = 0

    def record(self, kind: str, started: float, ended: float) -> None:
        with self._lock:
            self._seconds.setdefault(kind, []).append(ended - started)
            self._first = started if self._first is None else min(self._first, started)
            self._last = ended if self._last is None else max(self._last, ended)

    def add(self, kind: str, seconds: float) -> None:
        """An operation timed elsewhere (e.g. by the sandbox): counts and latency, not the span."""
        with self._lock:
            self._seconds.setdefault(kind, []).append(seconds)

    @contextlib.asynccontextmanager
    async def timed(self, kind: str) -> AsyncIterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.record(kind, started, time.perf_counter())

    def failed(self) -> None:
        """An episode failed because its sandbox (or its grading sandbox) died."""
        with self._lock:
            self.failures += 1

    def report(self) -> dict[str, float]:
        """Since the last report: operations and commands, commands per second over the span from the
        first operation's start to the last one's end, p50/p99 latency in ms (all commands, and per
        kind), and episodes failed by a sandbox."""
        with self._lock:
            seconds, first, last, failures = self._seconds, self._first, self._last, self.failures
            self._reset()
        out: dict[str, float] = {"sandbox/failed_episodes": float(failures)}
        commands = [s for kind in COMMANDS for s in seconds.get(kind, [])]
        out["sandbox/ops"] = float(sum(map(len, seconds.values())))
        out["sandbox/execs"] = float(len(commands))
        if first is not None and last is not None and last > first:
            out["sandbox/execs_per_s"] = len(commands) / (last - first)
        if commands:
            out["sandbox/exec_p50_ms"] = 1e3 * percentile(commands, 50)
            out["sandbox/exec_p99_ms"] = 1e3 * percentile(commands, 99)
        for kind, values in sorted(seconds.items()):
            out[f"sandbox/{kind}_p50_ms"] = 1e3 * percentile(values, 50)
            out[f"sandbox/{kind}_p99_ms"] = 1e3 * percentile(values, 99)
        return out
