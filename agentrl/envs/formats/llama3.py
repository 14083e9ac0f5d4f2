"""Llama 3.1 / 3.2 / 3.3 JSON tool calling: the reply is ``{"name": ..., "parameters": {...}}``, optionally
after ``<|python_tag|>``; several calls are separated by ``;``."""

from __future__ import annotations

import json
import re

from agentrl.envs.formats.base import ParsedResponse, ToolCall, call_from_json, dump_json


class Llama3JsonFormat:
    """Llama 3.1/3.2 JSON tool calling: the whole reply is ``{"name": ..., "parameters": {...}}``,
    optionally after ``<|python_tag|>``; several calls are separated by ``;``."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    _marker = re.compile(r"^\s*(<\|python_tag\|>|\{\s*\"(name|type)\"\s*:)")

    def parse(self, text: str) -> ParsedResponse:
        body = text.strip()
        tagged = body.startswith(self.python_tag)
        if tagged:
            body = body[len(self.python_tag):].strip()
        if not body.startswith("{"):
            error = ["<|python_tag|> must be followed by a JSON tool call"] if tagged else []
            return ParsedResponse(content=text.strip(), errors=error)
        calls: list[ToolCall] = []
        errors: list[str] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                _, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as err:
                errors.append(f"tool call is not valid JSON ({err.msg} at position {err.pos})")
                break
            result = call_from_json(body[pos:end])
            (errors if isinstance(result, str) else calls).append(result)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return ParsedResponse(content="", calls=calls, errors=errors)

    def render_calls(self, calls: list[ToolCall]) -> str:
        # The Llama 3.1 template writes one call as {"name": ..., "parameters": ...}; it refuses several in
        # one turn, so several are joined the way the model emits parallel calls (``; ``).
        return "; ".join(dump_json({"name": c.name, "parameters": c.arguments}) for c in calls)

    def looks_like_call(self, text: str) -> bool:
        return bool(self._marker.search(text))
