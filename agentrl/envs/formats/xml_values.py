"""Parameter values of the XML-style formats (Qwen3-Coder, GLM-4.5): text in the reply, typed in the call.

These templates write a string argument as raw text and anything else as JSON (Qwen3-Coder writes numbers and
booleans with Python's ``str``), so the text alone cannot say whether ``7`` was the string ``"7"`` or the number
7. With the tools' JSON schemas (``tools=`` of the format) each value is read as its declared type; without
them, a value that parses as a JSON number, boolean, null, object or array is read as that, anything else is
kept as text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from agentrl.envs.formats.base import snippet

ParameterTypes = dict[str, dict[str, Any]]  # tool name -> parameter name -> JSON-schema "type" (str or list)


def parameter_types(tools: Iterable[Mapping[str, Any]] | None) -> ParameterTypes:
    """``{tool: {parameter: type}}`` from OpenAI-style tool schemas (``{"type": "function", "function":
    {...}}`` or the bare function object)."""
    types: ParameterTypes = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"a tool schema needs a function name, got {tool!r:.200}")
        props = (fn.get("parameters") or {}).get("properties") or {}
        types[fn["name"]] = {name: spec.get("type") for name, spec in props.items() if isinstance(spec, Mapping)}
    return types


_PY_LITERALS = {"true": True, "false": False, "none": None, "null": None}


def typed_value(tool: str, name: str, text: str, declared: Any) -> Any:
    """``text`` as the value of parameter ``name``; ``ValueError`` (a message for the model) if it cannot be
    the ``declared`` JSON-schema type. ``declared`` None: the schema-free reading of the module docstring."""
    if declared is None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text
        return text if isinstance(value, str) else value
    kinds = declared if isinstance(declared, list) else [declared]
    if "string" in kinds:
        return text
    stripped = text.strip()
    if "boolean" in kinds and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "null" in kinds and stripped.lower() in ("null", "none"):
        return None
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        value = _PY_LITERALS.get(stripped.lower(), text)  # Qwen3-Coder writes Python's True / None
    if _matches(value, kinds):
        return value
    raise ValueError(f"parameter {name!r} of {tool!r} must be {' or '.join(map(str, kinds))}, got {snippet(text)}")


def _matches(value: Any, kinds: list[Any]) -> bool:
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
    }
    return any(checks.get(kind, lambda v: True)(value) for kind in kinds)
