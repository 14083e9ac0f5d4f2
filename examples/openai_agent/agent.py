#!/usr/bin/env python3
"""An agent for the arithmetic tool task, written against the official ``openai`` client only.

It knows nothing of agentrl: it reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` like any OpenAI program,
declares its own tools and system prompt, and executes the tools itself (``add`` computes the sum,
``submit`` records the answer). ``agentrl train`` with an ``external_agent`` section runs copies of it;
the protocol it follows is the smallest an agent can follow:

* stdin: one JSON object per line, one episode each; it reads ``prompt`` (the question) and, with
  ``--session-id-in user|header``, ``session_id``;
* stdout: one JSON line when the episode is over (logs go to stderr).

With ``--reward-self`` it also scores its own answer and sends it as the finish call
(``POST $AGENTRL_FINISH_URL {"reward": r}``), for runs with ``reward_from: finish_call``.

    printf '{"prompt": "What is 12+30?"}\\n' | OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python agent.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.request
from typing import Any

import openai

# The task's chat as the model was warmed up on it: the same system prompt and tool schemas (same key
# order, since the chat template writes the schemas into the prompt as JSON).
SYSTEM_PROMPT = "Answer with a tool call."
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "submit", "description": "Submit the final answer.",
        "parameters": {"properties": {"answer": {"description": "the sum.", "type": "integer"}},
                       "required": ["answer"], "type": "object"}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"properties": {"a": {"description": "first number.", "type": "integer"},
                                      "b": {"description": "second number.", "type": "integer"}},
                       "required": ["a", "b"], "type": "object"}}},
]
MAX_TURNS = 4


def run_tool(name: str, arguments: str) -> tuple[str, Any]:
    """The tool's result text, and the submitted answer (``None`` unless ``submit`` ran)."""
    try:
        args = json.loads(arguments)
        if name == "add":
            return str(int(args["a"]) + int(args["b"])), None
        if name == "submit":
            return "ok", args["answer"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        return f"Error: bad arguments for {name}: {err}", None
    return f"Error: unknown tool {name!r}", None


def play(client: openai.OpenAI, task: dict[str, Any], *, model: str, session_id_in: str) -> dict[str, Any]:
    """One episode: ask, run the tools the model calls, until it submits (or MAX_TURNS replies)."""
    extra: dict[str, Any] = {}
    if session_id_in == "user":
        extra["user"] = task["session_id"]
    elif session_id_in == "header":
        extra["extra_headers"] = {"X-Session-Id": task["session_id"]}
    messages: list[Any] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["prompt"]}]
    answer = None
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, **extra)
        except openai.APIError as err:  # e.g. the server's turn limit: end the episode, keep the agent
            print(f"agent: request refused: {err}", file=sys.stderr, flush=True)
            return {"answer": answer, "error": str(err)}
        message = reply.choices[0].message
        messages.append(message)  # echoed as returned
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result, submitted = run_tool(call.function.name, call.function.arguments)
            answer = submitted if submitted is not None else answer
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
        if answer is not None:
            break
    return {"answer": answer}


def own_reward(prompt: str, answer: Any) -> float:
    """1 for the right sum of the question's two numbers, else 0 (the agent's own judgement)."""
    numbers = [int(n) for n in re.findall(r"\d+", prompt)]
    return float(len(numbers) == 2 and answer == sum(numbers))


def send_finish(reward: float) -> None:
    request = urllib.request.Request(
        os.environ["AGENTRL_FINISH_URL"], data=json.dumps({"reward": reward}).encode(), method="POST",
        headers={"content-type": "application/json", "authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=30):
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--session-id-in", choices=["none", "user", "header"], default="none",
                        help="send the task's session_id as the request's user field or X-Session-Id header "
                             "(default: none; the base URL names the episode)")
    parser.add_argument("--reward-self", action="store_true", help="score the answer and send it as the finish call")
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "agentrl"))
    args = parser.parse_args()
    client = openai.OpenAI(timeout=120.0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        result = play(client, task, model=args.model, session_id_in=args.session_id_in)
        if args.reward_self:
            send_finish(own_reward(task["prompt"], result["answer"]))
        print(json.dumps({"session_id": task.get("session_id"), **result}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
