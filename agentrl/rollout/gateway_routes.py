"""The gateway's HTTP surface as small named handlers: one :class:`fastapi.APIRouter` per concern.

Every protocol route (chat completions here, Responses in ``gateway_responses``, Anthropic Messages in
``gateway_anthropic``) turns its body into one :class:`ChatCompletionRequest` and calls
:func:`complete_turn`, so all of them share the gateway's one session store and every turn is recorded
and proven the same way. Errors carry the protocol of the route they happened on (:func:`error_response`).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from agentrl.rollout.gateway_openai import (
    ChatCompletionRequest,
    FinishRequest,
    RequestError,
    RewardError,
    completion_body,
    error_body,
    logprobs_content,
    sse,
    stream_chunks,
)

if TYPE_CHECKING:
    from agentrl.rollout.gateway import Completion, Gateway

ANTHROPIC_PATHS = ("/v1/messages", "/messages")
# OpenAI error types -> Anthropic's (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_KINDS = {"authentication_error": "authentication_error", "timeout": "timeout_error",
                    "engine_unavailable": "overloaded_error", "not_found": "not_found_error"}


def speaks_anthropic(path: str) -> bool:
    return path.endswith(ANTHROPIC_PATHS)


def error_response(path: str, status: int, message: str, *, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    """An error in the protocol of the route at ``path``: Anthropic's envelope under ``/v1/messages``,
    OpenAI's everywhere else."""
    if speaks_anthropic(path):  # Anthropic's envelope has no param: the message names it
        body = {"type": "error", "error": {"type": _ANTHROPIC_KINDS.get(kind, "invalid_request_error"),
                                           "message": f"{param}: {message}" if param else message}}
        return JSONResponse(body, status_code=status)
    return JSONResponse(error_body(message, kind=kind, param=param, code=code), status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(problems)


async def on_request_error(request: Request, exc: RequestError) -> JSONResponse:
    return error_response(request.url.path, exc.status, exc.message, kind=exc.kind, param=exc.param, code=exc.code)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that does not parse: 400 on Responses and Messages (as the OpenAI and Anthropic APIs answer),
    422 elsewhere (as the gateway always has)."""
    path = request.url.path
    status = 400 if path.endswith(("/responses", *ANTHROPIC_PATHS)) else 422
    return error_response(path, status, validation_message(exc))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)


def install_api_key_check(app: FastAPI, api_key: str | None) -> None:
    """With ``api_key``, every request but ``/health`` must carry ``Authorization: Bearer <key>`` (or, as the
    ``anthropic`` client sends it, ``x-api-key: <key>``)."""
    if not api_key:
        return

    @app.middleware("http")
    async def require_api_key(request: Request, call_next: Callable[[Request], Any]) -> Any:
        if request.url.path == "/health":
            return await call_next(request)
        bearer = request.headers.get("authorization", "").encode()
        header_key = request.headers.get("x-api-key", "").encode()
        if hmac.compare_digest(bearer, f"Bearer {api_key}".encode()) or hmac.compare_digest(header_key,
                                                                                              api_key.encode()):
            return await call_next(request)
        return error_response(request.url.path, 401, "missing or wrong API key (Authorization: Bearer "
                              "$OPENAI_API_KEY)", kind="authentication_error", code="invalid_api_key")


async def complete_turn(gateway: Gateway, body: ChatCompletionRequest, session_id: str) -> Completion:
    """One recorded turn, the engine's failures turned into :class:`RequestError` (nothing is recorded)."""
    from agentrl.rollout.client import GenerateRequestError, GenerateTimeoutError, RolloutClientError

    try:
        return await gateway.complete(body, session_id)
    except GenerateRequestError as err:  # the engine refused the request (e.g. too long)
        raise RequestError(f"engine rejected the request: {err.message}") from err
    except GenerateTimeoutError as err:
        raise RequestError(str(err), kind="timeout", status=504) from err
    except RolloutClientError as err:  # engines unreachable after retries, or a malformed answer
        raise RequestError(str(err), kind="engine_unavailable", status=503) from err


def turn_headers(done: Completion) -> dict[str, str]:
    return {"X-Session-Id": done.session_id, "X-Agentrl-Turn": str(done.turn_index),
            "X-Agentrl-Outcome": done.outcome}


def session_id_of(header: str | None, field: str | None, *, param: str = "user") -> str:
    """The session a request belongs to: the ``X-Session-Id`` header, else the protocol's user field."""
    session = header or field
    if not session:
        raise RequestError(f"no session id: set the request's `{param}` field (or an X-Session-Id header) to the "
                           "episode's id; every turn of one episode must carry the same id", param=param,
                           code="missing_session_id")
    return session


class HealthRoutes:
    """``/health`` and ``/v1/models`` (also without ``/v1`` and under an agent slot)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.router = APIRouter()
        self.router.add_api_route("/health", self.health, methods=["GET"])
        for path in ("/v1/models", "/models", "/agents/{slot}/v1/models", "/agents/{slot}/models"):
            self.router.add_api_route(path, self.models, methods=["GET"])

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def models(self) -> dict[str, Any]:
        return {"object": "list",
                "data": [{"id": self.gateway.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}]}


class ChatRoutes:
    """``POST /v1/chat/completions`` (also without ``/v1``, and under an agent slot's base URL)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.router = APIRouter()
        for path in ("/v1/chat/completions", "/chat/completions"):
            self.router.add_api_route(path, self.chat_completions, methods=["POST"])
        for path in ("/agents/{slot}/v1/chat/completions", "/agents/{slot}/chat/completions"):
            self.router.add_api_route(path, self.agent_chat_completions, methods=["POST"])

    async def chat_completions(self, body: ChatCompletionRequest,
                               x_session_id: str | None = Header(default=None)) -> Any:
        return await self.serve(body, session_id_of(x_session_id, body.user))

    async def agent_chat_completions(self, slot: str, body: ChatCompletionRequest) -> Any:
        """An agent slot's base URL: the session is the slot's open episode, whatever ``user`` says."""
        return await self.serve(body, self.gateway.session_of_slot(slot))

    async def serve(self, body: ChatCompletionRequest, session_id: str) -> Any:
        done = await complete_turn(self.gateway, body, session_id)
        model = body.model or self.gateway.model_name
        prompt_tokens, completion_tokens = len(done.turn.prompt_ids), len(done.turn.output_ids)
        if body.stream:
            chunks = stream_chunks(completion_id=done.completion_id, model=model, message=done.message,
                                   content_pieces=self.gateway.content_pieces(done), finish=done.finish,
                                   prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                   include_usage=body.include_usage)
            return event_stream(sse(chunks), turn_headers(done))
        logprobs = None
        if body.logprobs and done.turn.output_logprobs:
            logprobs = logprobs_content(self.gateway.token_texts(done.turn), done.turn.output_logprobs)
        return JSONResponse(completion_body(completion_id=done.completion_id, model=model, message=done.message,
                                            finish=done.finish, prompt_tokens=prompt_tokens,
                                            completion_tokens=completion_tokens, logprobs=logprobs),
                            headers=turn_headers(done))


def event_stream(events: list[bytes], headers: dict[str, str]) -> Response:
    """A finished reply sent as server-sent events. The turn is generated and recorded before the first
    byte, so the events go out as one body with its length: a client parses them one by one all the same.
    Not a chunked ``StreamingResponse``: its extra writes and end-of-body chunk added 0.05-0.4 ms p50 a
    turn on these 2 cores (benchmarks/gateway_stream_bench.py)."""
    return Response(b"".join(events), media_type="text/event-stream", headers=headers)


class SessionRoutes:
    """``/sessions`` (list), ``/sessions/{id}/finish``, ``DELETE /sessions/{id}``, ``/agents/{slot}/finish``."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.router = APIRouter()
        self.router.add_api_route("/sessions/{session_id}/finish", self.finish, methods=["POST"])
        self.router.add_api_route("/agents/{slot}/finish", self.agent_finish, methods=["POST"])
        self.router.add_api_route("/sessions", self.sessions, methods=["GET"])
        self.router.add_api_route("/sessions/{session_id}", self.drop, methods=["DELETE"])

    async def finish(self, session_id: str, body: FinishRequest) -> Any:
        from agentrl.trajectory import UnknownSessionError

        try:
            return JSONResponse(self.gateway.finish(session_id, body))
        except UnknownSessionError:
            return JSONResponse(error_body(
                f"unknown session {session_id!r}: no turn was recorded under this id, or it was already "
                "finished (finish consumes the session)", code="session_not_found"), status_code=404)
        except RewardError as err:
            return JSONResponse(error_body(f"{err}; the session is still open, finish it again with a finite "
                                           "reward in range", param="reward", code=err.code), status_code=400)
        except (TypeError, ValueError) as err:
            return JSONResponse(error_body(str(err)), status_code=400)

    async def agent_finish(self, slot: str, body: FinishRequest) -> Any:
        """The finish call of an agent that knows only its base URL (``$AGENTRL_FINISH_URL``)."""
        return await self.finish(self.gateway.session_of_slot(slot), body)

    async def sessions(self) -> dict[str, Any]:
        manager = self.gateway.manager
        return {"sessions": [{"id": s, "turns": manager.turn_count(s)} for s in manager.sessions],
                "episodes": [{"id": s, "turns": e.turns} for s, e in self.gateway.episodes.items()],
                "stats": manager.stats}

    async def drop(self, session_id: str) -> Any:
        from agentrl.trajectory import UnknownSessionError

        episode = self.gateway.episodes.get(session_id)
        if episode is not None:  # the agent gave the episode up: the run drops it when it ends
            episode.dropped = True
            return {"dropped": session_id}
        try:
            self.gateway.manager.drop_session(session_id)
        except UnknownSessionError:
            return JSONResponse(error_body(f"unknown session {session_id!r}", code="session_not_found"),
                                status_code=404)
        return {"dropped": session_id}
