"""The hidden-test runner the grader mounts read-only next to the tests (stdlib only; runs in the sandbox).

Usage inside the sandbox: ``python3 grade_runner.py TESTS_DIR`` with the nonce on stdin, cwd = the
work dir holding the solution. It imports every ``test*.py`` in TESTS_DIR, runs each top-level
``test*`` function and each ``unittest.TestCase`` test method, and writes one line
``AGENTRL-GRADE <nonce> {"collected", "passed", "failures"}`` to the original stdout. Test output goes
to stderr so it cannot push the report past the output cap. Everything the runner needs is imported
before the solution directory joins ``sys.path``, so a solution cannot shadow it.
"""

import contextlib
import importlib.util
import inspect
import json
import os
import sys
import traceback
import unittest

MARK = "AGENTRL-GRADE"


def _short(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[:500]


def _run_module(path, failures):
    collected = passed = 0
    name = "agentrl_hidden_" + os.path.basename(path)[:-3]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - a solution may raise anything, SystemExit included
        failures.append(f"{os.path.basename(path)}: import failed: {_short(exc)}")
        return collected, passed
    for attr, obj in list(vars(module).items()):
        if getattr(obj, "__module__", None) != name:
            continue
        if attr.startswith("test") and inspect.isfunction(obj):
            collected += 1
            try:
                obj()
                passed += 1
            except BaseException as exc:  # noqa: BLE001
                failures.append(f"{attr}: {_short(exc)}")
        elif inspect.isclass(obj) and issubclass(obj, unittest.TestCase):
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
    nonce = sys.stdin.readline().strip()
    tests_dir = sys.argv[1]
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.path[:0] = [os.getcwd()]
    collected = passed = 0
    failures = []
    for fname in sorted(os.listdir(tests_dir)):
        if fname.startswith("test") and fname.endswith(".py"):
            c, p = _run_module(os.path.join(tests_dir, fname), failures)
            collected += c
            passed += p
    for stream in (sys.stdout, sys.stderr):  # test output first: os._exit below skips the flush
        with contextlib.suppress(Exception):  # a solution may have replaced or closed them
            stream.flush()
    report.write(f"{MARK} {nonce} " + json.dumps(
        {"collected": collected, "passed": passed, "failures": failures[:50]}) + "\n")
    report.flush()
    os._exit(0)  # skip atexit hooks a solution may have registered


if __name__ == "__main__":
    main()
