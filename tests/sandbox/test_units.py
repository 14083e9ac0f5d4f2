"""Pure logic of the sandbox package (no engine needed): limits, paths, capped output, verdicts,
the executor protocol over local pipes, lazy imports, CLI argument errors."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrl.sandbox.base import as_argv, work_path
from agentrl.sandbox.engine_setup import apt_mirror
from agentrl.sandbox.executor_client import EXECUTOR_SOURCE, ExecutorClient, ExecutorGone, PipeTransport
from agentrl.sandbox.grader import Grader, GradeResult, count_tests, judge
from agentrl.sandbox.humaneval import load_problems
from agentrl.sandbox.limits import SandboxLimits, parse_size
from agentrl.sandbox.result import CappedOutput, ExecResult


def _res(stdout="", exit_code=0, timed_out=False, oom=False) -> ExecResult:
    return ExecResult(exit_code, stdout, "", timed_out, oom, 0.1, False)


# ---- limits and paths ---------------------------------------------------------------------------
def test_parse_size_units():
    assert parse_size("64k") == 64 * 1024
    assert parse_size("512m") == 512 * 1024**2
    assert parse_size("1G") == 1024**3
    assert parse_size(4096) == 4096


@pytest.mark.parametrize("bad", ["", "12x", "-5m", "0", 0, -1, "m"])
def test_parse_size_rejects_garbage(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("kwargs", [{"memory": "lots"}, {"cpus": 0}, {"pids": 2}, {"output_limit": -1},
                                    {"work_size": "0"}])
def test_limits_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        SandboxLimits(**kwargs)


def test_work_path_accepts_inside_paths():
    assert work_path("/work", "a/b.py") == "a/b.py"
    assert work_path("/work", "/work/x") == "x"
    assert work_path("/work", "./a/../b") == "b"


@pytest.mark.parametrize("bad", ["../etc/passwd", "/etc/passwd", "/work", "", "a/../../x", "/workx/y", "a\0b"])
def test_work_path_rejects_escapes(bad):
    with pytest.raises(ValueError):
        work_path("/work", bad)


@given(st.lists(st.sampled_from(["a", "b", "..", ".", "/"]), max_size=8))
def test_work_path_never_leaves_the_work_dir(parts):
    path = "/".join(parts)
    try:
        rel = work_path("/work", path)
    except ValueError:
        return
    assert not rel.startswith("/") and ".." not in rel.split("/") and rel


def test_as_argv():
    assert as_argv("echo hi") == ["sh", "-c", "echo hi"]
    assert as_argv(["python3", "-c", "1"]) == ["python3", "-c", "1"]
    for bad in ["", "   ", [], [""], ["a\0"]]:
        with pytest.raises(ValueError):
            as_argv(bad)


# ---- capped output ------------------------------------------------------------------------------
@given(st.lists(st.binary(max_size=50), max_size=20), st.integers(min_value=0, max_value=120))
def test_capped_output_keeps_exactly_the_prefix(chunks, limit):
    cap = CappedOutput(limit)
    for c in chunks:
        cap.add(c)
    whole = b"".join(chunks)
    assert cap.text() == whole[:limit].decode("utf-8", errors="replace")
    assert cap.total == len(whole)
    assert cap.truncated == (len(whole) > limit)


# ---- grader verdicts (pure) ----------------------------------------------------------------------
def _report(nonce, collected, passed, failures=()):
    import json

    return f"AGENTRL-GRADE {nonce} " + json.dumps({"collected": collected, "passed": passed,
                                                   "failures": list(failures)})


def test_judge_passes_only_a_complete_nonced_report():
    assert judge(_res(_report("n1", 2, 2)), "n1", 2).passed


@pytest.mark.parametrize("res,reason", [
    (_res(_report("n1", 0, 0)), "no tests collected"),
    (_res(_report("n1", 1, 1)), "collected 1 tests, the test files define 2"),
    (_res(_report("n1", 2, 1, ["t: AssertionError"])), "1 of 2 tests failed"),
    (_res(_report("forged", 2, 2)), "runner crashed"),
    (_res(""), "runner crashed"),
    (_res(_report("n1", 2, 2), exit_code=1), "runner crashed"),
    (_res(_report("n1", 2, 2), exit_code=137, timed_out=True), "timed out"),
    (_res("", exit_code=137, oom=True), "runner killed: out of memory"),
])
def test_judge_fails_every_hole(res, reason):
    verdict = judge(res, "n1", 2)
    assert not verdict.passed and verdict.reward == 0.0
    assert verdict.reason.startswith(reason)


def test_count_tests_matches_runner_rules():
    src = ("def test_a(): pass\n"
           "def helper(): pass\n"
           "class TestX:\n    def test_b(self): pass\n    def other(self): pass\n"
           "async def test_c(): pass\n")
    assert count_tests({"test_m.py": src, "conftest.py": "def test_no(): pass\n"}) == 3
    with pytest.raises(ValueError, match="does not parse"):
        count_tests({"test_bad.py": "def test_(:\n"})


def test_count_tests_from_many_threads_while_finalizers_yield_the_gil():
    """CPython 3.11's AST constructor depth is shared by threads (gh-106905): a parse interrupted by a
    finalizer that yields the GIL, while a thread at another stack depth parses, raised SystemError
    (seen in CI from grade_many). Each thread leaves cyclic garbage whose finalizer sleeps, so the
    collector runs it inside the next parse."""
    problems = load_problems()
    files = [{"test_hidden.py": p["prompt"] + p["canonical_solution"] + p["test"] + "\ndef test_x(): pass\n"}
             for p in problems.values()]

    class YieldsOnCollection:
        def __init__(self):
            self.me = self

        def __del__(self):
            time.sleep(0)

    errors: list[BaseException] = []
    counts: list[int] = []

    def parse_all(depth: int) -> None:
        if depth:
            return parse_all(depth - 1)
        for item in files * 2:
            for _ in range(5):
                YieldsOnCollection()
            try:
                counts.append(count_tests(item))
            except BaseException as exc:  # noqa: BLE001 - the SystemError is what this test looks for
                errors.append(exc)

    threshold = gc.get_threshold()
    gc.set_threshold(100, 1, 1)
    try:
        threads = [threading.Thread(target=parse_all, args=(d,)) for d in (0, 5, 10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*threshold)
    assert not errors, errors[:3]
    assert counts == [1] * (3 * 2 * len(files))


@pytest.mark.parametrize("tests", [{}, {"sub/test_a.py": "x"}, {"grade_runner.py": "x"}])
def test_grader_rejects_bad_test_file_names_before_making_a_sandbox(tests):
    made = []
    grader = Grader(factory=lambda mounts: made.append(mounts))
    with pytest.raises(ValueError):
        grader.grade({"solution.py": "x = 1"}, tests)
    assert made == []


def test_grader_rejects_solution_paths_outside_work():
    grader = Grader(factory=lambda mounts: pytest.fail("no sandbox should be made"))
    with pytest.raises(ValueError, match="outside"):
        grader.grade({"../evil.py": "x"}, {"test_a.py": "def test_a(): pass\n"})


def test_grade_result_reward():
    assert GradeResult(True, "passed").reward == 1.0


# ---- the executor protocol, over local pipes (no isolation: benign commands only) ----------------
@pytest.fixture
def local_executor():
    proc = subprocess.Popen([sys.executable, "-c", EXECUTOR_SOURCE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    client = ExecutorClient(PipeTransport(proc))
    yield client
    client.close()
    proc.kill()
    proc.wait()


def _run(client, argv, timeout=5.0, stdin=None, limit=65536):
    return client.run(argv, timeout=timeout, stdin=stdin, env={"PATH": "/usr/bin:/bin"}, cwd="/tmp", limit=limit)


def test_executor_stdout_stderr_exit_code_stdin(local_executor):
    r = _run(local_executor, ["sh", "-c", "cat; echo oops >&2; exit 3"], stdin=b"hello\n")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (3, "hello\n", "oops\n", False, False)


def test_executor_large_stdin_with_large_output_does_not_deadlock(local_executor):
    data = b"x" * (2 * 1024 * 1024)
    r = _run(local_executor, ["cat"], stdin=data, limit=100)
    assert r.exit_code == 0 and r.truncated and r.stdout == "x" * 100


def test_executor_timeout_kills(local_executor):
    t0 = time.monotonic()
    r = _run(local_executor, ["sh", "-c", "while :; do :; done"], timeout=0.5)
    assert r.timed_out and r.exit_code == 137 and time.monotonic() - t0 < 3


def test_executor_returns_while_background_child_holds_the_pipe(local_executor):
    t0 = time.monotonic()
    r = _run(local_executor, ["sh", "-c", "sleep 30 & echo started"])
    assert r.stdout == "started\n" and r.exit_code == 0 and time.monotonic() - t0 < 2


def test_executor_missing_binary_is_127(local_executor):
    r = _run(local_executor, ["/nonexistent/binary"])
    assert r.exit_code == 127 and "No such file" in r.stderr


def test_executor_bad_request_keeps_it_alive(local_executor):
    with pytest.raises(RuntimeError, match="rejected"):
        local_executor.call({"op": "nope"}, 5)
    assert "pid" in local_executor.call({"op": "ping"}, 5)


def test_executor_gone_is_reported(local_executor):
    local_executor.transport.proc.kill()
    with pytest.raises(ExecutorGone):
        local_executor.call({"op": "ping"}, 5)


# ---- packaging and CLI --------------------------------------------------------------------------
def test_import_is_lazy_and_names_resolve():
    code = ("import sys, agentrl.sandbox as s\n"
            "assert 'docker' not in sys.modules\n"
            "from agentrl.sandbox import DockerSandbox, SandboxPool, ExecResult\n"
            "assert 'docker' not in sys.modules, 'docker imported at import time'\n"
            "print(DockerSandbox.__name__, SandboxPool.__name__, ExecResult.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["DockerSandbox", "SandboxPool", "ExecResult"]


def test_unknown_export_is_an_attribute_error():
    import agentrl.sandbox as s

    with pytest.raises(AttributeError):
        s.NoSuchThing  # noqa: B018


def test_cli_rejects_unknown_subcommand(capsys):
    from agentrl.sandbox.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["explode"])
    assert exc.value.code == 2


def test_apt_mirror_reads_deb822_and_list_formats(tmp_path):
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text("Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n\n"
                                      "Types: deb\nURIs: http://mirror.example/debian-security\n")
    assert apt_mirror(tmp_path) == "http://mirror.example/debian"
    (d / "debian.sources").unlink()
    (tmp_path / "sources.list").write_text("# c\ndeb [arch=amd64] http://old.example/debian bookworm main\n")
    assert apt_mirror(tmp_path) == "http://old.example/debian"
    (tmp_path / "sources.list").unlink()
    assert apt_mirror(tmp_path) == "http://deb.debian.org/debian"


def test_pool_rejects_bad_arguments():
    from agentrl.sandbox.pool import SandboxPool

    for kwargs in [{"size": 0}, {"recycle": "burn"}, {"max_uses": 0}]:
        with pytest.raises(ValueError):
            SandboxPool(factory=lambda: None, **kwargs)
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        SandboxPool(backend="vm")


@pytest.mark.parametrize("code,stdin,exit_code,stdout,stderr_tail", [
    ("print(1)", None, 0, "1\n", ""),
    ("import sys\nprint(sys.argv, __name__)\nprint(input())", b"hey\n", 0, "['-c'] __main__\nhey\n", ""),
    ("raise ValueError('boom')", None, 1, "", 'File "<string>", line 1, in <module>\nValueError: boom\n'),
    ("import sys; sys.exit(3)", None, 3, "", ""),
    ("def f(:\n    pass", None, 1, "", '  File "<string>", line 1\n    def f(:\n          ^\nSyntaxError: invalid syntax\n'),
    ("import sys; sys.exit('msg')", None, 1, "", "msg\n"),
    ("import atexit; atexit.register(lambda: print('bye'))", None, 0, "bye\n", ""),
    ("import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.1), print('thr'))).start()",
     None, 0, "thr\n", ""),
    ("import os; print(os.getcwd(), os.environ['PATH'], sorted(os.listdir('/proc/self/fd'))[:3])", None, 0,
     "/tmp /usr/bin:/bin ['0', '1', '2']\n", ""),
])
def test_forked_python_behaves_like_python_c(local_executor, code, stdin, exit_code, stdout, stderr_tail):
    r = local_executor.run(["python3", "-c", "<forked>"], timeout=10, stdin=stdin, env={"PATH": "/usr/bin:/bin"},
                           cwd="/tmp", limit=65536, python_code=code)
    assert (r.exit_code, r.stdout) == (exit_code, stdout), r
    assert r.stderr.endswith(stderr_tail) and ("_child_python" not in r.stderr), r.stderr


def test_forked_python_timeout_and_cap(local_executor):
    r = local_executor.run(["python3"], timeout=0.5, stdin=None, env={}, cwd="/tmp", limit=10,
                           python_code="print('x' * 100, flush=True)\nwhile True: pass")
    assert r.timed_out and r.exit_code == 137 and r.truncated and r.stdout == "x" * 10


def test_async_calls_run_in_a_bounded_thread_pool():
    import asyncio
    import threading

    from agentrl.sandbox import blocking

    active, peak, lock = 0, 0, threading.Lock()

    def slow_call():
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.05)
        with lock:
            active -= 1

    async def main():
        await asyncio.gather(*[blocking.run_blocking(slow_call) for _ in range(8)])

    blocking.configure(2)
    try:
        asyncio.run(main())
    finally:
        blocking.configure(32)
    assert peak == 2
    with pytest.raises(ValueError):
        blocking.configure(0)


class _GatedSandbox:
    """A sandbox whose start() waits for ``gate`` (a create the engine is slow to answer)."""

    def __init__(self, gate, fail):
        self.gate, self.fail = gate, fail
        self.started = self.closed = False
        self.alive = True

    def start(self):
        self.gate.wait(10)
        if self.fail():
            raise RuntimeError("Connection aborted")  # as the docker client says while dockerd is down
        self.started = True

    def close(self):
        self.closed = True

    def healthy(self):
        return self.alive


def _pool_whose_replacement_failed():
    """A one-sandbox pool whose sandbox died and whose replacement failed (engine down): a retry is due
    in 1 s. Returns (pool, the sandboxes made, the start gate, the engine's state)."""
    from agentrl.sandbox.pool import SandboxPool

    gate, made, engine_down = threading.Event(), [], {"down": False}
    gate.set()

    def factory():
        made.append(_GatedSandbox(gate, lambda: engine_down["down"]))
        return made[-1]

    pool = SandboxPool(size=1, factory=factory).start()
    sb = pool.acquire(timeout=1)
    sb.alive, engine_down["down"] = False, True
    pool.release(sb)
    assert sb.closed and len(made) == 2 and not made[1].started
    return pool, made, gate, engine_down


def test_pool_close_waits_for_a_sandbox_being_made_and_closes_it():
    """A replacement still being made when the pool closes (the retry after an engine outage) is closed
    before close() returns: nothing outlives the pool -- the dockerd-restart test's leak."""
    pool, made, gate, engine_down = _pool_whose_replacement_failed()
    gate.clear()
    engine_down["down"] = False
    deadline = time.monotonic() + 5
    while len(made) < 3 and time.monotonic() < deadline:  # the retry has begun to make one
        time.sleep(0.01)
    assert len(made) == 3
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # waiting for the sandbox being made
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    assert made[2].started and made[2].closed


def test_pool_close_cancels_a_retry_not_yet_due():
    pool, made, gate, engine_down = _pool_whose_replacement_failed()
    pool.close()
    engine_down["down"] = False
    time.sleep(1.5)  # past the retry's 1 s
    assert len(made) == 2 and all(not s.started or s.closed for s in made)
