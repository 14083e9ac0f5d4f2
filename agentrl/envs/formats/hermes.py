"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number."""

from __future__ import annotations

import re

from agentrl.envs.formats.base import ParsedResponse, ToolCall, call_from_json, dump_json


def split_tagged(text: str, open_tag: str, close_tag: str) -> tuple[list[str], list[str], list[str]]:
    """(free-text parts, bodies between the tags, errors) of ``text``; a stray close tag and an
    unterminated open tag are errors (the rest of the text after an unterminated tag is dropped)."""
    content_parts: list[str] = []
    bodies: list[str] = []
    errors: list[str] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        stray_close = text.find(close_tag, pos)
        if stray_close != -1 and (start == -1 or stray_close < start):
            errors.append(f"{close_tag} without a matching {open_tag}")
            content_parts.append(text[pos:stray_close])
            pos = stray_close + len(close_tag)
            continue
        if start == -1:
            content_parts.append(text[pos:])
            break
        content_parts.append(text[pos:start])
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        if end == -1:
            errors.append(f"unterminated {open_tag}: every call must end with {close_tag}")
            break
        bodies.append(text[body_start:end])
        pos = end + len(close_tag)
    return content_parts, bodies, errors


class HermesFormat:
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    _marker = re.compile(r"<tool_call>\s*\{|\{\s*\"name\"\s*:[^}]*\"arguments\"\s*:.*</tool_call>", re.S)

    def parse(self, text: str) -> ParsedResponse:
        content_parts, bodies, errors = split_tagged(text, self.open_tag, self.close_tag)
        calls: list[ToolCall] = []
        # Errors are reported in text order: a body's error before a later stray/unterminated tag.
        body_errors: list[str] = []
        for body in bodies:
            result = call_from_json(body.strip())
            (body_errors if isinstance(result, str) else calls).append(result)
        return ParsedResponse(content="".join(content_parts).strip(), calls=calls, errors=body_errors + errors)

    def render_calls(self, calls: list[ToolCall]) -> str:
        # Same bytes as agentrl's ChatML template renders an assistant message's tool_calls (the Qwen2.5 /
        # Qwen3 templates put a newline around the JSON; see ``render_calls`` of :class:`Qwen3Format`).
        return "".join(
            f'{self.open_tag}{{"name": {dump_json(c.name)}, "arguments": {dump_json(c.arguments)}}}{self.close_tag}'
            for c in calls
        )

    def looks_like_call(self, text: str) -> bool:
        return bool(self._marker.search(text))


class Qwen3Format(HermesFormat):
    """Qwen2.5 / Qwen3 Hermes calls as their chat templates write them: the JSON on its own line inside the
    tags, one call per line. Parses exactly like :class:`HermesFormat`."""

    name = "qwen3"

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(
            f'{self.open_tag}\n{{"name": "{c.name}", "arguments": {dump_json(c.arguments)}}}\n{self.close_tag}'
            for c in calls
        )
