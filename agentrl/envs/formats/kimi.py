"""Kimi-K2 calls::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>

The call id ``functions.NAME:IDX`` carries the function name; ``NAME:IDX`` and a bare ``NAME`` are read too.
"""

from __future__ import annotations

import re

from agentrl.envs.formats.base import (
    ParsedResponse,
    ToolCall,
    call_with_json_arguments,
    dump_json,
    parse_delimited_calls,
    snippet,
)

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_ID = re.compile(r"^(?:functions\.)?(?P<name>[^\s:]+)(?::(?P<index>\d+))?$")


class KimiK2Format:
    """Kimi-K2 ``<|tool_calls_section_begin|>`` sections of ``functions.NAME:IDX`` calls with JSON arguments."""

    name = "kimi_k2"

    @staticmethod
    def call_id(name: str, index: int) -> str:
        """The id :meth:`render_calls` gives the ``index``-th call of a turn, as Kimi writes it."""
        return f"functions.{name}:{index}"

    def parse(self, text: str) -> ParsedResponse:
        return parse_delimited_calls(text, CALL_BEGIN, CALL_END, self._call, (SECTION_BEGIN, SECTION_END))

    def _call(self, body: str) -> ToolCall | str:
        if ARGUMENT_BEGIN not in body:
            return f"tool call needs {ARGUMENT_BEGIN} between the call id and the arguments: {snippet(body)}"
        call_id, _, payload = body.partition(ARGUMENT_BEGIN)
        match = _ID.match(call_id.strip())
        if not match:
            return f"tool call id must be functions.NAME:INDEX, got {snippet(call_id.strip())}"
        return call_with_json_arguments(match.group("name"), payload.strip(), raw=body)

    def render_calls(self, calls: list[ToolCall]) -> str:
        blocks = "".join(
            f"{CALL_BEGIN}{self.call_id(c.name, i)}{ARGUMENT_BEGIN}{dump_json(c.arguments)}{CALL_END}"
            for i, c in enumerate(calls)
        )
        return f"{SECTION_BEGIN}{blocks}{SECTION_END}"

    def looks_like_call(self, text: str) -> bool:
        return CALL_BEGIN in text or SECTION_BEGIN in text
