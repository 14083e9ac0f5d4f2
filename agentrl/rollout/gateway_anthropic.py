"""Anthropic Messages (``POST /v1/messages``) on the gateway's one session store.

A Messages body becomes a chat-completions request (``system`` -> a system message, ``text`` blocks ->
content, ``tool_use`` -> ``tool_calls`` with the input as a JSON string, ``tool_result`` -> tool messages,
``thinking`` -> ``reasoning_content``), so the turn is rendered, generated and recorded exactly as a chat
completion; the reply goes back as content blocks with a ``stop_reason``, or as Anthropic's SSE events.
The session id is the ``X-Session-Id`` header, else ``metadata.user_id``. Errors are Anthropic's envelope
``{"type": "error", "error": {"type": ..., "message": ...}}`` (see ``gateway_routes.error_response``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentrl.rollout.gateway_openai import ChatCompletionRequest, RequestError
from agentrl.rollout.gateway_routes import complete_turn, event_stream, session_id_of, turn_headers

if TYPE_CHECKING:
    from agentrl.rollout.gateway import Completion, Gateway


class MessagesRequest(BaseModel):
    """The fields of ``POST /v1/messages`` the gateway acts on; other fields are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The same turn as a chat-completions request (what :meth:`Gateway.complete` serves)."""
        if self.top_k is not None:
            raise RequestError("top_k is not supported: the trainer scores tokens under temperature sampling "
                               "over the whole vocabulary", param="top_k")
        messages = [{"role": "system", "content": _text(self.system, "system")}] if self.system else []
        for index, message in enumerate(self.messages):
            messages += chat_messages(message, index)
        return ChatCompletionRequest(
            model=self.model, messages=messages, tools=[chat_tool(t, i) for i, t in enumerate(self.tools or [])] or None,
            tool_choice=_tool_choice(self.tool_choice), temperature=self.temperature, top_p=self.top_p,
            max_tokens=self.max_tokens, stop=self.stop_sequences or None)

    @property
    def user_id(self) -> str | None:
        value = (self.metadata or {}).get("user_id")
        return value if isinstance(value, str) else None


def _text(content: Any, where: str) -> str:
    """A string, or the text of a list of ``text`` blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, block in enumerate(content):
            if not (isinstance(block, Mapping) and block.get("type") == "text" and isinstance(block.get("text"), str)):
                raise RequestError("only text blocks are supported here", param=f"{where}[{i}]")
            parts.append(block["text"])
        return "".join(parts)
    raise RequestError(f"must be a string or a list of text blocks, got {type(content).__name__}", param=where)


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice.get("type") == "auto":
        return None
    if choice.get("type") == "none":
        return "none"
    return choice  # any / tool: refused by ChatCompletionRequest.check_supported (naming tool_choice)


def chat_tool(tool: Any, index: int) -> dict[str, Any]:
    """``{"name", "description", "input_schema"}`` -> an OpenAI function tool."""
    if not isinstance(tool, Mapping) or tool.get("type", "custom") != "custom" or \
            not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), Mapping):
        raise RequestError("each tool must be {'name': ..., 'input_schema': {...}} (server tools are not "
                           "supported)", param=f"tools[{index}]")
    function = {"name": tool["name"], "parameters": dict(tool["input_schema"])}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def chat_messages(message: Any, index: int) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user message's ``tool_result`` blocks become tool messages
    (before its text), an assistant message's blocks one assistant message."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
        raise RequestError("a message must be {'role': 'user' | 'assistant', 'content': ...}", param=f"{where}.role")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError("content must be a string or a list of content blocks", param=f"{where}.content")
    if role == "user":
        return _user_messages(content, where)
    return [_assistant_message(content, where)]


def _user_messages(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out, text = [], []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            result = block.get("content", "")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _text(result, f"{where}.content[{i}].content")})
        else:
            raise RequestError(f"a user message may hold text and tool_result blocks, got {kind!r}",
                               param=f"{where}.content[{i}]")
    return out + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant_message(blocks: list[Any], where: str) -> dict[str, Any]:
    text, calls, thinking = [], [], []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input"), Mapping):
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        else:
            raise RequestError(f"an assistant message may hold text, thinking and tool_use blocks, got {kind!r}",
                               param=f"{where}.content[{i}]")
    out: dict[str, Any] = {"role": "assistant"}
    if text or not calls:
        out["content"] = "".join(text)
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    return out


# ---- the reply ----------------------------------------------------------------------------------------
def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The recorded reply message as Messages content blocks: thinking, text, tool_use."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(arguments) if isinstance(arguments, str) else arguments})
    return blocks


def stop_reason(done: Completion) -> str:
    if done.turn.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if done.message.get("tool_calls") else "end_turn"


def message_body(done: Completion, model: str, message_id: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(done.message), "stop_reason": stop_reason(done), "stop_sequence": None,
            "usage": {"input_tokens": len(done.turn.prompt_ids), "output_tokens": len(done.turn.output_ids)}}


def stream_events(body: dict[str, Any], text_pieces: list[str]) -> list[dict[str, Any]]:
    """Messages SSE events of one reply: ``message_start``, per block ``content_block_start`` / ``_delta`` /
    ``_stop`` (text in ``text_pieces``), ``message_delta`` (stop reason, usage), ``message_stop``."""
    start = {**body, "content": [], "stop_reason": None, "usage": {**body["usage"], "output_tokens": 0}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(body["content"]):
        if block["type"] == "text":
            opened, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": p} for p in text_pieces if p]
        elif block["type"] == "thinking":
            opened = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": block["thinking"]}]
        else:
            opened = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
        events.append({"type": "content_block_start", "index": index, "content_block": opened})
        events += [{"type": "content_block_delta", "index": index, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", "index": index})
    events.append({"type": "message_delta", "delta": {"stop_reason": body["stop_reason"], "stop_sequence": None},
                   "usage": {"output_tokens": body["usage"]["output_tokens"]}})
    return [*events, {"type": "message_stop"}]


def named_sse(events: list[dict[str, Any]]) -> list[bytes]:
    """Server-sent events with an ``event:`` line naming each one's type (Anthropic's and Responses' form)."""
    return [f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n".encode() for e in events]


class MessagesRoutes:
    """``POST /v1/messages`` (also without ``/v1``, and under an agent slot's base URL)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.router = APIRouter()
        for path in ("/v1/messages", "/messages"):
            self.router.add_api_route(path, self.messages, methods=["POST"])
        for path in ("/agents/{slot}/v1/messages", "/agents/{slot}/messages"):
            self.router.add_api_route(path, self.agent_messages, methods=["POST"])

    async def messages(self, body: MessagesRequest, x_session_id: str | None = Header(default=None)) -> Any:
        return await self.serve(body, session_id_of(x_session_id, body.user_id, param="metadata.user_id"))

    async def agent_messages(self, slot: str, body: MessagesRequest) -> Any:
        """An agent slot's base URL (an ``anthropic`` client's ``base_url`` is the slot's, without ``/v1``):
        the session is the slot's open episode, whatever ``metadata.user_id`` says."""
        return await self.serve(body, self.gateway.session_of_slot(slot))

    async def serve(self, body: MessagesRequest, session_id: str) -> Any:
        chat = body.to_chat()
        done = await complete_turn(self.gateway, chat, session_id)
        reply = message_body(done, body.model or self.gateway.model_name, "msg_" + uuid.uuid4().hex[:24])
        if body.stream:
            pieces = self.gateway.content_pieces(done) if done.message.get("content") else []
            return event_stream(named_sse(stream_events(reply, pieces)), turn_headers(done))
        return JSONResponse(reply, headers=turn_headers(done))
