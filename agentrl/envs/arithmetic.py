"""Two-digit addition with tools: the environment of the CPU end-to-end demo.

``ArithmeticEnv``: "What is a+b?" (a, b in 10..99); the model answers with the ``submit`` tool;
reward 1 for the right sum, else 0. ``ArithmeticToolEnv``: the multi-turn variant, where ``submit``
is accepted only after the model called ``add`` (reward 0 otherwise). Prompts are short because the
tiny model has 512 positions.

Tasks are deterministic: the 8100 (a, b) pairs are split once into train and held-out by a fixed
permutation (:data:`SPLIT_SEED`), and :func:`make_tasks` draws from a split with its own seed.
:func:`expert_messages` gives the scripted correct chat of a task for supervised warm-up.
"""

from __future__ import annotations

import random
from functools import cache
from typing import Any

from agentrl.envs.environment import Environment
from agentrl.envs.formats import HermesFormat, ToolCall, ToolCallFormat
from agentrl.envs.tools import tool

LOW, HIGH = 10, 99
SPLIT_SEED = 20261129
HELD_OUT_FRACTION = 0.1
SYSTEM_PROMPT = "Answer with a tool call."


@cache
def _split(name: str) -> tuple[tuple[int, int], ...]:
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    cut = int(len(pairs) * HELD_OUT_FRACTION)
    return tuple(pairs[:cut]) if name == "heldout" else tuple(pairs[cut:])


def make_tasks(n: int, *, seed: int = 0, split: str = "train", multi_turn: bool = False) -> list[dict[str, Any]]:
    """``n`` tasks ``{"a", "b", "answer", "multi_turn"}`` drawn (with replacement) from ``split``
    (``"train"`` or ``"heldout"``, disjoint) — the same list for the same arguments."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    pairs = _split(split)
    rng = random.Random(seed)
    return [
        {"a": a, "b": b, "answer": a + b, "multi_turn": multi_turn}
        for a, b in (pairs[rng.randrange(len(pairs))] for _ in range(n))
    ]


def question(task: dict[str, Any]) -> str:
    return f"What is {task['a']}+{task['b']}?"


class ArithmeticEnv(Environment):
    """Single turn: submit the sum."""

    max_turns = 3
    task_fields = ("a", "b", "answer")

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.submitted: int | None = None
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question(task)}]

    @tool
    def submit(self, answer: int) -> str:
        """Submit the final answer.

        Args:
            answer: the sum.
        """
        self.submitted = answer
        self.done = True
        return "ok"

    def reward(self) -> float:
        return float(self.submitted is not None and self.submitted == self.task["answer"])


class ArithmeticToolEnv(ArithmeticEnv):
    """Multi-turn: call ``add`` first, then ``submit``; a submit without a prior ``add`` scores 0."""

    max_turns = 4

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.used_add = False
        return super().reset(task)

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: first number.
            b: second number.
        """
        self.used_add = True
        return a + b

    def reward(self) -> float:
        return super().reward() if self.used_add else 0.0


def expert_messages(task: dict[str, Any], *, tool_format: ToolCallFormat | None = None) -> list[dict[str, Any]]:
    """The scripted correct chat of ``task``: initial messages, then the assistant replies (raw text,
    as a perfect policy would sample them) and the tool results between them, ending with the final
    ``submit`` reply."""
    fmt = tool_format or HermesFormat()
    env = ArithmeticToolEnv() if task.get("multi_turn") else ArithmeticEnv()
    messages = env.reset(task)
    if task.get("multi_turn"):
        add = ToolCall("add", {"a": task["a"], "b": task["b"]})
        messages += [{"role": "assistant", "content": fmt.render_calls([add])},
                     {"role": "tool", "name": "add", "content": str(task["a"] + task["b"])}]
    submit = ToolCall("submit", {"answer": task["answer"]})
    messages.append({"role": "assistant", "content": fmt.render_calls([submit])})
    return messages
