"""``Environment``: one episode of a tool-using task. Subclass it, give it ``@tool`` methods and a reward.

A fresh instance serves exactly one episode (so ``self`` is the per-episode state); the agent loop
calls ``reset(task)``, runs the tools the model calls, asks ``on_text_response`` what to do with a reply
that calls no tool, stops on ``self.done`` or a limit, then awaits ``reward()`` and ``close()``.
``reset``, tools, ``reward`` and ``close`` may each be sync or async.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Mapping
from typing import Any, ClassVar, Literal, TypeVar

from agentrl.envs.formats import ToolCall, ToolCallFormat, format_for, get_tool_call_format
from agentrl.envs.tools import TOOL_ATTRIBUTE, ToolArgumentError, ToolSpec

T = TypeVar("T")

PromptMode = Literal["rerender", "append"]
PROMPT_MODES: tuple[str, ...] = ("rerender", "append")
TOOL_FORMAT_AUTO = "auto"


def choose_tool_format(setting: str | ToolCallFormat | None, tokenizer: Any) -> ToolCallFormat:
    """The format ``setting`` names: a format object, a built-in name or ``module:attr`` path
    (:func:`~agentrl.envs.formats.get_tool_call_format`), or ``"auto"`` / None: the format the tokenizer's chat
    template speaks (:func:`~agentrl.envs.formats.format_for`)."""
    if setting is None or setting == TOOL_FORMAT_AUTO:
        return format_for(tokenizer)
    return get_tool_call_format(setting)


def check_prompt_mode(mode: Any, where: str = "prompt_mode") -> PromptMode:
    """``mode`` if it is a prompt mode; a ValueError naming ``where`` otherwise."""
    if mode not in PROMPT_MODES:
        raise ValueError(f"{where} must be one of {list(PROMPT_MODES)}, got {mode!r}")
    return mode


async def maybe_await(value: T | Awaitable[T]) -> T:
    """``await`` a coroutine/awaitable result of a hook that may be sync or async."""
    return await value if inspect.isawaitable(value) else value


class ToolCallError(Exception):
    """A call the environment could not run; the message is shown to the model as the tool's result."""


class Environment:
    """Base class of every environment. Override ``reset`` and ``reward``; declare tools with ``@tool``.

    Class attributes are the episode's limits (override per subclass or per instance):
    ``max_turns`` model replies; ``max_total_tokens`` tokens in the final sequence (prompt + all
    replies); ``max_context_tokens`` the model's context (the loop also caps it at the engine's); and
    ``max_tool_output_chars`` to truncate long tool results.

    How the model is spoken to (a run's ``rollout.tool_format`` / ``rollout.prompt_mode`` override these):
    ``tool_format`` is the call syntax replies are parsed in — ``"auto"`` (the one the chat template
    speaks), a built-in name (``hermes``, ``qwen3``, ``llama3_json``, ...) or ``"module:attr"``;
    ``prompt_mode`` is how each turn's prompt is built — ``"rerender"`` the whole chat with the template
    (what a deployed template renders), or ``"append"`` the new messages' rendering to the tokens the last
    turn held, so a template that re-renders history differently (Qwen3 without thinking) still gives
    whole multi-turn samples (the trade-off: docs/trajectory.md).
    """

    max_turns: ClassVar[int] = 8
    max_total_tokens: ClassVar[int | None] = None
    max_context_tokens: ClassVar[int | None] = None
    max_tool_output_chars: ClassVar[int] = 4000
    # Seconds an async tool may run before the model is told it timed out (sync tools run inline and
    # cannot be interrupted: make slow tools async).
    tool_timeout_s: ClassVar[float | None] = None
    tools: ClassVar[dict[str, ToolSpec]] = {}
    # A pydantic model of one task: when the run reads tasks from data files, every row is validated
    # against it before training starts (a wrong type names the file and row), and ``reset`` gets its dump.
    task_model: ClassVar[type[Any] | None] = None
    # The task keys ``reset``/``reward`` read: when the run reads tasks from data files, a row lacking one
    # is refused before training starts (naming the file, row and key) instead of failing every episode.
    task_fields: ClassVar[tuple[str, ...]] = ()
    # Weights of the named components ``reward()`` may return (a component not listed weighs 1).
    reward_weights: ClassVar[Mapping[str, float]] = {}
    tool_format: ClassVar[str] = TOOL_FORMAT_AUTO
    prompt_mode: ClassVar[PromptMode] = "rerender"

    # Per-episode state, as class-level defaults so a subclass ``__init__`` need not call super().
    # The loop sets ``task`` and ``messages`` (the live history) right after ``reset``.
    done: bool = False
    task: Any = None
    messages: list[dict[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_prompt_mode(cls.prompt_mode, f"{cls.__name__}.prompt_mode")
        found: dict[str, ToolSpec] = {}
        for klass in reversed(cls.__mro__):  # subclasses override tools of their bases by method name
            for attr in vars(klass).values():
                spec = getattr(attr, TOOL_ATTRIBUTE, None)
                if isinstance(spec, ToolSpec):
                    found[spec.name] = spec
        cls.tools = found

    def __init__(self) -> None:
        self.messages = []

    # ---- the hooks a subclass writes -------------------------------------------------------------
    def reset(self, task: Any) -> list[dict[str, Any]] | Awaitable[list[dict[str, Any]]]:
        """Start the episode for ``task``; return the initial messages (system and/or user)."""
        raise NotImplementedError(f"{type(self).__name__}.reset(task) must return the initial messages")

    def reward(self) -> float | Awaitable[float]:
        """Score of the finished episode (``self.task``, ``self.messages`` and any state the tools kept)."""
        raise NotImplementedError(f"{type(self).__name__}.reward() must return the episode's reward")

    def on_text_response(self, text: str) -> list[dict[str, Any]] | None:
        """The model replied without calling a tool: return messages to continue with, or ``None`` to end.

        Default: the reply is the final answer and the episode ends.
        """
        self.done = True
        return None

    def close(self) -> None | Awaitable[None]:
        """Release per-episode resources (sandboxes, files). Called once, also after errors."""
        return None

    # ---- used by the agent loop ------------------------------------------------------------------
    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]]:
        """The tools as the chat template expects them (``[{"type": "function", "function": ...}]``)."""
        return [spec.schema() for spec in cls.tools.values()]

    async def call_tool(self, call: ToolCall) -> str:
        """Run one call and return its result as text. Raises :class:`ToolCallError` with a message
        for the model when the tool is unknown, the arguments do not match its schema, it raised, or
        it ran past ``tool_timeout_s``."""
        spec = self.tools.get(call.name)
        if spec is None:
            known = ", ".join(sorted(self.tools)) or "none"
            raise ToolCallError(f"unknown tool {call.name!r}; available tools: {known}")
        try:
            kwargs = spec.validate(call.arguments)
        except ToolArgumentError as err:
            raise ToolCallError(str(err)) from None
        try:
            # Through the attribute, so a subclass overriding the method (decorated or not) is what runs.
            result = getattr(self, spec.function.__name__)(**kwargs)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, self.tool_timeout_s)
        except TimeoutError:
            raise ToolCallError(f"tool {call.name!r} timed out after {self.tool_timeout_s} s") from None
        except Exception as err:  # a tool's failure is information for the model, not a crash
            raise ToolCallError(f"tool {call.name!r} failed: {type(err).__name__}: {err}") from err
        return self._as_text(result)

    def _as_text(self, result: Any) -> str:
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
        limit = self.max_tool_output_chars
        if limit and len(text) > limit:
            text = text[:limit] + f"\n[... truncated {len(text) - limit} characters]"
        return text
