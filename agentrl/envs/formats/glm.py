"""GLM-4.5 / GLM-4.6 calls::

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

Any number per reply, after the ``<think>`` block. A string value is raw text, other values JSON (typed back
as :mod:`.xml_values` says). The tag is Hermes's ``<tool_call>``, the body is not JSON.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from agentrl.envs.formats.base import ParsedResponse, ToolCall, dump_json, snippet
from agentrl.envs.formats.hermes import split_tagged
from agentrl.envs.formats.xml_values import ParameterTypes, parameter_types, typed_value

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*(?:<arg_value>(.*?)</arg_value>)?", re.S)


class Glm45Format:
    """GLM-4.5 / 4.6 ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``.

    ``tools``: the tools' JSON schemas, so each value is read as its declared type."""

    name = "glm45"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    _marker = re.compile(r"<arg_key>|<tool_call>[ \t]*[^\s{<\"][^\n<]*\s*(<arg_key>|</tool_call>)")

    def __init__(self, tools: Iterable[Mapping[str, Any]] | None = None) -> None:
        self.types: ParameterTypes = parameter_types(tools)

    def bind_tools(self, tools: Iterable[Mapping[str, Any]] | None) -> Glm45Format:
        """A copy that types argument values by these tool schemas."""
        return type(self)(tools)

    def parse(self, text: str) -> ParsedResponse:
        content, bodies, tag_errors = split_tagged(text, self.open_tag, self.close_tag)
        calls: list[ToolCall] = []
        errors: list[str] = []
        for body in bodies:
            result = self._call(body)
            (errors if isinstance(result, str) else calls).append(result)
        return ParsedResponse(content="".join(content).strip(), calls=calls, errors=errors + tag_errors)

    def _call(self, body: str) -> ToolCall | str:
        first = body.find("<arg_key>")
        name = (body if first == -1 else body[:first]).strip()
        if not name:
            return f"tool call needs the function name right after <tool_call>: {snippet(body.strip())}"
        if name.startswith(("{", "[")) or "\n" in name:
            return ("a GLM tool call is <tool_call>NAME then <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> "
                    f"pairs, not JSON: {snippet(body.strip())}")
        arguments: dict[str, Any] = {}
        rest = body[first:] if first != -1 else ""
        pos = 0
        for match in _PAIR.finditer(rest):
            if rest[pos:match.start()].strip():
                return f"unexpected text between the arguments of {name!r}: {snippet(rest[pos:match.start()].strip())}"
            key, value = match.group(1).strip(), match.group(2)
            if value is None:
                return f"<arg_key>{key}</arg_key> of {name!r} has no <arg_value>...</arg_value> after it"
            if key in arguments:
                return f"argument {key!r} of {name!r} is given twice"
            try:
                arguments[key] = typed_value(name, key, value, self.types.get(name, {}).get(key))
            except ValueError as err:
                return str(err)
            pos = match.end()
        if rest[pos:].strip():
            return f"unexpected text after the arguments of {name!r}: {snippet(rest[pos:].strip())}"
        return ToolCall(name=name, arguments=arguments, raw=body)

    def render_calls(self, calls: list[ToolCall]) -> str:
        # The template writes "\n<tool_call>NAME", then "\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>" per
        # argument, then "\n</tool_call>", after the assistant's "<think>...</think>" block.
        return "".join(
            f"\n<tool_call>{c.name}"
            + "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else dump_json(v)}</arg_value>"
                      for k, v in c.arguments.items())
            + "\n</tool_call>"
            for c in calls
        )

    def looks_like_call(self, text: str) -> bool:
        return bool(self._marker.search(text))
