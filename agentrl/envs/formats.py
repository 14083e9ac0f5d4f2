"""Tool-call formats: a parser (model text -> calls) and a renderer (calls -> model text) per format.

A format is chosen per model: by name, or from the tokenizer's chat template (:func:`format_for`). Parsing
never raises: every malformed call becomes an entry of :attr:`ParsedResponse.errors` with a message the
model can read and learn from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool name and a JSON object of arguments (not yet checked against a schema)."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""

    def to_openai(self, call_id: str) -> dict[str, Any]:
        """The call as an OpenAI chat-completions ``tool_calls`` entry (arguments as a JSON string)."""
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class ParsedResponse:
    """What a model reply says: free text (tool calls removed), the calls, and malformed-call errors."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ToolCallFormat(Protocol):
    name: str

    def parse(self, text: str) -> ParsedResponse: ...

    def render_calls(self, calls: list[ToolCall]) -> str: ...


def call_from_json(payload: str, *, name_keys: tuple[str, ...] = ("name",),
                   argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | str:
    """A :class:`ToolCall` from one JSON object ``{"name": ..., "arguments": {...}}``, or an error message."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as err:
        return f"tool call is not valid JSON ({err.msg} at position {err.pos}): {payload[:200]!r}"
    if not isinstance(obj, dict):
        return f"tool call must be a JSON object with \"name\" and \"arguments\", got {type(obj).__name__}"
    name = next((obj[k] for k in name_keys if k in obj), None)
    if not isinstance(name, str) or not name:
        return "tool call has no \"name\" string"
    arguments: Any = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(arguments, str):  # some models send the arguments object as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"arguments of {name!r} must be a JSON object, got the string {arguments[:200]!r}"
    if not isinstance(arguments, dict):
        return f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments, raw=payload)


class HermesFormat:
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedResponse:
        calls: list[ToolCall] = []
        errors: list[str] = []
        content_parts: list[str] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            stray_close = text.find(self.close_tag, pos)
            if stray_close != -1 and (start == -1 or stray_close < start):
                errors.append(f"{self.close_tag} without a matching {self.open_tag}")
                content_parts.append(text[pos:stray_close])
                pos = stray_close + len(self.close_tag)
                continue
            if start == -1:
                content_parts.append(text[pos:])
                break
            content_parts.append(text[pos:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            if end == -1:
                errors.append(f"unterminated {self.open_tag}: every call must end with {self.close_tag}")
                break
            result = call_from_json(text[body_start:end].strip())
            (errors if isinstance(result, str) else calls).append(result)
            pos = end + len(self.close_tag)
        return ParsedResponse(content="".join(content_parts).strip(), calls=calls, errors=errors)

    def render_calls(self, calls: list[ToolCall]) -> str:
        # Same bytes as the Qwen chat template renders an assistant message's tool_calls.
        return "".join(
            f'{self.open_tag}{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": '
            f"{json.dumps(c.arguments, ensure_ascii=False)}}}{self.close_tag}"
            for c in calls
        )


class Llama3JsonFormat:
    """Llama 3.1/3.2 JSON tool calling: the whole reply is ``{"name": ..., "parameters": {...}}``,
    optionally after ``<|python_tag|>``; several calls are separated by ``;``."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

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
        return "; ".join(
            json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls
        )


TOOL_CALL_FORMATS: dict[str, Callable[[], ToolCallFormat]] = {
    HermesFormat.name: HermesFormat,
    "qwen": HermesFormat,
    Llama3JsonFormat.name: Llama3JsonFormat,
}


def register_tool_call_format(name: str, factory: Callable[[], ToolCallFormat]) -> None:
    """Make a format selectable by ``name`` (e.g. a format of a model family agentrl does not ship)."""
    TOOL_CALL_FORMATS[name] = factory


def get_tool_call_format(name: str) -> ToolCallFormat:
    """The format registered under ``name``; a clear error listing the known names otherwise."""
    try:
        return TOOL_CALL_FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(TOOL_CALL_FORMATS)}") from None


_TEMPLATE_MARKERS: list[tuple[str, str]] = [
    (r"<tool_call>", HermesFormat.name),
    (r"<\|python_tag\|>|ipython", Llama3JsonFormat.name),
]


def format_for(tokenizer: Any) -> ToolCallFormat:
    """The format a tokenizer's chat template speaks (Hermes when the template says nothing about tools)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(template.values())
    for pattern, name in _TEMPLATE_MARKERS:
        if re.search(pattern, template):
            return get_tool_call_format(name)
    return get_tool_call_format(HermesFormat.name)
