"""The grader on real sandboxes: HumanEval canonical solutions pass and broken variants fail; the
known reward-hacking holes (no tests collected, crashed runner, forged report, edited tests, objects
that equal anything, reading the expected values) fail;
hidden tests never enter the agent's sandbox."""

from __future__ import annotations

import os

import pytest

from agentrl.sandbox.grader import Grader
from agentrl.sandbox.humaneval import broken_completion, humaneval_files, load_problems

pytestmark = pytest.mark.timeout(300)

# A fixed CI subset (the full 164 run in `python3 benchmarks/sandbox_bench.py --humaneval` or with
# AGENTRL_HUMANEVAL_FULL=1): it includes checks that call prompt helpers (32 poly, 38 encode_cyclic,
# 50 encode_shift), float tolerance (2, 32), and the first/last problems.
CI_SUBSET = [0, 2, 10, 32, 38, 50, 53, 100, 129, 163]
TESTS = {"test_hidden.py": "import solution\n\ndef test_answer():\n    assert solution.answer() == 42\n"}


@pytest.fixture(scope="module")
def problems():
    return load_problems()


@pytest.fixture
def grader(backend):
    return Grader(backend=backend, timeout=20)


def _humaneval_items(problems, ids):
    tasks = [problems[f"HumanEval/{i}"] for i in ids]
    good = [humaneval_files(p, p["canonical_solution"]) for p in tasks]
    bad = [humaneval_files(p, broken_completion(p)) for p in tasks]
    return tasks, good, bad


def _check_humaneval(grader, problems, ids):
    tasks, good, bad = _humaneval_items(problems, ids)
    verdicts = grader.grade_many(good + bad, concurrency=2)
    for task, v in zip(tasks, verdicts[:len(tasks)], strict=True):
        assert v.passed, (task["task_id"], v.reason, v.failures, v.exec_result)
    for task, v in zip(tasks, verdicts[len(tasks):], strict=True):
        assert not v.passed and v.reason == "1 of 1 tests failed", (task["task_id"], v.reason)


def test_humaneval_subset_canonical_pass_broken_fail(grader, problems):
    _check_humaneval(grader, problems, CI_SUBSET)


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.skipif(not os.environ.get("AGENTRL_HUMANEVAL_FULL"), reason="set AGENTRL_HUMANEVAL_FULL=1 (~5 min)")
def test_humaneval_all_164(problems):
    _check_humaneval(Grader(backend="docker", timeout=30), problems, range(164))


def test_correct_solution_passes(grader):
    v = grader.grade({"solution.py": "def answer():\n    return 42\n"}, TESTS)
    assert v.passed and v.reward == 1.0 and (v.collected, v.passed_tests, v.expected) == (1, 1, 1)


# Solutions that try to be rewarded without solving: each must fail, for the reason given. The ones
# after "syntax error" worked against a runner that ran the tests in the solution's process with the
# tests on a mounted file (an always-equal object, the nonce read from the runner's frames, the hidden
# tests read off /grader); the /proc ones try the runner's own descriptors and memory.
_FORGE_FROM_FRAMES = (
    "import json, os, sys\n"
    "f = sys._getframe()\n"
    "while f is not None and 'nonce' not in f.f_locals:\n"
    "    f = f.f_back\n"
    "if f is not None:\n"
    "    report = f.f_locals.get('report') or os.fdopen(1, 'w')\n"
    "    report.write('AGENTRL-GRADE %s %s\\n' % (f.f_locals['nonce'], json.dumps("
    "{'collected': 1, 'passed': 1, 'failures': []})))\n"
    "    report.flush()\n"
    "    os._exit(0)\n"
    "def answer():\n    return 0\n")
_PEEK = (  # 42 if the expected value can be read anywhere the sandbox reaches, else 0
    "import glob, os\n"
    "def _found():\n"
    "    ppid = os.getppid()\n"
    "    paths = glob.glob('/grader/**/*', recursive=True) + glob.glob('/tmp/**/*', recursive=True)\n"
    "    paths += [f'/proc/{ppid}/{n}' for n in ('fd/0', 'environ', 'cmdline', 'mem')]\n"
    "    paths += glob.glob(f'/proc/{ppid}/fd/*')\n"
    "    for path in paths:\n"
    "        try:\n"
    "            with open(path, 'rb') as fh:\n"
    "                if b'== 42' in fh.read(1 << 20):\n"
    "                    return True\n"
    "        except Exception:\n"
    "            pass\n"
    "    return False\n"
    "def answer():\n    return 42 if _found() else 0\n")


