"""The OpenAI chat-completions protocol as the gateway speaks it: request validation, message
normalisation, sampling parameters, and response / stream-chunk bodies.

Pure data conversion (pydantic + json): no I/O, no tokenizer, so each rule is unit-testable on its own.
Messages are *normalised* before anything else sees them: only the fields a chat template reads are kept
(``role``, ``content``, ``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content``), ``None``
values and client-side extras (``refusal``, ``audio``, ``annotations``, ...) are dropped and text parts
are joined. The assistant message the gateway returns is recorded in that same form, so an agent that
echoes it back (as a dict or as the ``openai`` client's message object) lands on the same message-tree
node and the drift guard compares tokens, not serialisation details.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

ROLES = ("system", "developer", "user", "assistant", "tool")
_KEPT_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")


class RequestError(ValueError):
    """A request the gateway refuses: ``status`` (400 by default), an OpenAI error ``code`` and ``param``,
    and ``kind`` (the error type: ``invalid_request_error``, ``timeout``, ``engine_unavailable``, ...)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.kind = kind


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope (what the ``openai`` client reads into ``APIError.message``)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ChatCompletionRequest(BaseModel):
    """The fields of ``POST /v1/chat/completions`` the gateway acts on; other fields are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM / SGLang's extension (``extra_body``): keyword arguments of the chat template for this request,
    # over the gateway's own (e.g. ``{"enable_thinking": false}``).
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Refuse, with a message naming the field, what the gateway cannot honour faithfully."""
        if self.n not in (None, 1):
            raise RequestError(f"n={self.n} is not supported: each request samples one turn of one session "
                               "(send n requests with different session ids for a group)", param="n")
        if self.top_logprobs:
            raise RequestError("top_logprobs is not supported (the engine returns the sampled token's "
                               "log-prob only; use logprobs=true)", param="top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported by the gateway", param=name)
        choice = self.tool_choice
        if isinstance(choice, dict) or choice not in (None, "auto", "none"):
            raise RequestError(f"tool_choice={choice!r} is not supported: the gateway does not constrain "
                               "decoding; use 'auto' or 'none'", param="tool_choice")
        fmt = (self.model_extra or {}).get("response_format")
        if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
            raise RequestError("response_format other than text is not supported", param="response_format")
        for index, spec in enumerate(self.tools or []):
            fn = spec.get("function") if isinstance(spec, Mapping) else None
            if spec.get("type", "function") != "function" or not isinstance(fn, Mapping) or \
                    not isinstance(fn.get("name"), str) or not fn["name"]:
                raise RequestError("each tool must be {'type': 'function', 'function': {'name': ..., "
                                   "'parameters': {...}}}", param=f"tools[{index}]")

    @property
    def parse_tool_calls(self) -> bool:
        """Tool calls are parsed out of the reply when tools were offered and not switched off."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class FinishRequest(BaseModel):
    """Body of ``POST /sessions/{id}/finish``."""

    model_config = ConfigDict(extra="forbid")

    reward: StrictFloat | StrictInt | dict[str, StrictFloat | StrictInt]
    group_id: str | int | None = None
    metadata: dict[str, Any] | None = None
    return_turns: bool = False  # also return the TurnRecords, so the caller can run agentrl.trajectory.verify


class RewardError(ValueError):
    """A finish reward the trainer cannot use; ``code`` says why (``non_finite_reward``, ``reward_out_of_range``,
    ``non_numeric_reward``)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def check_finish_reward(reward: float | Mapping[str, float]) -> None:
    """Raise :class:`RewardError` naming the reward unless :func:`agentrl.trajectory.sample.check_reward`
    accepts it (finite, within ``REWARD_LIMIT``: 1e39, -1e308, NaN and 10**400 are all refused)."""
    from agentrl.trajectory.sample import (
        BadRewardError,
        NonFiniteRewardError,
        NonNumericRewardError,
        RewardOutOfRangeError,
        check_reward,
    )

    codes = {NonFiniteRewardError: "non_finite_reward", RewardOutOfRangeError: "reward_out_of_range",
             NonNumericRewardError: "non_numeric_reward"}
    try:
        check_reward(reward)
    except BadRewardError as err:
        raise RewardError(str(err), codes.get(type(err), "bad_reward")) from None


