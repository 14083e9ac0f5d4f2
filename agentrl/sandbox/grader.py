"""Grade code by running hidden tests in a FRESH sandbox (never the agent's own).

The agent's files are copied into a new sandbox; the runner lives in a host directory bind-mounted
read-only at ``/grader`` of that sandbox only. The tests and this run's nonce reach the runner on stdin,
after it has forked the process the solution runs in: they are on no file of the sandbox, so the agent
never sees them and the solution can neither read nor edit them (:mod:`agentrl.sandbox.grade_runner`
says how the solution's calls cross as plain data, so no object of the solution is ever compared and
no code of it runs where the report is written). A run passes only if the runner exited 0, its report
carries this run's nonce, it collected at least one test and exactly as many as the test files define
(counted on the host with ``ast``), and every one passed. "No tests collected", a crashed or killed
runner, a timeout, or a missing report are failures.
"""

from __future__ import annotations

import ast
import json
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.sandbox.backend import make_sandbox, resolve_backend
from agentrl.sandbox.base import Sandbox, SpecialFileError, work_path
from agentrl.sandbox.blocking import run_blocking
from agentrl.sandbox.engine_setup import DEFAULT_IMAGE
from agentrl.sandbox.limits import SandboxLimits
from agentrl.sandbox.result import ExecResult

RUNNER_SOURCE = Path(__file__).with_name("grade_runner.py").read_text()
MOUNT = "/grader"
MARK = "AGENTRL-GRADE"
MAX_SOLUTION_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class GradeResult:
    passed: bool
    reason: str
    collected: int = 0
    passed_tests: int = 0
    expected: int = 0
    failures: list[str] = field(default_factory=list)
    exec_result: ExecResult | None = None

    @property
    def reward(self) -> float:
        return 1.0 if self.passed else 0.0


# CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not per thread: a parse that
# yields the GIL mid-way (a garbage collection running a finalizer) to another thread's parse ends with
# "SystemError: AST constructor recursion depth mismatch" (cpython gh-106905). Graders parse tests
# from many threads at once (grade_many, the rollout's pooled grader).
_PARSE_LOCK = threading.Lock()


def count_tests(test_files: Mapping[str, str | bytes]) -> int:
    """Tests the runner will find: top-level ``test*`` functions and ``test*`` methods of classes, in
    ``test*.py`` files. ValueError for a test file that does not parse."""
    total = 0
    for name, source in test_files.items():
        base = Path(name).name
        if not (base.startswith("test") and base.endswith(".py")):
            continue
        try:
            with _PARSE_LOCK:
                tree = ast.parse(source)
        except SyntaxError as exc:
            raise ValueError(f"test file {name} does not parse: {exc}") from exc
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                total += 1
            elif isinstance(node, ast.ClassDef):
                total += sum(1 for item in node.body
                             if isinstance(item, ast.FunctionDef) and item.name.startswith("test"))
    return total


def runner_call(python: str, nonce: str, test_files: Mapping[str, str | bytes]) -> tuple[list[str], str]:
    """(argv, stdin) of one run of the mounted runner: isolated mode (no user site, no environment, no
    writable directory on its path), the nonce and the tests on stdin."""
    tests = {name: content if isinstance(content, str) else bytes(content).decode()
             for name, content in test_files.items()}
    return [python, "-I", f"{MOUNT}/grade_runner.py"], nonce + "\n" + json.dumps({"tests": tests}) + "\n"


def _validate_tests(test_files: Mapping[str, str | bytes]) -> None:
    if not test_files:
        raise ValueError("no test files given")
    for name in test_files:
        if "/" in name or name in {".", ".."} or not name:
            raise ValueError(f"test file names must be plain file names, got {name!r}")
        if name == "grade_runner.py":
            raise ValueError("test file name grade_runner.py is reserved")
        content = test_files[name]
        if not isinstance(content, str):
            try:
                bytes(content).decode()
            except UnicodeDecodeError as exc:
                raise ValueError(f"test file {name} is not UTF-8 text") from exc


def checked_inputs(solution_files: Mapping[str, str | bytes], test_files: Mapping[str, str | bytes]) -> int:
    """The number of tests ``test_files`` define; ValueError, before any sandbox is used, for bad test files or
    a solution path outside the work directory."""
    _validate_tests(test_files)
    for path in solution_files:
        work_path("/work", path)
    return count_tests(test_files)


