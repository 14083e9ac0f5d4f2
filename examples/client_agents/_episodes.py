"""What the three client agents of this directory share: the external-agent protocol of ``agentrl train``
(one JSON task per stdin line, one JSON line on stdout when its episode is over) and the task's two tools,
executed by the agent itself. Nothing here imports agentrl: an agent knows the run only through its
environment (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``) and its stdin."""

from __future__ import annotations

import json
import os
import sys
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


def serve(play: Callable[[dict[str, Any]], Any]) -> int:
    """Play one episode per stdin line with ``play(task) -> answer`` and report each on stdout."""
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        try:
            answer = play(task)
            result: dict[str, Any] = {"answer": answer}
        except Exception as err:  # a refused request (e.g. the turn limit) ends the episode, not the agent
            print(f"agent: episode ended by {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            result = {"answer": None, "error": f"{type(err).__name__}: {err}"}
        print(json.dumps({"session_id": task.get("session_id"), **result}), flush=True)
    return 0
