"""DeepSeek-V3 / R1 calls::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The V3.1 layout ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` is read too. The markers
are single tokens spelled with FULLWIDTH VERTICAL LINE (U+FF5C) and LOWER ONE EIGHTH BLOCK (U+2581).
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

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
EOS = "<｜end▁of▁sentence｜>"
_FENCED = re.compile(r"^([^\n]*)\n```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)


class DeepSeekV3Format:
    """DeepSeek-V3 / V3-0324 / R1 ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`` with fenced JSON arguments."""

    name = "deepseek_v3"

    def parse(self, text: str) -> ParsedResponse:
        text = text[: -len(EOS)] if text.endswith(EOS) else text
        # The section markers carry nothing (a missing end is tolerated); an end-of-sentence is the turn's end.
        return parse_delimited_calls(text, CALL_BEGIN, CALL_END, self._call, (CALLS_BEGIN, CALLS_END, EOS))

    def _call(self, body: str) -> ToolCall | str:
        if SEP not in body:
            return f"tool call needs {SEP} between the call type and the function name: {snippet(body)}"
        left, _, right = body.partition(SEP)
        fenced = _FENCED.match(right)
        if fenced:  # V3 / R1: type<sep>name\n```json\nargs\n```
            return call_with_json_arguments(fenced.group(1).strip(), fenced.group(2), raw=body)
        if "```" in right or left.strip() == "function":
            return ("tool call must be function<｜tool▁sep｜>NAME, a newline, then the arguments in a "
                    f"```json fence: {snippet(body)}")
        return call_with_json_arguments(left.strip(), right.strip(), raw=body)  # V3.1: name<sep>args

    def render_calls(self, calls: list[ToolCall]) -> str:
        blocks = "\n".join(
            f"{CALL_BEGIN}function{SEP}{c.name}\n```json\n{dump_json(c.arguments)}\n```{CALL_END}" for c in calls
        )
        return f"{CALLS_BEGIN}{blocks}{CALLS_END}"

    def looks_like_call(self, text: str) -> bool:
        return CALL_BEGIN in text or CALLS_BEGIN in text