def judge(res: ExecResult, nonce: str, expected: int) -> GradeResult:
    """Turn one runner execution into a verdict (pure; unit-tested on its own)."""
    report = None
    for line in res.stdout.splitlines():
        if line.startswith(f"{MARK} {nonce} "):
            try:
                report = json.loads(line[len(MARK) + len(nonce) + 2:])
            except ValueError:
                report = None
    if res.timed_out:
        return GradeResult(False, "timed out", expected=expected, exec_result=res)
    if res.oom_killed:
        return GradeResult(False, "runner killed: out of memory", expected=expected, exec_result=res)
    if res.exit_code != 0 or report is None:
        return GradeResult(False, f"runner crashed (exit {res.exit_code}, report {'present' if report else 'missing'})",
                           expected=expected, exec_result=res)
    collected, passed = int(report.get("collected", 0)), int(report.get("passed", 0))
    failures = list(report.get("failures", []))
    common = dict(collected=collected, passed_tests=passed, expected=expected, failures=failures, exec_result=res)
    if collected == 0:
        return GradeResult(False, "no tests collected", **common)
    if collected != expected:
        return GradeResult(False, f"collected {collected} tests, the test files define {expected}", **common)
    if passed != collected or failures:
        return GradeResult(False, f"{collected - passed} of {collected} tests failed", **common)
    return GradeResult(True, "passed", **common)


def export_solution(agent_sandbox: Sandbox, paths: Sequence[str]) -> dict[str, bytes] | GradeResult:
    """``paths`` copied out of the agent's sandbox without its help (``Sandbox.export_file``: the engine's
    archive API, or the host), or the failed grade they earn at once: a path that is missing, not a
    regular file (a link, a FIFO) or too large."""
    files = {}
    for path in paths:
        try:
            files[path] = agent_sandbox.export_file(path, max_bytes=MAX_SOLUTION_BYTES)
        except FileNotFoundError:
            return GradeResult(False, f"solution file {path} is missing")
        except (SpecialFileError, IsADirectoryError):
            return GradeResult(False, f"solution file {path} is not a regular file")
        except ValueError:
            return GradeResult(False, f"solution file {path} is larger than {MAX_SOLUTION_BYTES} bytes")
    return files


class Grader:
    """``Grader().grade({"solution.py": code}, {"test_solution.py": tests})`` -> :class:`GradeResult`.

    ``factory(read_only_mounts)`` may build the fresh sandbox (default: backend/image/limits).
    """

    def __init__(self, *, backend: str = "auto", image: str = DEFAULT_IMAGE, limits: SandboxLimits | None = None,
                 timeout: float = 30.0, factory: Callable[[Mapping[str, str]], Sandbox] | None = None):
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.timeout = timeout
        if factory is None:
            kind = resolve_backend(backend)

            def factory(mounts: Mapping[str, str]) -> Sandbox:
                return make_sandbox(kind, image=image, limits=limits, role="grader", read_only_mounts=mounts)
        self._factory = factory

    def grade(self, solution_files: Mapping[str, str | bytes], test_files: Mapping[str, str | bytes], *,
              timeout: float | None = None) -> GradeResult:
        expected = checked_inputs(solution_files, test_files)
        nonce = secrets.token_hex(16)
        host_dir = Path(tempfile.mkdtemp(prefix="agentrl-grade-"))
        try:
            (host_dir / "grade_runner.py").write_text(RUNNER_SOURCE)
            for p in [host_dir, host_dir / "grade_runner.py"]:  # readable by the sandbox uid
                p.chmod(0o755 if p.is_dir() else 0o644)
            sandbox = self._factory({MOUNT: str(host_dir)})
            with sandbox:
                if solution_files:
                    sandbox.write_files(solution_files)
                argv, stdin = runner_call(sandbox.python, nonce, test_files)
                res = sandbox.exec(argv, timeout=timeout or self.timeout, stdin=stdin)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)
        return judge(res, nonce, expected)

    def grade_from(self, agent_sandbox: Sandbox, paths: Sequence[str], test_files: Mapping[str, str | bytes], *,
                   timeout: float | None = None) -> GradeResult:
        """Copy ``paths`` out of the agent's sandbox (:func:`export_solution`) and grade them in a fresh one."""
        files = export_solution(agent_sandbox, paths)
        if isinstance(files, GradeResult):
            return files
        return self.grade(files, test_files, timeout=timeout)

    def grade_many(self, items: Sequence[tuple[Mapping[str, str | bytes], Mapping[str, str | bytes]]], *,
                   concurrency: int = 2, timeout: float | None = None) -> list[GradeResult]:
        """Grade (solution_files, test_files) pairs, each in its own fresh sandbox, ``concurrency`` at once."""
        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="agentrl-grade") as ex:
            return list(ex.map(lambda item: self.grade(item[0], item[1], timeout=timeout), items))

    async def agrade(self, solution_files: Mapping[str, str | bytes], test_files: Mapping[str, str | bytes], *,
                     timeout: float | None = None) -> GradeResult:
        return await run_blocking(self.grade, solution_files, test_files, timeout=timeout)