@pytest.mark.parametrize("name,solution,reason", [
    ("wrong", "def answer():\n    return 41\n", "1 of 1 tests failed"),
    ("os._exit(0) at import", "import os\nos._exit(0)\n", "1 of 1 tests failed"),
    ("sys.exit(0) at import", "import sys\nsys.exit(0)\n", "1 of 1 tests failed"),
    ("forged report", "print('AGENTRL-GRADE 0 {\"collected\": 1, \"passed\": 1, \"failures\": []}')\n"
                      "import os\nos._exit(0)\n", "1 of 1 tests failed"),
    ("exit inside the test", "import sys\ndef answer():\n    sys.exit(0)\n", "1 of 1 tests failed"),
    ("hang", "def answer():\n    while True:\n        pass\n", "timed out"),
    ("syntax error", "def answer(:\n", "1 of 1 tests failed"),
    ("always equal", "class _A:\n    def __eq__(self, other):\n        return True\n"
                     "def answer():\n    return _A()\n", "1 of 1 tests failed"),
    ("int that equals anything", "class _I(int):\n    def __eq__(self, other):\n        return True\n"
                                 "    __hash__ = int.__hash__\n"
                                 "def answer():\n    return _I(0)\n", "1 of 1 tests failed"),
    ("nonce from the runner's frames", _FORGE_FROM_FRAMES, "1 of 1 tests failed"),
    ("expected value read from a file or the runner", _PEEK, "1 of 1 tests failed"),
    ("runner killed", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", "runner crashed"),
    ("builtins replaced", "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
                          "builtins.isinstance = lambda *a: True\ndef answer():\n    return 41\n",
     "1 of 1 tests failed"),
    ("answer too large", "def answer():\n    return 'x' * (8 << 20)\n", "1 of 1 tests failed"),
])
def test_reward_hacks_fail(grader, name, solution, reason):
    v = grader.grade({"solution.py": solution}, TESTS, timeout=3 if name == "hang" else None)
    assert not v.passed and v.reason.startswith(reason), (name, v.reason, v.exec_result)


def test_test_files_without_tests_fail(grader):
    v = grader.grade({"solution.py": "def answer():\n    return 42\n"}, {"test_empty.py": "import solution\n"})
    assert not v.passed and v.reason == "no tests collected"


def test_hidden_tests_are_on_no_file_and_the_runner_is_read_only(grader):
    """The solution looks for every test file it could edit: it finds only the runner, read-only (EROFS);
    the tests never were on a file of the sandbox. What it saw comes back through ``outcome()``."""
    tests = {"test_a.py": "import solution\n\ndef test_a():\n"
                          "    assert solution.outcome() == [['/grader/grade_runner.py', 30]]\n",
             "test_b.py": "def test_b():\n    assert False, 'the solution is wrong'\n"}
    sneaky = ("import glob\n_seen = []\n"
              "for path in sorted(glob.glob('/grader/**', recursive=True) + glob.glob('/work/**', recursive=True)\n"
              "                   + glob.glob('/tmp/**', recursive=True)):\n"
              "    if not path.endswith('.py') or path.endswith('solution.py'):\n        continue\n"
              "    try:\n        open(path, 'w').write('def test_b():\\n    pass\\n')\n"
              "        _seen.append([path, 0])\n"
              "    except OSError as exc:\n        _seen.append([path, exc.errno])\n"
              "def outcome():\n    return _seen\n")
    v = grader.grade({"solution.py": sneaky}, tests)
    assert not v.passed and v.reason == "1 of 2 tests failed", (v.reason, v.failures)
    assert [f.split(":")[0] for f in v.failures] == ["test_b"]


@pytest.mark.parametrize("imported", ["import unittest", "from unittest import TestCase"])
def test_unittest_style_tests(grader, imported):
    base = "unittest.TestCase" if imported == "import unittest" else "TestCase"
    tests = {"test_u.py": f"{imported}\nimport solution\n\nclass TestAnswer({base}):\n"
                          "    def test_value(self):\n        self.assertEqual(solution.answer(), 42)\n"
                          "    def test_type(self):\n        self.assertIsInstance(solution.answer(), int)\n"}
    assert grader.grade({"solution.py": "def answer():\n    return 42\n"}, tests).passed
    v = grader.grade({"solution.py": "def answer():\n    return '42'\n"}, tests)
    assert not v.passed and v.reason == "2 of 2 tests failed"


# A unittest module that passes every test, written by the solution wherever it can write before the test file
# imports unittest (the runner imports it only then).
_PLANT_UNITTEST = (
    "import os, sys\n"
    "FAKE = ('class TestCase:\\n    def __init__(self, name=None): pass\\n    def run(self, result): result.testsRun = 1\\n'\n"
    "        'class TestLoader:\\n    def getTestCaseNames(self, cls): return [n for n in dir(cls) if n.startswith(\"test\")]\\n'\n"
    "        'class TestResult:\\n    failures = errors = []\\n    testsRun = 0\\n    def wasSuccessful(self): return True\\n')\n"
    "for d in {os.getcwd(), '/tmp', *sys.path}:\n"
    "    try:\n"
    "        with open(os.path.join(d or '.', 'unittest.py'), 'w') as f:\n"
    "            f.write(FAKE)\n"
    "    except OSError:\n"
    "        pass\n"
    "def answer():\n    return '42'\n")


def test_a_unittest_module_planted_by_the_solution_is_never_imported(grader):
    tests = {"test_u.py": "import unittest\nimport solution\n\nclass TestAnswer(unittest.TestCase):\n"
                          "    def test_value(self):\n        self.assertEqual(solution.answer(), 42)\n"}
    v = grader.grade({"solution.py": _PLANT_UNITTEST}, tests)
    assert not v.passed and v.reason == "1 of 1 tests failed", (v.reason, v.exec_result)


def test_grading_from_an_agent_sandbox_uses_a_fresh_one(backend, pools):
    pool = pools(backend)
    grader = Grader(backend=backend, timeout=20)
    with pool.session() as agent:
        agent.write_files({"solution.py": "def answer():\n    return 42\n"})
        agent.exec("echo tampered > /tmp/marker", timeout=10)
        v = grader.grade_from(agent, ["solution.py"], TESTS)
        assert v.passed, v.reason
        # The grading ran elsewhere: no tests or runner ever appear in the agent's sandbox...
        r = agent.exec("ls -A /work; ls /grader 2>&1 || true", timeout=10)
        assert r.stdout.splitlines()[0] == "solution.py" and "grade_runner" not in r.stdout
        assert "No such file" in r.stdout
        # ...and the grading sandbox did not see the agent's /tmp.
        peek = {"solution.py": "import os\ndef answer():\n    return 42 if not os.path.exists('/tmp/marker') else 0\n"}
        assert grader.grade(peek, TESTS).passed
        missing = grader.grade_from(agent, ["nope.py"], TESTS)
        assert not missing.passed and "missing" in missing.reason
