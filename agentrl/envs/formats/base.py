"""What every tool-call format shares: the call and parse-result types, the format protocol, JSON helpers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


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
    """What a model reply says: free text (tool calls and reasoning removed), the calls, malformed-call
    errors, and the reasoning (``<think>`` block or gpt-oss ``analysis`` channel; empty when none)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasoning: str = ""


@runtime_checkable
class ToolCallFormat(Protocol):
    """A model family's tool-call syntax. ``parse`` never raises; ``render_calls`` writes the bytes the
    model's chat template writes for an assistant turn's ``tool_calls``, so ``parse(render_calls(c))``
    gives back ``c``. ``looks_like_call`` says whether text carries this format's call markers at all
    (well-formed or not), so a reply in another family's syntax can be told from a plain answer."""

    name: str

    def parse(self, text: str) -> ParsedResponse: ...

    def render_calls(self, calls: list[ToolCall]) -> str: ...

    def looks_like_call(self, text: str) -> bool: ...


def snippet(text: str, limit: int = 200) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters."""
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def json_error(what: str, payload: str, err: json.JSONDecodeError) -> str:
    return f"{what} is not valid JSON ({err.msg} at position {err.pos}): {snippet(payload)}"


def arguments_object(name: str, arguments: Any) -> dict[str, Any] | str:
    """``arguments`` as a dict (a JSON string holding an object is decoded), or an error message."""
    if isinstance(arguments, str):  # some models send the arguments object as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"arguments of {name!r} must be a JSON object, got the string {snippet(arguments)}"
    if not isinstance(arguments, dict):
        return f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return arguments


def call_with_json_arguments(name: str, payload: str, raw: str = "") -> ToolCall | str:
    """A :class:`ToolCall` named ``name`` whose arguments are the JSON object ``payload``, or an error."""
    if not name:
        return f"tool call has no function name: {snippet(raw or payload)}"
    try:
        arguments = json.loads(payload) if payload.strip() else {}
    except json.JSONDecodeError as err:
        return json_error(f"arguments of {name!r}", payload, err)
    result = arguments_object(name, arguments)
    return result if isinstance(result, str) else ToolCall(name=name, arguments=result, raw=raw or payload)


def call_from_json(payload: str, *, name_keys: tuple[str, ...] = ("name",),
                   argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | str:
    """A :class:`ToolCall` from one JSON object ``{"name": ..., "arguments": {...}}``, or an error message."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as err:
        return json_error("tool call", payload, err)
    return call_from_object(obj, payload, name_keys=name_keys, argument_keys=argument_keys)


def call_from_object(obj: Any, raw: str, *, name_keys: tuple[str, ...] = ("name",),
                     argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | str:
    """A :class:`ToolCall` from a decoded ``{"name": ..., "arguments": {...}}`` object, or an error message."""
    if not isinstance(obj, dict):
        return f"tool call must be a JSON object with \"name\" and \"arguments\", got {type(obj).__name__}"
    name = next((obj[k] for k in name_keys if k in obj), None)
    if not isinstance(name, str) or not name:
        return "tool call has no \"name\" string"
    arguments = arguments_object(name, next((obj[k] for k in argument_keys if k in obj), {}))
    return arguments if isinstance(arguments, str) else ToolCall(name=name, arguments=arguments, raw=raw)


def dump_json(value: Any) -> str:
    """JSON the way chat templates' ``tojson`` writes it under transformers (``ensure_ascii=False``)."""
    return json.dumps(value, ensure_ascii=False)


def parse_delimited_calls(text: str, begin: str, end: str, parse_call: Callable[[str], ToolCall | str],
                          markers: tuple[str, ...] = ()) -> ParsedResponse:
    """Calls written as ``begin BODY end`` (DeepSeek, Kimi): each body through ``parse_call``; an unclosed
    ``begin`` is an error up to the next one; the text around them, less ``markers``, is the content."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(begin, pos)
        if start == -1:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        close = text.find(end, start)
        following = text.find(begin, start + len(begin))
        if close == -1 or (following != -1 and following < close):
            errors.append(f"unterminated {begin}: every call must end with {end}")
            pos = len(text) if following == -1 else following
            continue
        result = parse_call(text[start + len(begin):close])
        (errors if isinstance(result, str) else calls).append(result)
        pos = close + len(end)
    free = "".join(content)
    for marker in markers:
        free = free.replace(marker, "")
    return ParsedResponse(content=free.strip(), calls=calls, errors=errors)
