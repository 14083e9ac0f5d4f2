"""Tool-call formats: a parser (model text -> calls) and a renderer (calls -> model text) per model family.

A format is chosen per model: by name (:func:`get_tool_call_format`, a built-in name or a ``module:attr``
path), or from the tokenizer's chat template (:func:`format_for`). Parsing never raises: every malformed
call becomes an entry of :attr:`ParsedResponse.errors` with a message the model can read and learn from.
:func:`detect_foreign_calls` names the other families whose call markers a reply carries, so a call
written in the wrong syntax is not mistaken for a final answer. Reasoning blocks: :mod:`.reasoning`.

Built-in names: ``hermes`` (alias ``qwen``), ``qwen3``, ``llama3_json``, ``qwen3_coder``, ``mistral``,
``deepseek_v3``, ``glm45``, ``kimi_k2``, ``gpt_oss``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from agentrl.envs.formats.base import ParsedResponse, ToolCall, ToolCallFormat, call_from_json
from agentrl.envs.formats.deepseek import DeepSeekV3Format
from agentrl.envs.formats.glm import Glm45Format
from agentrl.envs.formats.gpt_oss import GptOssFormat
from agentrl.envs.formats.hermes import HermesFormat, Qwen3Format
from agentrl.envs.formats.kimi import KimiK2Format
from agentrl.envs.formats.llama3 import Llama3JsonFormat
from agentrl.envs.formats.mistral import MistralFormat
from agentrl.envs.formats.qwen3_coder import Qwen3CoderFormat
from agentrl.envs.formats.reasoning import ThinkParser, think_parser_for

__all__ = [
    "BUILTIN_FORMATS", "DeepSeekV3Format", "Glm45Format", "GptOssFormat", "HermesFormat", "KimiK2Format",
    "Llama3JsonFormat", "MistralFormat", "ParsedResponse", "Qwen3CoderFormat", "Qwen3Format", "TOOL_CALL_FORMATS",
    "ThinkParser", "ToolCall", "ToolCallFormat", "call_from_json", "detect_foreign_calls", "format_for",
    "get_tool_call_format", "register_tool_call_format", "think_parser_for", "with_tools",
]

# One entry per call syntax, in the order :func:`detect_foreign_calls` reports them.
BUILTIN_FORMATS: dict[str, Callable[[], ToolCallFormat] | str] = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "qwen3_coder": Qwen3CoderFormat,
    "mistral": MistralFormat,
    "deepseek_v3": DeepSeekV3Format,
    "glm45": Glm45Format,
    "kimi_k2": KimiK2Format,
    "gpt_oss": GptOssFormat,
}

TOOL_CALL_FORMATS: dict[str, Callable[[], ToolCallFormat] | str] = {
    **BUILTIN_FORMATS,
    "qwen": HermesFormat,
    "qwen3": Qwen3Format,
}


def register_tool_call_format(name: str, factory: Callable[[], ToolCallFormat] | str) -> None:
    """Make a format selectable by ``name`` (e.g. a format of a model family agentrl does not ship)."""
    TOOL_CALL_FORMATS[name] = factory


def get_tool_call_format(name: str | ToolCallFormat) -> ToolCallFormat:
    """The format registered under ``name``, or the one a ``module:attr`` path names (a class or factory
    is called with no arguments; a format instance is used as is). ``ValueError`` listing the known
    names for an unknown name; ``TypeError`` for an object without ``parse`` and ``render_calls``."""
    from agentrl.plugins import resolve

    if not isinstance(name, str) and _is_format(name):
        return name
    if isinstance(name, str) and name not in TOOL_CALL_FORMATS and not (":" in name or "." in name):
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(TOOL_CALL_FORMATS)} "
                         "(or give a 'module:attr' path)")
    obj = resolve(name, TOOL_CALL_FORMATS, what="tool-call format")
    fmt = obj if (_is_format(obj) and not isinstance(obj, type)) or not callable(obj) else obj()
    if not _is_format(fmt):
        raise TypeError(f"tool-call format {name!r} gave a {type(fmt).__name__}, which has no "
                        "parse(text) and render_calls(calls)")
    return fmt


def _is_format(obj: Any) -> bool:
    return callable(getattr(obj, "parse", None)) and callable(getattr(obj, "render_calls", None))


def with_tools(fmt: ToolCallFormat, tools: list[dict[str, Any]] | None) -> ToolCallFormat:
    """``fmt`` told the tools' JSON schemas, where it uses them (the XML formats type their text values by
    them: ``qwen3_coder``, ``glm45``); ``fmt`` itself for a format that has no use for them."""
    bind = getattr(fmt, "bind_tools", None)
    return bind(tools) if callable(bind) else fmt


def detect_foreign_calls(text: str, chosen: str | ToolCallFormat) -> list[str]:
    """Names of the built-in formats, other than ``chosen``'s syntax, whose call markers appear in ``text``
    (a call written in another model family's syntax; the chosen format parses it as plain text or as a
    malformed call)."""
    fmt = get_tool_call_format(chosen)
    found = []
    for name, factory in BUILTIN_FORMATS.items():
        if name == getattr(fmt, "name", None) or (isinstance(factory, type) and isinstance(fmt, factory)):
            continue
        if get_tool_call_format(name).looks_like_call(text):
            found.append(name)
    return found


# Checked in order: the first template pattern that matches picks the format (most specific first; the
# Hermes ``<tool_call>`` is last because GLM and Qwen3-Coder wrap their own syntax in the same tag).
_TEMPLATE_MARKERS: list[tuple[str, str]] = [
    (r"<\|channel\|>", "gpt_oss"),
    (r"<\|tool_calls_section_begin\|>|<\|im_middle\|>", "kimi_k2"),
    (r"tool▁calls▁begin", "deepseek_v3"),
    (r"<arg_key>", "glm45"),
    (r"<function=", "qwen3_coder"),
    (r"\[TOOL_CALLS\]", "mistral"),
    (r"<\|python_tag\|>|ipython", "llama3_json"),
    (r"<tool_call>\\n\{\"name\": \"", "qwen3"),
    (r"<tool_call>", "hermes"),
]


def format_for(tokenizer_or_template: Any) -> ToolCallFormat:
    """The format a chat template speaks: a tokenizer (its ``chat_template``) or the template text itself.
    Hermes when the template says nothing about tools."""
    if isinstance(tokenizer_or_template, str):
        template: Any = tokenizer_or_template
    else:
        template = getattr(tokenizer_or_template, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(template.values())
    for pattern, name in _TEMPLATE_MARKERS:
        if re.search(pattern, template):
            return get_tool_call_format(name)
    return get_tool_call_format("hermes")
