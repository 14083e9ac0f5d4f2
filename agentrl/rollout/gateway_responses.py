"""OpenAI Responses (``POST /v1/responses``) on the gateway's one session store.

The ``input`` items become chat messages (``message`` items by role; a run of assistant-side items, that is
``reasoning``, an assistant ``message`` and ``function_call`` items, one assistant message with
``reasoning_content``, content and ``tool_calls``; ``function_call_output`` a tool message), ``instructions``
a system message in front, and the turn is served as a chat completion. ``previous_response_id`` chains:
the gateway keeps each response's conversation (without its instructions, which do not carry over, as in
OpenAI's API) and its session, so a chained request needs neither the history nor the session id again.
The session id is the ``X-Session-Id`` header, else ``user``, else the previous response's.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentrl.rollout.gateway_anthropic import named_sse
from agentrl.rollout.gateway_openai import ChatCompletionRequest, RequestError
from agentrl.rollout.gateway_routes import complete_turn, event_stream, session_id_of, turn_headers

if TYPE_CHECKING:
    from agentrl.rollout.gateway import Completion, Gateway

KEPT_RESPONSES = 4096  # conversations kept for previous_response_id (oldest dropped first)
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The fields of ``POST /v1/responses`` the gateway acts on; other fields are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The turn as a chat-completions request, after the chained conversation ``history``."""
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
            raise RequestError("text.format other than text is not supported", param="text.format")
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools = [chat_tool(t, i) for i, t in enumerate(self.tools or [])] or None
        return ChatCompletionRequest(model=self.model, messages=[*system, *history, *input_messages(self.input)],
                                     tools=tools, tool_choice=self.tool_choice, temperature=self.temperature,
                                     top_p=self.top_p, max_tokens=self.max_output_tokens)


