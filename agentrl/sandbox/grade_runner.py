"""The hidden-test runner the grader mounts read-only (stdlib only; runs in the grading sandbox).

Usage inside the sandbox: ``python3 -I grade_runner.py`` with stdin = the nonce line, then one JSON line
``{"tests": {file name: source}}``; cwd = the work dir holding the solution. It runs each top-level
``test*`` function and each ``unittest.TestCase`` test method of every ``test*.py`` file and writes one line
``AGENTRL-GRADE <nonce> {"collected", "passed", "failures"}`` to stdout.

The solution is an adversary, so its code never runs in this process. Before reading stdin the runner
makes itself non-dumpable (no process of the sandbox user can then read its memory or its descriptors
through /proc or ptrace) and forks the *solution process*, which closes every descriptor but its two
pipes, imports ``solution`` and answers calls. The tests run here against a stand-in ``solution`` module
whose functions forward each call there: arguments and results cross as plain data of exact built-in
types (None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset), so an object that
claims to equal anything never arrives, and every comparison is this process's. The tests and the nonce
arrive after the fork, on stdin, and are on no file the sandbox can read: a solution can neither read
what it is compared against nor forge the report. Test output goes to stderr.

What tests can therefore not check: a result that is not plain data (a generator, a custom object: the
call raises TypeError), a change the solution makes to an argument in place (arguments are copies), or the
function object itself (``inspect.signature``). Every HumanEval check and the coding agent's tests only
compare returned values.
"""

import builtins
import contextlib
import ctypes
import json
import os
import sys
import traceback
import types

MARK = "AGENTRL-GRADE"
MAX_LINE = 4 << 20  # bytes of one encoded call result
MAX_DEPTH = 64
_PR_SET_DUMPABLE = 4


def _short(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[:500]


# ---- plain data across the pipe: exact built-in types, tagged where JSON has no type of its own ----------
def _encode(obj, depth=0):
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    kind = type(obj)
    if obj is None or kind is bool or kind is int or kind is str:
        return obj
    if kind is float:
        return {"f": obj.hex()}
    if kind is complex:
        return {"c": [obj.real.hex(), obj.imag.hex()]}
    if kind is bytes:
        return {"b": obj.hex()}
    if kind is list:
        return [_encode(v, depth + 1) for v in obj]
    if kind is tuple:
        return {"t": [_encode(v, depth + 1) for v in obj]}
    if kind is dict:
        return {"d": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in obj.items()]}
    if kind is set or kind is frozenset:
        return {"s" if kind is set else "z": [_encode(v, depth + 1) for v in obj]}
    raise TypeError(f"a {kind.__name__} is not plain data (None, bool, int, float, complex, str, bytes, "
                    "list, tuple, dict, set, frozenset)")


_DECODE = {"f": float.fromhex, "b": bytes.fromhex, "c": lambda v: complex(float.fromhex(v[0]), float.fromhex(v[1]))}
_CONTAINERS = {"t": tuple, "s": set, "z": frozenset}


def _decode(obj, depth=0):
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    kind = type(obj)
    if obj is None or kind is bool or kind is int or kind is str:
        return obj
    if kind is list:
        return [_decode(v, depth + 1) for v in obj]
    if kind is dict and len(obj) == 1:
        (tag, value), = obj.items()
        if tag in _DECODE and type(value) in (str, list):
            return _DECODE[tag](value)
        if tag in _CONTAINERS and type(value) is list:
            return _CONTAINERS[tag](_decode(v, depth + 1) for v in value)
        if tag == "d" and type(value) is list:
            return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in value}
    raise ValueError("malformed data")


