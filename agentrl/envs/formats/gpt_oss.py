"""gpt-oss (harmony) replies: a sequence of messages, each ``<|start|>ROLE HEADER<|message|>BODY<|end|>``
(the first one's ``<|start|>assistant`` is the generation prompt). The header names a ``<|channel|>``
(``analysis`` is reasoning, ``final`` and ``commentary`` are text for the user) and, for a tool call, a
recipient ``to=functions.NAME`` with ``<|constrain|>json`` or `` json``; a call ends with ``<|call|>``::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The chat template writes the recipient before the channel (``<|start|>assistant to=functions.NAME<|channel|>
commentary json<|message|>``); both orders are read.
"""

from __future__ import annotations

import re

from agentrl.envs.formats.base import ParsedResponse, ToolCall, call_with_json_arguments, dump_json, snippet

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>")


class GptOssFormat:
    """gpt-oss harmony: calls are ``to=functions.NAME`` messages; the ``analysis`` channel is reasoning."""

    name = "gpt_oss"
    _marker = re.compile(r"\bto=functions\.|<\|call\|>|<\|constrain\|>")

    def parse(self, text: str) -> ParsedResponse:
        if MESSAGE not in text and CHANNEL not in text:
            return ParsedResponse(content=text.strip())
        calls: list[ToolCall] = []
        errors: list[str] = []
        content: list[str] = []
        reasoning: list[str] = []
        pos = 0
        while pos < len(text):
            if text.startswith(START, pos):
                pos += len(START)
            body_at = text.find(MESSAGE, pos)
            if body_at == -1:
                rest = text[pos:].strip()
                if rest:
                    errors.append(f"harmony message header without {MESSAGE}: {snippet(rest)}")
                break
            header = text[pos:body_at]
            if START in header or any(end in header for end in ENDS):
                errors.append(f"harmony message header without {MESSAGE}: {snippet(header)}")
                pos = text.find(START, pos) if START in header else pos + len(header)
                continue
            body_start = body_at + len(MESSAGE)
            end = _END.search(text, body_start)
            body = text[body_start:end.start() if end else len(text)]
            pos = len(text) if end is None else end.end() if end.group() != START else end.start()
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient:
                target = recipient.group(1)
                name = target.removeprefix("functions.")
                result = call_with_json_arguments(name, body.strip(), raw=header + MESSAGE + body)
                (errors if isinstance(result, str) else calls).append(result)
            elif channel and channel.group(1) == "analysis":
                reasoning.append(body.strip())
            elif channel is None and header.strip() not in ("", "assistant"):
                errors.append(f"harmony message needs {CHANNEL}analysis, commentary or final: {snippet(header)}")
            else:
                content.append(body.strip())
        return ParsedResponse(content="\n".join(c for c in content if c), calls=calls, errors=errors,
                              reasoning="\n".join(r for r in reasoning if r))

    def render_calls(self, calls: list[ToolCall]) -> str:
        # As the template writes a tool-call turn (one call per assistant message), the first message's
        # "<|start|>assistant" already in the prompt and the last "<|call|>" the stop token the engine drops.
        return "<|call|><|start|>assistant".join(
            f" to=functions.{c.name}<|channel|>commentary json<|message|>{dump_json(c.arguments)}" for c in calls
        )

    def looks_like_call(self, text: str) -> bool:
        return bool(self._marker.search(text))