# ---- messages -------------------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RequestError(f"only text content parts are supported, got a {kind!r} part",
                                   param=f"{where}.content[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"content must be a string or a list of text parts, got {type(content).__name__}",
                       param=f"{where}.content")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError("a tool call must be {'id': ..., 'type': 'function', 'function': {'name': ..., "
                           "'arguments': '<json>'}}", param=where)
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str | dict):
        raise RequestError(f"function.arguments must be a JSON string (or an object), got "
                           f"{type(arguments).__name__}", param=f"{where}.function.arguments")
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out = {"id": str(call["id"]), **out}
    return out


def normalize_message(message: Any, index: int = 0) -> dict[str, Any]:
    """One message reduced to what a chat template reads (see the module docstring)."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise RequestError(f"a message must be an object, got {type(message).__name__}", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = message.get("content")
    calls = message.get("tool_calls")
    if content is not None:
        out["content"] = _text(content, where)
    elif role != "assistant":
        raise RequestError(f"a {role} message needs content", param=f"{where}.content")
    if calls:
        if role != "assistant":
            raise RequestError("only assistant messages may carry tool_calls", param=f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise RequestError("tool_calls must be a list", param=f"{where}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    elif role == "assistant" and content is None:
        raise RequestError("an assistant message needs content or tool_calls", param=where)
    for key in ("tool_call_id", "name", "reasoning_content"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise RequestError(f"{key} must be a string", param=f"{where}.{key}")
            out[key] = value
    return {key: out[key] for key in _KEPT_FIELDS if key in out}


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    return [normalize_message(m, i) for i, m in enumerate(messages)]


# ---- sampling -------------------------------------------------------------------------------------
def sampling_params(request: ChatCompletionRequest, prompt_length: int, context_length: int | None) -> dict[str, Any]:
    """SGLang ``sampling_params`` for one request; ``max_new_tokens`` is capped to the context left."""
    params: dict[str, Any] = {"temperature": 1.0 if request.temperature is None else request.temperature}
    if request.top_p is not None:
        params["top_p"] = request.top_p
    if request.stop:
        params["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    if request.seed is not None:
        params["sampling_seed"] = request.seed
    wanted = request.max_completion_tokens or request.max_tokens
    if context_length is not None:
        room = context_length - prompt_length
        if room <= 0:
            raise RequestError(f"the prompt is {prompt_length} tokens; the model's context is {context_length}",
                               param="messages", code="context_length_exceeded")
        wanted = min(wanted, room) if wanted else room
    if wanted:
        params["max_new_tokens"] = wanted
    return params


# ---- responses ------------------------------------------------------------------------------------
def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def new_completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def finish_reason(engine_reason: str, has_calls: bool) -> str:
    """OpenAI's finish_reason: ``tool_calls`` when calls were parsed, ``length`` when cut, else ``stop``."""
    if engine_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_content(tokens: Sequence[str], logprobs: Sequence[float]) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs, strict=True)]}


def completion_body(*, completion_id: str, model: str, message: Mapping[str, Any], finish: str,
                    prompt_tokens: int, completion_tokens: int, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    reply = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content"):
        reply["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        reply["tool_calls"] = message["tool_calls"]
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": logprobs}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def stream_chunks(*, completion_id: str, model: str, message: Mapping[str, Any], content_pieces: Sequence[str],
                  finish: str, prompt_tokens: int, completion_tokens: int, include_usage: bool) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of one reply: role, the reasoning (one ``reasoning_content``
    delta, when there is any), content deltas, one delta per tool call, the finish reason, and
    (``stream_options.include_usage``) a usage chunk with no choices."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}
        if include_usage:
            body["usage"] = None
        return body

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("reasoning_content"):
        chunks.append(chunk({"reasoning_content": message["reasoning_content"]}))
    chunks += [chunk({"content": piece}) for piece in content_pieces if piece]
    for index, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]}))
    chunks.append(chunk({}, finish))
    if include_usage:
        chunks.append({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    return chunks


def sse(chunks: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """Server-sent events as the OpenAI API sends them, ending with ``data: [DONE]``."""
    return [f"data: {json.dumps(c, ensure_ascii=False)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]
