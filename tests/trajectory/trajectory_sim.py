"""Hypothesis-driven chat sessions with token-level drift, rewinds and branches (test helper).

A toy "template" renders each message to a token list; an assistant message renders as
``[GEN] + its output ids``, and a prompt is the rendered history plus ``[GEN]``, so a session that
never drifts extends exactly. Drift re-writes the stored rendering of one message (latest response,
an earlier response, or a context message) from some position on — as a re-tokenization would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from agentrl.trajectory import TrajectoryManager, TurnRecord

GEN = 1  # the generation-prompt token ("<|im_start|>assistant\n")
TOKENS = st.integers(min_value=2, max_value=40)

settings.register_profile(
    "trajectory",
    max_examples=int(os.environ.get("AGENTRL_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SETTINGS = settings.get_profile("trajectory")


@dataclass
class Session:
    turns: list[TurnRecord] = field(default_factory=list)
    drifted: bool = False  # a rendering was rewritten (may or may not change tokens)
    branched: bool = False  # a prompt rewound or branched the message history


class _Renderer:
    def __init__(self) -> None:
        self.rendering: dict[int, list[int]] = {}  # id(message) -> tokens
        self.keep: list[dict] = []  # keeps messages alive so ids stay unique

    def add(self, message: dict, tokens: list[int]) -> dict:
        self.keep.append(message)
        self.rendering[id(message)] = tokens
        return message

    def prompt(self, history: list[dict]) -> list[int]:
        out: list[int] = []
        for m in history:
            out += self.rendering[id(m)]
        return [*out, GEN]


def simulate(
    data: st.DataObject,
    manager: TrajectoryManager,
    session_id: str = "s",
    *,
    allow_drift: bool = True,
    allow_branch: bool = True,
    max_turns: int = 8,
) -> Session:
    """Draw and record one session into ``manager``; return its turn records and what was injected."""
    r = _Renderer()
    session = Session()
    history = [
        r.add(
            {"role": "system", "content": "sys"},
            data.draw(st.lists(TOKENS, min_size=1, max_size=4), label="system"),
        ),
        r.add(
            {"role": "user", "content": "task"},
            data.draw(st.lists(TOKENS, min_size=0, max_size=4), label="user"),
        ),
    ]
    n_turns = data.draw(st.integers(1, max_turns), label="turns")
    for t in range(n_turns):
        if t > 0 and allow_branch and data.draw(st.integers(0, 5), label="branch?") == 0:
            cut = data.draw(st.integers(1, len(history)), label="branch at")
            history = history[:cut]
            session.branched = True
        if t > 0 and allow_drift and data.draw(st.integers(0, 2), label="drift?") == 0:
            _drift(data, r, history)
            session.drifted = True
        prompt = r.prompt(history)
        output = data.draw(st.lists(TOKENS, min_size=0, max_size=6), label="output")
        with_logprobs = data.draw(st.integers(0, 4), label="logprobs?") > 0
        logprobs = [-(0.01 + ((t * 7 + j * 3) % 11) / 4) for j in range(len(output))] if with_logprobs else []
        finish = data.draw(st.sampled_from(["stop", "stop", "length", "abort"]), label="finish")
        version, spans = f"v{t // 3}", None
        if len(output) >= 2 and data.draw(st.integers(0, 3), label="resumed?") == 0:
            # continued across a weight update (partial_rollout: resume): the tail drawn by the next version
            cut = data.draw(st.integers(1, len(output) - 1), label="update at")
            spans, version = [[0, version], [cut, f"v{t // 3 + 1}"]], f"v{t // 3 + 1}"
        record = TurnRecord(prompt, output, logprobs, finish, weight_version=version, weight_version_spans=spans)
        content = data.draw(st.sampled_from([f"a{t}", f"a{t}", "same"]), label="content")
        response = {"role": "assistant", "content": content}
        if data.draw(st.booleans(), label="tool?"):
            response["tool_calls"] = [{"name": "calc", "arguments": {"x": t}}]
        manager.record_turn(session_id, turn=record, prompt_messages=list(history), response_message=response)
        session.turns.append(record)
        history = [*history, r.add(response, [GEN, *output])]
        context = data.draw(st.lists(TOKENS, min_size=0, max_size=4), label="context")
        history.append(r.add({"role": "tool", "content": f"r{t}"}, context))
    return session


def _drift(data: st.DataObject, r: _Renderer, history: list[dict]) -> None:
    assistants = [i for i, m in enumerate(history) if m["role"] == "assistant"]
    where = data.draw(st.sampled_from(["latest", "earlier", "context"]), label="drift where")
    if where == "latest" and assistants:
        index = assistants[-1]
    elif where == "earlier" and len(assistants) > 1:
        index = data.draw(st.sampled_from(assistants[:-1]), label="earlier response")
    else:
        index = data.draw(st.integers(0, len(history) - 1), label="context message")
    tokens = r.rendering[id(history[index])]
    at = data.draw(st.integers(0, len(tokens)), label="drift at")
    tail = data.draw(st.lists(TOKENS, min_size=0, max_size=5), label="re-tokenized tail")
    r.rendering[id(history[index])] = tokens[:at] + tail
