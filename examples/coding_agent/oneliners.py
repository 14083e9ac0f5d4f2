"""One-line Python functions specified by a docstring and an example: a code task family a tiny model can
learn on CPU, graded by hidden tests.

A task is ``def f(<args>):`` with a one-sentence docstring ("Return the odd items of xs.") and one
doctest example; the answer is a one-line body (``return [v for v in xs if v % 2]``). Tasks are drawn
from :data:`OPS` with seeded argument names, constants and inputs; the hidden tests are
:data:`HIDDEN_CASES` more inputs whose expected values the reference body computes on the host (the
reference is our own template, never model code).

Difficulty knob ``level``: 1 = single operations; 2 = also two operations chained ("Return the odd
items of xs, reversed." -> ``return [v for v in xs if v % 2][::-1]``). Held-out tasks are whole
specs (operation, argument names, constant) that training never draws, by a fixed hash split.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

SPLITS = ("train", "heldout", "warmup")
HELD_OUT_PERCENT = 15
WARMUP_PERCENT = 50
HIDDEN_CASES = 5
LEVELS = (1, 2)

# One pool of one-letter names for every argument (v and f are taken; i, l, o, e, j left out), each one token
# of the example's tokenizer (tokenizer.py): copying a name from the signature is one skill for every
# operation. With a pool per kind (list names, string names, int names) the tiny model copied list names
# long before the int names of the five int operations (probe, benchmarks/results/coding_agent/).
NAMES = ("a", "b", "c", "d", "g", "h", "k", "m", "n", "p", "q", "r", "s", "t", "u", "w", "x", "y", "z")
LIST_NAMES = STR_NAMES = INT_NAMES = NAMES
STRING_LETTERS = "eijlov"  # the letters of string inputs: none of them a name
# Constants are spelled out in the docstring ("above seven") and written as digits in the body: the number
# word is the only one in the prompt, while a digit would have to be told apart from the example's digits
# (the tiny model copied names long before it copied a digit constant; probe in the results' NOTES).
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclass(frozen=True)
class Op:
    """One operation: the sentence that specifies it and the expression that implements it.

    ``kind`` is the argument type ('list', 'str', 'int' or 'int2': two ints); ``{a}``/``{b}`` are argument
    names, ``{k}`` a constant. ``chain`` marks list -> list operations that level 2 may chain; their
    ``then`` is the clause appended when it comes second and ``post`` its expression with ``{e}`` the
    first one's.
    """

    name: str
    kind: str
    text: str
    expr: str
    k: tuple[int, int] | None = None
    then: str | None = None
    post: str | None = None


OPS: tuple[Op, ...] = (
    Op("reverse", "list", "Return {a} reversed.", "{a}[::-1]", then="reversed", post="{e}[::-1]"),
    Op("first", "list", "Return the first {k} items of {a}.", "{a}[:{k}]", (1, 4),
       then="only the first {k}", post="{e}[:{k}]"),
    Op("last", "list", "Return the last {k} items of {a}.", "{a}[-{k}:]", (1, 4)),
    Op("above", "list", "Return the items of {a} above {k}.", "[v for v in {a} if v > {k}]", (1, 8)),
    Op("below", "list", "Return the items of {a} below {k}.", "[v for v in {a} if v < {k}]", (1, 8)),
    Op("odd", "list", "Return the odd items of {a}.", "[v for v in {a} if v % 2]"),
    Op("even", "list", "Return the even items of {a}.", "[v for v in {a} if v % 2 == 0]"),
    Op("times", "list", "Return each item of {a} times {k}.", "[v * {k} for v in {a}]", (2, 9)),
    Op("plus", "list", "Return each item of {a} plus {k}.", "[v + {k} for v in {a}]", (1, 9)),
    Op("sorted", "list", "Return {a} sorted.", "sorted({a})", then="sorted", post="sorted({e})"),
    Op("sum", "list", "Return the sum of {a}.", "sum({a})"),
    Op("max", "list", "Return the largest item of {a}.", "max({a})"),
    Op("min", "list", "Return the smallest item of {a}.", "min({a})"),
    Op("len", "list", "Return the length of {a}.", "len({a})"),
    Op("count", "list", "Return how often {k} is in {a}.", "{a}.count({k})", (0, 9)),
    Op("upper", "str", "Return {a} in upper case.", "{a}.upper()"),
    Op("repeat", "str", "Return {a} repeated {k} times.", "{a} * {k}", (2, 4)),
    Op("sreverse", "str", "Return {a} reversed.", "{a}[::-1]"),
    Op("prefix", "str", "Return the first {k} letters of {a}.", "{a}[:{k}]", (1, 3)),
    Op("muladd", "int2", "Return {a} times {b} plus {k}.", "{a} * {b} + {k}", (1, 9)),
    Op("add", "int2", "Return {a} plus {b}.", "{a} + {b}"),
    Op("sub", "int2", "Return {a} minus {b}.", "{a} - {b}"),
    Op("larger", "int2", "Return the larger of {a} and {b}.", "max({a}, {b})"),
    Op("mod", "int", "Return {a} modulo {k}.", "{a} % {k}", (2, 9)),
)
OPS_BY_NAME = {op.name: op for op in OPS}
# Level 2 chains a list -> list filter/map (first) with a reshaping step (second).
CHAIN_FIRST = ("above", "below", "odd", "even", "times", "plus")
CHAIN_SECOND = tuple(op.name for op in OPS if op.post)


def _names(kind: str, rng: random.Random) -> tuple[str, ...]:
    if kind == "list":
        return (rng.choice(LIST_NAMES),)
    if kind == "str":
        return (rng.choice(STR_NAMES),)
    return tuple(rng.sample(INT_NAMES, 2 if kind == "int2" else 1))


def _value(kind: str, rng: random.Random) -> tuple[Any, ...]:
    if kind == "list":
        return ([rng.randint(0, 9) for _ in range(rng.randint(3, 6))],)
    if kind == "str":
        return ("".join(rng.choice(STRING_LETTERS) for _ in range(rng.randint(2, 5))),)
    return tuple(rng.randint(0, 20) for _ in range(2 if kind == "int2" else 1))


def _spec(rng: random.Random, level: int) -> dict[str, Any]:
    """A random spec: operation names, argument names and constant(s)."""
    if level >= 2 and rng.random() < 0.5:
        names = [rng.choice(CHAIN_FIRST), rng.choice(CHAIN_SECOND)]
    else:
        names = [rng.choice(OPS).name]
    kind = OPS_BY_NAME[names[0]].kind
    ks = [rng.randint(*OPS_BY_NAME[n].k) if OPS_BY_NAME[n].k else None for n in names]
    return {"ops": names, "args": list(_names(kind, rng)), "ks": ks}


def _word(k: int | None) -> str | None:
    return None if k is None else NUMBER_WORDS[k]


def _render(spec: dict[str, Any]) -> tuple[str, str]:
    """The docstring sentence and the reference expression of a spec."""
    args = spec["args"]
    fields = {"a": args[0], "b": args[1] if len(args) > 1 else ""}
    first = OPS_BY_NAME[spec["ops"][0]]
    text = first.text.format(**fields, k=_word(spec["ks"][0]))
    expr = first.expr.format(**fields, k=spec["ks"][0])
    for name, k in zip(spec["ops"][1:], spec["ks"][1:], strict=True):
        op = OPS_BY_NAME[name]
        text = text[:-1] + ", " + op.then.format(k=_word(k)) + "."
        expr = op.post.format(e=expr, k=k)
    return text, expr


def spec_key(spec: dict[str, Any]) -> str:
    return json.dumps([spec["ops"], spec["args"], spec["ks"]])


def split_of(spec: dict[str, Any]) -> str:
    """'heldout' for a fixed ~15% of specs (by hash), 'warmup' for another ~50% (the supervised warm-up's
    chats), else 'train' (GRPO's tasks: specs the warm-up never showed, so its reward rises only by copying
    names and constants, as held-out needs)."""
    bucket = int.from_bytes(hashlib.sha256(spec_key(spec).encode()).digest()[:4], "big") % 100
    if bucket < HELD_OUT_PERCENT:
        return "heldout"
    return "warmup" if bucket < HELD_OUT_PERCENT + WARMUP_PERCENT else "train"


def reference(spec: dict[str, Any]):
    """The reference function of a spec (our own template code, compiled on the host)."""
    _, expr = _render(spec)
    return eval(compile(f"lambda {', '.join(spec['args'])}: {expr}", "<reference>", "eval"), {})  # noqa: S307


def _call(args: tuple[Any, ...]) -> str:
    return f"f({', '.join(map(repr, args))})"


def _cases(spec: dict[str, Any], rng: random.Random, n: int) -> list[dict[str, str]]:
    """``n`` example calls with distinct inputs and their expected values (reprs)."""
    kind, fn, seen, out = OPS_BY_NAME[spec["ops"][0]].kind, reference(spec), set(), []
    while len(out) < n:
        args = _value(kind, rng)
        call = _call(args)
        if call in seen:
            continue
        seen.add(call)
        out.append({"call": call, "expected": repr(fn(*args))})
    return out


def make_task(seed: int, level: int = 1) -> dict[str, Any]:
    """The task of ``seed``: what the agent may see (prompt, entry point, visible example) and the spec
    the hidden tests are derived from (:func:`hidden_tests`)."""
    rng = random.Random(seed)
    spec = _spec(rng, level)
    text, expr = _render(spec)
    example = _cases(spec, random.Random(f"visible-{seed}"), 1)[0]
    prompt = (f"def f({', '.join(spec['args'])}):\n    \"\"\"{text}\n    >>> {example['call']}\n"
              f"    {example['expected']}\n    \"\"\"\n")
    return {"task_id": f"oneliner/{seed}", "family": "oneliner", "prompt": prompt, "entry_point": "f",
            "examples": [example], "spec": spec, "seed": seed}


def solution_body(task: dict[str, Any]) -> str:
    """The reference one-line body of a task."""
    return "return " + _render(task["spec"])[1]


def hidden_tests(task: dict[str, Any]) -> dict[str, str]:
    """``{"test_solution.py": ...}``: :data:`HIDDEN_CASES` test functions, one per input, none of them
    the visible example."""
    cases = _cases(task["spec"], random.Random(f"hidden-{task['seed']}"), HIDDEN_CASES + 1)
    cases = [c for c in cases if c["call"] != task["examples"][0]["call"]][:HIDDEN_CASES]
    lines = ["from solution import f", ""]
    for i, case in enumerate(cases):
        lines += [f"def test_{i}():", f"    assert {case['call']} == {case['expected']}", ""]
    return {"test_solution.py": "\n".join(lines)}


def make_tasks(n: int, *, seed: int = 0, split: str = "train", level: int = 1) -> list[dict[str, Any]]:
    """``n`` tasks of ``split`` (disjoint specs), the same list for the same arguments."""
    if type(n) is not int or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    rng = random.Random(f"{split}-{seed}-{level}")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < n:
        task_seed = rng.randrange(2**31)
        task = make_task(task_seed, level)
        if split_of(task["spec"]) != split:
            continue
        key = spec_key(task["spec"])
        # Held-out tasks are distinct specs while fresh ones are still found, so that n tasks measure n
        # items, not a few frequent specs many times over.
        if split == "heldout" and key in seen and misses < 10_000:
            misses += 1
            continue
        seen.add(key)
        out.append(task)
    return out