def chat_tool(tool: Any, index: int) -> dict[str, Any]:
    """A Responses function tool ``{"type": "function", "name", "parameters", ...}`` as a chat tool."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise RequestError("each tool must be {'type': 'function', 'name': ..., 'parameters': {...}} (hosted "
                           "tools are not supported)", param=f"tools[{index}]")
    function = {"name": tool["name"], "parameters": dict(tool.get("parameters") or {"type": "object"})}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _text(content: Any, where: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") in kinds and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RequestError(f"only text parts are supported, got {kind!r}", param=f"{where}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"must be a string or a list of text parts, got {type(content).__name__}", param=where)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    open_turn: dict[str, Any] | None = None  # the assistant message the current run of items builds
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") != "assistant":
            open_turn = None
            role = item.get("role")
            if role not in ("user", "system", "developer"):
                raise RequestError(f"role must be user, system, developer or assistant; got {role!r}",
                                   param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            continue
        if kind == "function_call_output":
            open_turn = None
            if not isinstance(item.get("call_id"), str):
                raise RequestError("a function_call_output needs its call_id", param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"{where}.output")})
            continue
        if open_turn is None:
            open_turn = {"role": "assistant"}
            out.append(open_turn)
        _add_to_turn(open_turn, item, kind, where)
    for message in out:
        if message["role"] == "assistant" and "content" not in message and "tool_calls" not in message:
            message["content"] = ""  # a reasoning item alone: the reply said nothing else
    return out


def _add_to_turn(turn: dict[str, Any], item: Mapping[str, Any], kind: str, where: str) -> None:
    """Merge one assistant-side item (reasoning, assistant message, function_call) into ``turn``."""
    if kind == "reasoning":
        text = _text(item.get("content") or item.get("summary") or [], f"{where}.content",
                     ("reasoning_text", "summary_text"))
        turn["reasoning_content"] = "\n".join(t for t in (turn.get("reasoning_content"), text) if t)
    elif kind == "message":
        turn["content"] = turn.get("content", "") + _text(item.get("content"), f"{where}.content")
    elif kind == "function_call":
        if not (isinstance(item.get("name"), str) and isinstance(item.get("call_id"), str)
                and isinstance(item.get("arguments"), str)):
            raise RequestError("a function_call needs call_id, name and arguments (a JSON string)", param=where)
        turn.setdefault("tool_calls", []).append(
            {"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"]}})
    else:
        raise RequestError(f"input items of type {kind!r} are not supported (message, reasoning, function_call "
                           "and function_call_output are)", param=f"{where}.type")


# ---- the reply ----------------------------------------------------------------------------------------
def output_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The recorded reply as Responses output items: reasoning, message, function_call."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "status": "completed",
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content") or not message.get("tool_calls"):
        items.append({"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": [],
                                   "logprobs": []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def response_body(request: ResponsesRequest, done: Completion, response_id: str, model: str) -> dict[str, Any]:
    cut = done.turn.finish_reason == "length"
    prompt, generated = len(done.turn.prompt_ids), len(done.turn.output_ids)
    return {
        "id": response_id, "object": "response", "created_at": time.time(), "model": model,
        "status": "incomplete" if cut else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": request.instructions, "metadata": request.metadata or {}, "output": output_items(done.message),
        "parallel_tool_calls": True, "temperature": request.temperature, "top_p": request.top_p,
        "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
        "previous_response_id": request.previous_response_id, "text": {"format": {"type": "text"}},
        "usage": {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    }


def stream_events(body: dict[str, Any], text_pieces: list[str]) -> list[dict[str, Any]]:
    """Responses SSE events of one reply: ``response.created`` / ``.in_progress``, per output item
    ``output_item.added``, its deltas and ``output_item.done``, then ``response.completed`` (or
    ``response.incomplete``); each with its ``sequence_number``."""
    pending = {**body, "status": "in_progress", "output": [], "incomplete_details": None}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": pending},
                                    {"type": "response.in_progress", "response": pending}]
    for index, item in enumerate(body["output"]):
        events += _item_events(index, item, text_pieces)
    events.append({"type": "response.completed" if body["status"] == "completed" else "response.incomplete",
                   "response": body})
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


def _item_events(index: int, item: dict[str, Any], text_pieces: list[str]) -> list[dict[str, Any]]:
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        opened = {**item, "arguments": "", "status": "in_progress"}
        inner = [{"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                 {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"],
                  "name": item["name"]}]
    elif item["type"] == "reasoning":
        text = item["content"][0]["text"]
        opened = {**item, "content": [], "status": "in_progress"}
        part = {"type": "reasoning_text", "text": text}
        inner = [{"type": "response.content_part.added", **at, "content_index": 0, "part": {**part, "text": ""}},
                 {"type": "response.reasoning_text.delta", **at, "content_index": 0, "delta": text},
                 {"type": "response.reasoning_text.done", **at, "content_index": 0, "text": text},
                 {"type": "response.content_part.done", **at, "content_index": 0, "part": part}]
    else:
        part = item["content"][0]
        opened = {**item, "content": [], "status": "in_progress"}
        pieces = text_pieces if "".join(text_pieces) == part["text"] else [part["text"]]
        inner = [{"type": "response.content_part.added", **at, "content_index": 0, "part": {**part, "text": ""}},
                 *({"type": "response.output_text.delta", **at, "content_index": 0, "delta": p, "logprobs": []}
                   for p in pieces if p),
                 {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"], "logprobs": []},
                 {"type": "response.content_part.done", **at, "content_index": 0, "part": part}]
    return [{"type": "response.output_item.added", "output_index": index, "item": opened}, *inner,
            {"type": "response.output_item.done", "output_index": index, "item": item}]


class ResponsesRoutes:
    """``POST /v1/responses`` (also without ``/v1``, and under an agent slot's base URL) and the
    conversations ``previous_response_id`` chains to."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.conversations: OrderedDict[str, tuple[str, list[dict[str, Any]]]] = OrderedDict()
        self.router = APIRouter()
        for path in ("/v1/responses", "/responses"):
            self.router.add_api_route(path, self.responses, methods=["POST"])
        for path in ("/agents/{slot}/v1/responses", "/agents/{slot}/responses"):
            self.router.add_api_route(path, self.agent_responses, methods=["POST"])

    def chained(self, previous: str | None) -> tuple[str | None, list[dict[str, Any]]]:
        """The session and conversation of response ``previous`` (none and [] without one)."""
        if previous is None:
            return None, []
        if previous not in self.conversations:
            raise RequestError(f"previous response {previous!r} is not known to this gateway (it keeps the last "
                               f"{KEPT_RESPONSES})", param="previous_response_id", code="previous_response_not_found")
        return self.conversations[previous]

    async def responses(self, body: ResponsesRequest, x_session_id: str | None = Header(default=None)) -> Any:
        previous_session, history = self.chained(body.previous_response_id)
        return await self.serve(body, session_id_of(x_session_id, body.user or previous_session), history)

    async def agent_responses(self, slot: str, body: ResponsesRequest) -> Any:
        """An agent slot's base URL: the session is the slot's open episode, whatever ``user`` says (a
        chained ``previous_response_id`` still supplies the history)."""
        session_id = self.gateway.session_of_slot(slot)
        return await self.serve(body, session_id, self.chained(body.previous_response_id)[1])

    async def serve(self, body: ResponsesRequest, session_id: str, history: list[dict[str, Any]]) -> Any:
        chat = body.to_chat(history)
        done = await complete_turn(self.gateway, chat, session_id)
        response_id = "resp_" + uuid.uuid4().hex
        conversation = chat.messages[1:] if body.instructions else chat.messages
        self.conversations[response_id] = (session_id, [*conversation, done.message])
        while len(self.conversations) > KEPT_RESPONSES:
            self.conversations.popitem(last=False)
        reply = response_body(body, done, response_id, body.model or self.gateway.model_name)
        if body.stream:
            pieces = self.gateway.content_pieces(done) if done.message.get("content") else []
            return event_stream(named_sse(stream_events(reply, pieces)), turn_headers(done))
        return JSONResponse(reply, headers=turn_headers(done))
