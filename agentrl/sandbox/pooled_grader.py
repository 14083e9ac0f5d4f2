"""A grader whose grading sandboxes come from a pool: the same verdicts as :class:`Grader` at a fraction of
the cost when thousands of short solutions are graded (a fresh container costs ~0.5 s on 2 busy cores; a
pooled one ~20 ms per grade).

Each grade still runs in a grading sandbox, never the agent's own: one of ``size`` containers that only
graders use, with one host directory bind-mounted read-only at ``/grader`` that holds the runner alone
(each grade's tests reach the runner on stdin, as :class:`Grader`'s do). Between two grades the pool resets the sandbox
(every process of the sandbox user killed, the work dir and every other writable place emptied: what
:meth:`Sandbox.reset` guarantees and ``tests/sandbox`` proves), and after ``max_uses`` grades it replaces it
with a new one. The judging is :func:`agentrl.sandbox.grader.judge`, unchanged. A grading sandbox that dies
during a grade (container killed, engine restarted) is a :class:`SandboxError`, never a failed grade: the
solution was not judged.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from agentrl.sandbox.backend import make_sandbox, resolve_backend
from agentrl.sandbox.base import Sandbox, SandboxError
from agentrl.sandbox.blocking import run_blocking
from agentrl.sandbox.engine_setup import DEFAULT_IMAGE
from agentrl.sandbox.grader import (
    MOUNT,
    RUNNER_SOURCE,
    Grader,
    GradeResult,
    checked_inputs,
    judge,
    runner_call,
)
from agentrl.sandbox.limits import SandboxLimits
from agentrl.sandbox.pool import SandboxPool


class PooledGrader(Grader):
    """``PooledGrader(size=2).grade({"solution.py": code}, {"test_solution.py": tests})``; ``close()`` (or the
    context manager) removes its sandboxes. ``factory(read_only_mounts)`` may build the grading sandboxes."""

    def __init__(self, size: int = 2, *, backend: str = "auto", image: str = DEFAULT_IMAGE,
                 limits: SandboxLimits | None = None, timeout: float = 30.0, max_uses: int = 50,
                 labels: Mapping[str, str] | None = None,
                 factory: Callable[[Mapping[str, str]], Sandbox] | None = None, acquire_timeout: float = 300.0):
        """``acquire_timeout``: how long a grade waits for a grading sandbox (they are busy, or being
        replaced while the engine restarts) before it is a :class:`SandboxError`."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if acquire_timeout <= 0:
            raise ValueError(f"acquire_timeout must be > 0, got {acquire_timeout}")
        self.timeout = timeout
        self.acquire_timeout = acquire_timeout
        self._root = Path(tempfile.mkdtemp(prefix="agentrl-pooled-grade-"))
        (self._root / "grade_runner.py").write_text(RUNNER_SOURCE)
        for path in (self._root, self._root / "grade_runner.py"):
            path.chmod(0o755 if path.is_dir() else 0o644)  # readable by the sandbox uid
        mounts = {MOUNT: str(self._root)}
        if factory is None:
            kind = resolve_backend(backend)

            def make() -> Sandbox:
                return make_sandbox(kind, image=image, limits=limits, role="grader", labels=labels,
                                    read_only_mounts=mounts)
        else:
            def make() -> Sandbox:
                return factory(mounts)
        self._factory = None  # Grader's per-grade factory is not used: sandboxes come from the pool
        self.pool = SandboxPool(size=size, max_uses=max_uses, factory=make)

    def grade(self, solution_files: Mapping[str, str | bytes], test_files: Mapping[str, str | bytes], *,
              timeout: float | None = None) -> GradeResult:
        expected = checked_inputs(solution_files, test_files)
        try:
            sandbox = self.pool.acquire(timeout=self.acquire_timeout)
        except TimeoutError as exc:
            raise self._none_free() from exc
        try:
            return self._run(sandbox, solution_files, test_files, expected, timeout)
        finally:
            self.pool.release(sandbox)

    async def agrade(self, solution_files: Mapping[str, str | bytes], test_files: Mapping[str, str | bytes], *,
                     timeout: float | None = None) -> GradeResult:
        """:meth:`grade` for asyncio code: waiting for a free grading sandbox holds no worker thread, so
        grades queued behind a busy pool do not stall the sandbox calls of running episodes."""
        expected = checked_inputs(solution_files, test_files)
        try:
            sandbox = await self.pool.aacquire(timeout=self.acquire_timeout)
        except TimeoutError as exc:
            raise self._none_free() from exc
        try:
            return await run_blocking(self._run, sandbox, solution_files, test_files, expected, timeout)
        finally:
            await self.pool.arelease(sandbox)

    def _none_free(self) -> SandboxError:
        return SandboxError(f"no grading sandbox within {self.acquire_timeout:.0f} s (all busy, or the "
                            "container engine does not answer); the solution was not judged")

    def _run(self, sandbox: Sandbox, solution_files: Mapping[str, str | bytes],
             test_files: Mapping[str, str | bytes], expected: int, timeout: float | None) -> GradeResult:
        nonce = secrets.token_hex(16)
        if solution_files:
            sandbox.write_files(solution_files)
        argv, stdin = runner_call(sandbox.python, nonce, test_files)
        res = sandbox.exec(argv, timeout=timeout or self.timeout, stdin=stdin)
        if _died(sandbox, res.stdout, nonce):
            raise SandboxError("the grading sandbox died during the grade; the solution was not judged")
        return judge(res, nonce, expected)

    def close(self) -> None:
        """Remove every grading sandbox and the mounted directory; safe to call twice."""
        self.pool.close()
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> PooledGrader:
        self.pool.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _died(sandbox: Sandbox, stdout: str, nonce: str, settle_s: float = 2.0) -> bool:
    """Whether the sandbox died under the grade. A run that returned no report may have been cut by a kill
    the container engine has not recorded yet (the exec returns first), so its state is polled a moment
    before the grade is judged: a killed grader must not read as a failing solution."""
    if nonce in stdout:  # the runner finished its report: the verdict stands, whatever came after
        return False
    if not sandbox.alive:
        return True
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if not sandbox.alive:
            return True
    return False
