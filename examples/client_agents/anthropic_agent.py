#!/usr/bin/env python3
"""The arithmetic task played through the ``anthropic`` SDK's Messages API (``client.messages.create``,
``tool_use`` / ``tool_result`` blocks), the agent's own loop and tools; it never imports agentrl.

Its base URL is ``ANTHROPIC_BASE_URL``, else the run's ``OPENAI_BASE_URL`` without ``/v1``; its key
``ANTHROPIC_API_KEY``, else ``OPENAI_API_KEY`` (sent as ``x-api-key``, which the gateway accepts).

    printf '{"prompt": "What is 12+30?"}\\n' | ANTHROPIC_BASE_URL=http://127.0.0.1:8000 python anthropic_agent.py
"""

from __future__ import annotations

import os
from typing import Any

import anthropic
from _episodes import MAX_TURNS, SYSTEM_PROMPT, add, anthropic_base_url, serve

TOOLS = [
    {"name": "submit", "description": "Submit the final answer.",
     "input_schema": {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}},
    {"name": "add", "description": "Add two numbers.",
     "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}},
]


def run_tool(name: str, args: dict[str, Any]) -> tuple[str, Any]:
    """The tool's result text and the submitted answer (None unless ``submit`` ran)."""
    try:
        if name == "add":
            return str(add(args["a"], args["b"])), None
        if name == "submit":
            return "ok", args["answer"]
    except (KeyError, TypeError, ValueError) as err:
        return f"Error: bad arguments for {name}: {err}", None
    return f"Error: unknown tool {name!r}", None


def play(client: anthropic.Anthropic, task: dict[str, Any]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    answer, used_add = None, False
    for _ in range(MAX_TURNS):
        reply = client.messages.create(model=os.environ.get("ANTHROPIC_MODEL", "agentrl"), max_tokens=64,
                                       system=SYSTEM_PROMPT, tools=TOOLS, messages=messages)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        results = []
        for use in uses:
            text, submitted = run_tool(use.name, dict(use.input))
            answer = submitted if submitted is not None else answer
            used_add = used_add or (use.name == "add" and not text.startswith("Error"))
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": text})
        messages.append({"role": "user", "content": results})
        if answer is not None:
            break
    return {"answer": answer, "used_add": used_add}


if __name__ == "__main__":
    api_key = os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("OPENAI_API_KEY", "unused")
    client = anthropic.Anthropic(base_url=anthropic_base_url(), api_key=api_key, timeout=120.0)
    raise SystemExit(serve(lambda task: play(client, task)))
