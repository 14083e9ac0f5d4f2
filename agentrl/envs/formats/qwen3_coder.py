"""Qwen3-Coder XML calls::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Any number per reply. A string value is raw text; other values are JSON (see :mod:`.xml_values` for how
they are typed back). A ``<function=...>`` block the model wrote without the ``<tool_call>`` wrapper is read
too (the model does drop it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from agentrl.envs.formats.base import ParsedResponse, ToolCall, dump_json, snippet
from agentrl.envs.formats.xml_values import ParameterTypes, parameter_types, typed_value

_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>")


class Qwen3CoderFormat:
    """Qwen3-Coder ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``.

    ``tools``: the tools' JSON schemas, so each parameter value is read as its declared type."""

    name = "qwen3_coder"
    _marker = re.compile(r"<function=[^>\n]*>|<parameter=[^>\n]*>")

    def __init__(self, tools: Iterable[Mapping[str, Any]] | None = None) -> None:
        self.types: ParameterTypes = parameter_types(tools)

    def bind_tools(self, tools: Iterable[Mapping[str, Any]] | None) -> Qwen3CoderFormat:
        """A copy that types parameter values by these tool schemas."""
        return type(self)(tools)

    def parse(self, text: str) -> ParsedResponse:
        calls: list[ToolCall] = []
        errors: list[str] = []
        content: list[str] = []
        pos = 0
        while True:
            wrapped = text.find("<tool_call>", pos)
            bare = _FUNCTION.search(text, pos)
            stray = text.find("</tool_call>", pos)
            starts = [i for i in (wrapped, bare.start() if bare else -1, stray) if i != -1]
            if not starts:
                content.append(text[pos:])
                break
            start = min(starts)
            content.append(text[pos:start])
            if start == stray:
                errors.append("</tool_call> without a matching <tool_call>")
                pos = stray + len("</tool_call>")
            elif start == wrapped:
                end = text.find("</tool_call>", start)
                body = text[start + len("<tool_call>"):end if end != -1 else len(text)]
                if end == -1:
                    errors.append("unterminated <tool_call>: every call must end with </tool_call>")
                found = self._functions(body, calls, errors)
                if not found and end != -1:
                    errors.append("<tool_call> holds no <function=NAME>...</function> block: "
                                  f"{snippet(body.strip())}")
                pos = len(text) if end == -1 else end + len("</tool_call>")
            else:
                end = text.find("</function>", start)
                stop = len(text) if end == -1 else end + len("</function>")
                self._functions(text[start:stop], calls, errors)
                pos = stop
        return ParsedResponse(content="".join(content).strip(), calls=calls, errors=errors)

    def _functions(self, body: str, calls: list[ToolCall], errors: list[str]) -> int:
        """Parse every ``<function=...>`` block of ``body`` into ``calls`` / ``errors``; how many there were."""
        heads = list(_FUNCTION.finditer(body))
        for i, head in enumerate(heads):
            name = head.group(1).strip()
            close = body.find("</function>", head.end())
            limit = heads[i + 1].start() if i + 1 < len(heads) else len(body)
            if close == -1 or close > limit:
                errors.append(f"unterminated <function={name}>: every call must end with </function>")
                continue
            result = self._call(name, body[head.end():close], raw=body[head.start():close + len("</function>")])
            (errors if isinstance(result, str) else calls).append(result)
        return len(heads)

    def _call(self, name: str, inner: str, raw: str) -> ToolCall | str:
        if not name:
            return f"<function=> needs a function name: {snippet(raw)}"
        arguments: dict[str, Any] = {}
        params = list(_PARAMETER.finditer(inner))
        for i, head in enumerate(params):
            key = head.group(1).strip()
            nxt = params[i + 1].start() if i + 1 < len(params) else len(inner)
            close = inner.find("</parameter>", head.end(), nxt)
            value = inner[head.end():close if close != -1 else nxt]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            if not key:
                return f"<parameter=> of {name!r} needs a parameter name"
            if key in arguments:
                return f"parameter {key!r} of {name!r} is given twice"
            try:
                arguments[key] = typed_value(name, key, value, self.types.get(name, {}).get(key))
            except ValueError as err:
                return str(err)
        return ToolCall(name=name, arguments=arguments, raw=raw)

    def render_calls(self, calls: list[ToolCall]) -> str:
        # The template: "\n<tool_call>..." per call right after "<|im_start|>assistant"; the generation prompt
        # already ends in that newline, so the reply starts at "<tool_call>".
        return "\n".join(
            f"<tool_call>\n<function={c.name}>\n"
            + "".join(f"<parameter={k}>\n{_value_text(v)}\n</parameter>\n" for k, v in c.arguments.items())
            + "</function>\n</tool_call>"
            for c in calls
        )

    def looks_like_call(self, text: str) -> bool:
        return bool(self._marker.search(text))


def _value_text(value: Any) -> str:
    """What the template writes: strings raw, objects / arrays as JSON, other values through Python's str."""
    if isinstance(value, dict | list):
        return dump_json(value)
    return value if isinstance(value, str) else str(value)
