"""``@tool``: declare an environment method as a tool; its JSON schema comes from type hints and docstring.

Arguments the model sends are validated against that schema (pydantic, strict JSON semantics: ``"5"`` is
not an integer, unknown arguments are rejected) before the method runs, so a malformed call becomes a
readable error message for the model instead of an exception inside the tool.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrl.envs.docstrings import parse_docstring

TOOL_ATTRIBUTE = "__agentrl_tool__"


class ToolArgumentError(ValueError):
    """The arguments of a tool call do not match the tool's schema."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its name, description, JSON schema of the arguments and the function that runs it."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]
    is_async: bool
    arguments_model: Any  # pydantic model class validating the arguments

    def schema(self) -> dict[str, Any]:
        """OpenAI / chat-template style: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: Any) -> dict[str, Any]:
        """Keyword arguments for the function, or :class:`ToolArgumentError` saying what is wrong."""
        from pydantic import ValidationError

        if not isinstance(arguments, dict):
            raise ToolArgumentError(
                f"arguments of {self.name!r} must be a JSON object, got {type(arguments).__name__}"
            )
        try:
            # JSON mode keeps JSON-schema semantics (strings for enums, lists for tuples) while staying strict.
            parsed = self.arguments_model.model_validate_json(json.dumps(arguments), strict=True)
        except ValidationError as err:
            raise ToolArgumentError(_describe_errors(self.name, err)) from None
        except (TypeError, ValueError) as err:  # arguments that are not JSON-serialisable
            raise ToolArgumentError(f"arguments of {self.name!r} are not valid JSON: {err}") from None
        # Only what the model sent: omitted arguments keep the function's own defaults.
        return {key: getattr(parsed, key) for key in parsed.model_fields_set}


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None):
    """Mark a (sync or async) method as a tool. Usable bare (``@tool``) or with ``@tool(name=...)``.

    Every parameter except ``self`` needs a type hint; descriptions come from the docstring's
    ``Args:`` (Google) or ``Parameters`` (NumPy) section, the tool description from its summary.
    """

    def mark(func: Callable[..., Any]) -> Callable[..., Any]:
        setattr(func, TOOL_ATTRIBUTE, build_tool_spec(func, name=name, description=description))
        return func

    return mark(fn) if fn is not None else mark


def build_tool_spec(func: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> ToolSpec:
    """The :class:`ToolSpec` of ``func`` (first parameter ``self`` is skipped for methods)."""
    from pydantic import ConfigDict, Field, create_model

    doc = parse_docstring(func.__doc__)
    hints = typing.get_type_hints(func)
    fields: dict[str, Any] = {}
    params = list(inspect.signature(func).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {func.__qualname__}: *args/**kwargs cannot be described by a schema")
        if param.name not in hints:
            raise TypeError(f"tool {func.__qualname__}: parameter {param.name!r} needs a type hint")
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (hints[param.name], Field(default, description=doc.params.get(param.name)))
    tool_name = name or func.__name__
    model = create_model(
        f"{tool_name}_arguments", __config__=ConfigDict(extra="forbid", strict=True), **fields
    )
    parameters = _strip_titles(model.model_json_schema())
    parameters.setdefault("properties", {})
    parameters.pop("additionalProperties", None)
    return ToolSpec(
        name=tool_name,
        description=description or doc.summary or tool_name,
        parameters=parameters,
        function=func,
        is_async=inspect.iscoroutinefunction(func),
        arguments_model=model,
    )


def _strip_titles(schema: Any) -> Any:
    """Drop pydantic's auto-generated ``title`` keywords (noise in a prompt), keep property names."""
    if isinstance(schema, list):
        return [_strip_titles(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        else:
            out[key] = _strip_titles(value)
    return out


def _describe_errors(tool_name: str, err: Any) -> str:
    parts = []
    for e in err.errors(include_url=False):
        where = ".".join(str(x) for x in e["loc"]) or "arguments"
        if e["type"] == "missing":
            parts.append(f"missing required argument {where!r}")
        elif e["type"] == "extra_forbidden":
            parts.append(f"unexpected argument {where!r}")
        else:
            parts.append(f"argument {where!r}: {e['msg']} (got {json.dumps(e.get('input'), default=str)})")
    return f"invalid arguments for {tool_name!r}: " + "; ".join(parts)
