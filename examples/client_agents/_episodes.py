"""What the three client agents of this directory share: the external-agent protocol of ``agentrl train``
(one JSON task per stdin line, one JSON line on stdout when its episode is over) and the task's two tools,
executed by the agent itself. Nothing here imports agentrl: an agent knows the run only through its
environment (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``) and its stdin."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

# The task's chat as the model was warmed up on it: this system prompt, and the tools `submit(answer)` and
# `add(a, b)` in that order (the tiny model's chat template shows each tool as its name and parameter names).
SYSTEM_PROMPT = "Answer with a tool call."
MAX_TURNS = 4


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return int(a) + int(b)


def anthropic_base_url() -> str:
    """The ``anthropic`` client's base URL: ``ANTHROPIC_BASE_URL``, else the run's ``OPENAI_BASE_URL``
    without its ``/v1`` (the Anthropic client appends ``/v1/messages`` itself)."""
    return os.environ.get("ANTHROPIC_BASE_URL") or os.environ["OPENAI_BASE_URL"].removesuffix("/").removesuffix("/v1")


def own_reward(prompt: str, outcome: dict[str, Any]) -> float:
    """The environment's rule, as the agent sees its own episode: 1 for the right sum submitted after a
    successful ``add`` call, else 0 (logged only; with ``reward_from: env`` the run scores the episode)."""
    numbers = [int(n) for n in re.findall(r"\d+", prompt)]
    return float(bool(outcome.get("used_add")) and len(numbers) == 2 and outcome.get("answer") == sum(numbers))


def serve(play: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """Play one episode per stdin line with ``play(task) -> {"answer", "used_add"}`` and report each on
    stdout; stderr (the agent's log) gets one JSON line per episode: its session, own reward and end time."""
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        try:
            result: dict[str, Any] = play(task)
        except Exception as err:  # a refused request (e.g. the turn limit) ends the episode, not the agent
            print(f"agent: episode ended by {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            result = {"answer": None, "error": f"{type(err).__name__}: {err}"}
        reward = own_reward(task.get("prompt", ""), result)
        print(json.dumps({"episode": task.get("session_id"), "own_reward": reward, "t": round(time.time(), 3)}),
              file=sys.stderr, flush=True)
        print(json.dumps({"session_id": task.get("session_id"), **result}), flush=True)
    return 0
