#!/usr/bin/env python3
"""The arithmetic task played by an OpenAI Agents SDK agent with the SDK's default model (the Responses
API, ``OpenAIResponsesModel`` over ``AsyncOpenAI()`` reading ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``).

The SDK runs the loop and the tools (``add`` computes, ``submit`` ends the run: ``StopAtTools``); the
agent never imports agentrl. ``agentrl train`` with ``external_agent.command: python
examples/client_agents/agents_sdk_agent.py`` trains on its sessions (see benchmarks/client_curves.py).

    printf '{"prompt": "What is 12+30?"}\\n' | OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python agents_sdk_agent.py
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import agents
from _episodes import MAX_TURNS, SYSTEM_PROMPT, serve
from _episodes import add as add_numbers

agents.set_tracing_disabled(True)  # no trace export: the run's machine may have no route out


def build_agent() -> tuple[agents.Agent, dict[str, Any]]:
    submitted: dict[str, Any] = {}

    @agents.function_tool
    def submit(answer: int) -> str:
        """Submit the final answer."""
        submitted["answer"] = answer
        return "ok"

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        total = add_numbers(a, b)
        submitted["used_add"] = True
        return total

    agent = agents.Agent(name="adder", instructions=SYSTEM_PROMPT, tools=[submit, add],
                         model=os.environ.get("OPENAI_MODEL", "agentrl"),  # a name: the default (Responses) model
                         tool_use_behavior=agents.StopAtTools(stop_at_tool_names=["submit"]))
    return agent, submitted


def play(task: dict[str, Any]) -> dict[str, Any]:
    agent, submitted = build_agent()
    # MaxTurnsExceeded: the model kept calling tools; the episode is over, scored by what it did
    with contextlib.suppress(agents.MaxTurnsExceeded):
        agents.Runner.run_sync(agent, task["prompt"], max_turns=MAX_TURNS)
    return {"answer": submitted.get("answer"), "used_add": submitted.get("used_add", False)}


if __name__ == "__main__":
    raise SystemExit(serve(play))