# ---- the solution process ------------------------------------------------------------------------------
def _solution_process(calls, results):
    """Import ``solution`` and answer calls; never returns. Runs before this process has read anything."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # the exec's stdin (the tests) and stdout (the report) are out of reach
    os.closerange(3, calls)
    os.closerange(calls + 1, results)
    os.closerange(results + 1, 1 << 16)
    inbox, outbox = os.fdopen(calls, "rb"), os.fdopen(results, "wb")

    def send(message):
        outbox.write(json.dumps(message).encode() + b"\n")
        outbox.flush()

    try:
        sys.path[:0] = [os.getcwd()]
        import solution
        names = {}
        for name in getattr(solution, "__all__", None) or [n for n in vars(solution) if not n.startswith("_")]:
            value = getattr(solution, name)
            if callable(value):
                names[name] = None
            else:
                with contextlib.suppress(Exception):
                    names[name] = {"value": _encode(value)}
        send({"names": names})
    except BaseException as exc:  # noqa: BLE001 - a solution may raise anything, SystemExit included
        with contextlib.suppress(BaseException):
            send({"import_error": _short(exc)})
        os._exit(0)
    for line in inbox:
        try:
            request = json.loads(line)
            result = getattr(solution, request["call"])(*_decode(request["args"]), **_decode(request["kwargs"]))
            answer = {"value": _encode(result)}
        except BaseException as exc:  # noqa: BLE001
            answer = {"raise": "Exception", "message": "the solution's call failed"}
            with contextlib.suppress(BaseException):
                answer = {"raise": type(exc).__name__, "message": str(exc)[:500]}
        try:
            send(answer)
        except BaseException:  # noqa: BLE001
            break
    os._exit(0)


class SolutionProcessError(Exception):
    """The solution process answered nothing usable (it exited, or sent what is not plain data)."""


class _Link:
    def __init__(self, pid, calls, results):
        self.pid = pid
        self._out = os.fdopen(calls, "wb")
        self._in = os.fdopen(results, "rb")
        self.dead = None

    def receive(self):
        if self.dead:
            raise SolutionProcessError(self.dead)
        line = self._in.readline(MAX_LINE + 1)
        if not line.endswith(b"\n"):
            self.dead = "the solution process exited" if not line else "the solution sent too much"
            self.kill()
            raise SolutionProcessError(self.dead)
        message = json.loads(line)
        if type(message) is not dict:
            raise SolutionProcessError("the solution process sent a malformed answer")
        return message

    def call(self, name, args, kwargs):
        if self.dead:
            raise SolutionProcessError(self.dead)
        try:
            self._out.write(json.dumps({"call": name, "args": _encode(list(args)), "kwargs": _encode(kwargs)}).encode()
                            + b"\n")
            self._out.flush()
        except BrokenPipeError:
            self.dead = "the solution process exited"
            raise SolutionProcessError(self.dead) from None
        answer = self.receive()
        if "value" in answer:
            try:
                return _decode(answer["value"])
            except (ValueError, TypeError, RecursionError):
                raise SolutionProcessError("the solution process sent what is not plain data") from None
        kind = getattr(builtins, str(answer.get("raise")), None)
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            kind = SolutionProcessError
        raise kind(str(answer.get("message", ""))[:500])

    def kill(self):
        with contextlib.suppress(OSError):
            os.kill(self.pid, 9)


class _Remote:
    """A function of the solution, called in the solution process."""

    def __init__(self, link, name):
        self._link, self.__name__ = link, name

    def __call__(self, *args, **kwargs):
        return self._link.call(self.__name__, args, kwargs)

    def __repr__(self):
        return f"<solution.{self.__name__}>"


def _stand_in(link):
    """The ``solution`` module the tests import: the solution's names, its functions as :class:`_Remote`."""
    module = types.ModuleType("solution")
    try:
        hello = link.receive()
    except Exception as exc:  # noqa: BLE001 - it exited at import, or sent what is not JSON
        hello = {"import_error": _short(exc)}
    if "import_error" in hello or type(hello.get("names")) is not dict:
        reason = str(hello.get("import_error", "no names"))[:500]

        def missing(name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise ImportError(f"the solution failed to import: {reason}")
    else:
        names = hello["names"]
        for name, plain in names.items():
            if type(name) is not str or name.startswith("__"):
                continue
            if plain is None:
                setattr(module, name, _Remote(link, name))
            else:
                with contextlib.suppress(Exception):
                    setattr(module, name, _decode(plain["value"]))
        module.__all__ = [n for n in names if type(n) is str and hasattr(module, n)]

        def missing(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Remote(link, name)  # a name it did not list: the call says whether it exists
    module.__getattr__ = missing
    return module


# ---- the tests -------------------------------------------------------------------------------------------
def _run_module(fname, source, failures):
    collected = passed = 0
    name = "agentrl_hidden_" + fname[:-3]
    module = types.ModuleType(name)
    module.__file__ = fname
    sys.modules[name] = module
    try:
        exec(compile(source, fname, "exec"), module.__dict__)
    except BaseException as exc:  # noqa: BLE001
        failures.append(f"{fname}: import failed: {_short(exc)}")
        return collected, passed
    # unittest only where a test file imported it: importing inspect and unittest up front took ~11 of the
    # ~37 ms of a grade's runner. A TestCase class exists only if its file imported unittest.
    unittest = sys.modules.get("unittest")
    for attr, obj in list(vars(module).items()):
        if getattr(obj, "__module__", None) != name:
            continue
        if attr.startswith("test") and isinstance(obj, types.FunctionType):
            collected += 1
            try:
                obj()
                passed += 1
            except BaseException as exc:  # noqa: BLE001
                failures.append(f"{attr}: {_short(exc)}")
        elif unittest is not None and isinstance(obj, type) and issubclass(obj, unittest.TestCase):
            for method in unittest.TestLoader().getTestCaseNames(obj):
                collected += 1
                result = unittest.TestResult()
                try:
                    obj(method).run(result)
                except BaseException as exc:  # noqa: BLE001
                    failures.append(f"{attr}.{method}: {_short(exc)}")
                    continue
                if result.wasSuccessful() and result.testsRun == 1:
                    passed += 1
                else:
                    bad = result.failures + result.errors
                    failures.append(f"{attr}.{method}: {bad[0][1].strip().splitlines()[-1] if bad else 'not run'}")
    return collected, passed


def main():
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SystemExit("could not make the runner non-dumpable")
    calls_r, calls_w = os.pipe()
    results_r, results_w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(calls_w)
            os.close(results_r)
            _solution_process(calls_r, results_w)
        finally:
            os._exit(0)
    os.close(calls_r)
    os.close(results_w)
    nonce = sys.stdin.readline().strip()
    tests = json.loads(sys.stdin.readline())["tests"]
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    link = _Link(pid, calls_w, results_r)
    sys.modules["solution"] = _stand_in(link)
    collected = passed = 0
    failures = []
    for fname in sorted(tests):
        if fname.startswith("test") and fname.endswith(".py"):
            c, p = _run_module(fname, tests[fname], failures)
            collected += c
            passed += p
    link.kill()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    report.write(f"{MARK} {nonce} " + json.dumps(
        {"collected": collected, "passed": passed, "failures": failures[:50]}) + "\n")
    report.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
