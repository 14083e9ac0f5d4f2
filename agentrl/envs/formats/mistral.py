"""Mistral calls: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}, "id": ...}, ...]``
(Mistral-7B-v0.3, Nemo, Small 3.1: the vendored Nemo template), or, from the v11 tokenizers on (Small 3.2,
Magistral, Devstral), ``[TOOL_CALLS]NAME[ARGS]{...}`` once per call, optionally ``NAME[CALL_ID]ID[ARGS]{...}``.
Both are parsed; :meth:`MistralFormat.render_calls` writes the list form with the template's 9-character ids.
"""

from __future__ import annotations

import json
import re

from agentrl.envs.formats.base import (
    ParsedResponse,
    ToolCall,
    call_from_object,
    call_with_json_arguments,
    dump_json,
    json_error,
    snippet,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class MistralFormat:
    """Mistral ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]`` (and the v11 ``NAME[ARGS]{...}``)."""

    name = "mistral"
    _eos = "</s>"

    @staticmethod
    def call_id(index: int) -> str:
        """The id :meth:`render_calls` gives the ``index``-th call of a turn (the template demands 9
        alphanumerics); a tool result answering that call carries the same id."""
        return f"call{index:05d}"

    def parse(self, text: str) -> ParsedResponse:
        if text.endswith(self._eos):
            text = text[: -len(self._eos)]
        calls: list[ToolCall] = []
        errors: list[str] = []
        content: list[str] = []
        pos = 0
        while True:  # each [TOOL_CALLS] is read up to the end of its JSON, so a marker inside a string is data
            start = text.find(TOOL_CALLS, pos)
            if start == -1:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            pos = self._calls_at(text, start + len(TOOL_CALLS), calls, errors)
        return ParsedResponse(content="".join(content).strip(), calls=calls, errors=errors)

    def _calls_at(self, text: str, pos: int, calls: list[ToolCall], errors: list[str]) -> int:
        """Parse the calls right after one ``[TOOL_CALLS]`` (at ``pos``); where the text after them starts."""
        decoder = json.JSONDecoder()
        while pos < len(text) and text[pos].isspace():
            pos += 1
        next_marker = text.find(TOOL_CALLS, pos)
        limit = len(text) if next_marker == -1 else next_marker
        if text.startswith(("[", "{"), pos):
            try:
                obj, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as err:
                errors.append(json_error("[TOOL_CALLS] list", text[pos:limit], err))
                return limit
            for item in obj if isinstance(obj, list) else [obj]:
                result = call_from_object(item, dump_json(item))
                (errors if isinstance(result, str) else calls).append(result)
            if isinstance(obj, list) and not obj:
                errors.append("[TOOL_CALLS] is followed by an empty list: give at least one call")
            return end
        args_at = text.find(ARGS, pos, limit)
        if args_at != -1:
            name = text[pos:args_at].partition(CALL_ID)[0].strip()
            body = args_at + len(ARGS)
            while body < len(text) and text[body].isspace():
                body += 1
            try:
                _, end = decoder.raw_decode(text, body)
            except json.JSONDecodeError as err:
                errors.append(json_error(f"arguments of {name or '?'!r}", text[body:limit], err))
                return limit
            result = call_with_json_arguments(name, text[body:end], raw=text[pos:end])
            (errors if isinstance(result, str) else calls).append(result)
            return end
        errors.append(f"{TOOL_CALLS} must be followed by a JSON list of calls "
                      f"[{{\"name\": ..., \"arguments\": {{...}}}}], got {snippet(text[pos:limit])}")
        return limit

    def render_calls(self, calls: list[ToolCall]) -> str:
        # Template: tool_call.function|tojson minus its "}", then ', "id": "<9 chars>"}', joined by ", ".
        items = ", ".join(
            f'{{"name": {dump_json(c.name)}, "arguments": {dump_json(c.arguments)}, "id": "{self.call_id(i)}"}}'
            for i, c in enumerate(calls)
        )
        return f"{TOOL_CALLS}[{items}]"

    def looks_like_call(self, text: str) -> bool:
        return TOOL_CALLS in text or bool(re.search(r"\w\[ARGS\]\s*\{", text))
