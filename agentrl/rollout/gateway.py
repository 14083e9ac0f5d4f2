"""``agentrl gateway``: an OpenAI-compatible ``/v1/chat/completions`` that records trainable trajectories.

Bring your own agent: point any OpenAI client at the gateway, pass a session id as the request's
``user`` field (or an ``X-Session-Id`` header), and every request becomes one recorded turn:

    messages (+ tools) --ChatRenderer--> prompt ids --RolloutClient (routing key = session)--> smg --> engine
    reply ids --decode + tool-call parse--> OpenAI message (content / tool_calls)
    TurnRecord --TrajectoryManager.record_turn(session, ...)--> drift guard (realign / fork / truncate)

``POST /sessions/{id}/finish`` with ``{"reward": r}`` consumes the session and returns
``{"samples": [Sample.to_dict(), ...]}``; a NaN or infinite reward (or metadata value) is a 400 that
leaves the session open for a corrected finish.

    agentrl gateway --router http://127.0.0.1:30000 --model DIR --port 8000 [--policy realign]

The history an agent sends back is rendered exactly as a serving stack renders it (the chat template,
``tool_calls`` in OpenAI shape included); where that re-tokenizes differently from what was sampled, or
the agent rewrote the history, the trajectory's drift guard decides (see docs/gateway.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.rollout.gateway_openai import (
    ChatCompletionRequest,
    FinishRequest,
    RequestError,
    completion_body,
    error_body,
    finish_reason,
    logprobs_content,
    new_call_id,
    new_completion_id,
    normalize_message,
    normalize_messages,
    sampling_params,
    sse,
    stream_chunks,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from agentrl.envs.formats import ToolCallFormat
    from agentrl.envs.loop import Generate
    from agentrl.trajectory import DriftPolicy, Sample, TurnRecord

SESSION_HEADER = "x-session-id"
STREAM_PIECES = 256  # at most this many content deltas per streamed reply (each is one prefix decode)


@dataclass
class Completion:
    """One served request: the reply message as returned (and recorded), and the turn behind it."""

    completion_id: str
    session_id: str
    message: dict[str, Any]
    finish: str
    turn: TurnRecord
    turn_index: int
    outcome: str  # the trajectory manager's outcome: new / clean / realigned / forked / cut / branched
    malformed_calls: int


class Gateway:
    """The state behind the HTTP app: renderer, tool-call format, ``generate`` and the trajectory manager.

    ``generate`` is any ``async (input_ids, *, session_id, sampling_params) -> TurnRecord`` — in production
    :meth:`RolloutClient.generate_turn`, in tests a scripted policy. All manager calls happen on the event
    loop, so the manager needs no lock. Prompts are tokenized in a worker thread: do not hand the same
    tokenizer object to code that encodes on another thread (a HF fast tokenizer switches shared backend
    state per call for ``split_special_tokens``, so concurrent encodes can corrupt each other).
    """

    def __init__(self, tokenizer: Any, generate: Generate, *, policy: str | DriftPolicy = "realign",
                 fork_threshold_tokens: int = 1024, context_length: int | None = None,
                 model_name: str = "agentrl", tool_format: ToolCallFormat | None = None) -> None:
        from agentrl.envs.formats import format_for
        from agentrl.envs.render import ChatRenderer
        from agentrl.trajectory import TrajectoryManager

        self.renderer = ChatRenderer(tokenizer)
        self.tool_format = tool_format or format_for(tokenizer)
        self.generate = generate
        self.manager = TrajectoryManager(policy=policy, fork_threshold_tokens=fork_threshold_tokens)
        self.context_length = context_length
        self.model_name = model_name
        # Renders run in worker threads (off the event loop); one at a time, because a HF fast tokenizer
        # is not guaranteed to be safe under concurrent calls.
        self._render_lock = threading.Lock()

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None):
        with self._render_lock:
            return self.renderer.render(messages, tools)

    async def complete(self, request: ChatCompletionRequest, session_id: str) -> Completion:
        """Render, generate, parse and record one turn of ``session_id``."""
        request.check_supported()
        messages = normalize_messages(request.messages)
        try:  # tokenizing a long history is CPU work: keep the event loop free for other sessions
            rendered = await asyncio.to_thread(self._render, messages, request.tools)
        except RequestError:
            raise
        except Exception as err:  # the template refused these messages (e.g. a role order it forbids)
            raise RequestError(f"the chat template cannot render these messages: {type(err).__name__}: {err}",
                               param="messages") from err
        params = sampling_params(request, len(rendered.ids), self.context_length)
        turn = await self.generate(rendered.ids, session_id=session_id, sampling_params=params)
        text = self.renderer.decode_response(list(turn.output_ids))
        message, malformed = self._reply(text, parse=request.parse_tool_calls)
        index = self.manager.turn_count(session_id) if self.manager.has_session(session_id) else 0
        outcome = self.manager.record_turn(
            session_id, turn=turn, prompt_messages=messages, response_message=message,
            metadata={"tool_calls": [c["function"]["name"] for c in message.get("tool_calls", [])],
                      "malformed_calls": malformed},
        )
        return Completion(new_completion_id(), session_id, message, finish_reason(turn.finish_reason, "tool_calls" in message),
                          turn, index, outcome, malformed)

    def _reply(self, text: str, *, parse: bool) -> tuple[dict[str, Any], int]:
        """The OpenAI assistant message of a reply, normalised as an echoed history message would be, and the
        number of malformed calls. A reply with a malformed call is returned as plain text (like vLLM):
        the agent sees exactly what the model said."""
        if not parse:
            return {"role": "assistant", "content": text}, 0
        parsed = self.tool_format.parse(text)
        if parsed.errors or not parsed.calls:
            return {"role": "assistant", "content": text}, len(parsed.errors)
        message = {"role": "assistant", "content": parsed.content or None,
                   "tool_calls": [call.to_openai(new_call_id()) for call in parsed.calls]}
        return normalize_message(message), 0

    def content_pieces(self, completion: Completion) -> list[str]:
        """The reply content split at token boundaries (prefix decodes), for streaming deltas."""
        content = completion.message.get("content") or ""
        if "tool_calls" in completion.message:
            return [content]
        ids = list(completion.turn.output_ids)
        while ids and ids[-1] in self.renderer.stop_ids:
            ids.pop()
        step = max(1, -(-len(ids) // STREAM_PIECES))
        pieces, sent = [], ""
        for end in [*range(step, len(ids), step), len(ids)]:
            text = self.renderer.tokenizer.decode(ids[:end], skip_special_tokens=False,
                                                  clean_up_tokenization_spaces=False)
            if text.endswith("\ufffd") and end < len(ids):  # a character split across tokens: wait for the rest
                continue
            if text.startswith(sent):
                pieces.append(text[len(sent):])
                sent = text
        return pieces if "".join(pieces) == content else [content]

    def token_texts(self, turn: TurnRecord) -> list[str]:
        return [self.renderer.tokenizer.decode([i], skip_special_tokens=False) for i in turn.output_ids]

    def finish_session(self, session_id: str, reward: float | dict[str, float], *, group_id: str | int | None = None,
                       metadata: dict[str, Any] | None = None) -> list[Sample]:
        """Consume the session and return its Samples (``UnknownSessionError`` if there is none)."""
        return self.manager.get_trajectory(session_id, reward=reward, group_id=group_id, extra_metadata=metadata)

    def finish(self, session_id: str, body: FinishRequest) -> dict[str, Any]:
        """``POST /sessions/{id}/finish``: the Samples as dicts (and, with ``return_turns``, the TurnRecords).

        Everything that could make the answer unsendable is checked before the session is consumed."""
        try:
            json.dumps(body.metadata, allow_nan=False)
        except ValueError:
            raise ValueError("metadata must not hold NaN or infinity (the answer is strict JSON)") from None
        turns = self.manager.turns(session_id) if body.return_turns else None
        samples = self.finish_session(session_id, body.reward, group_id=body.group_id, metadata=body.metadata)
        out: dict[str, Any] = {"samples": [s.to_dict() for s in samples]}
        if turns is not None:
            out["turns"] = [t.to_dict() for t in turns]
        return out


def session_id_of(request: ChatCompletionRequest, header: str | None) -> str:
    """The session a request belongs to: the ``X-Session-Id`` header, else the ``user`` field."""
    session = header or request.user
    if not session:
        raise RequestError("no session id: set the request's `user` field (or an X-Session-Id header) to the "
                           "episode's id; every turn of one episode must carry the same id", param="user",
                           code="missing_session_id")
    return session


def create_app(gateway: Gateway, *, on_shutdown: Callable[[], Any] | None = None) -> FastAPI:
    """The FastAPI app: ``/v1/chat/completions``, ``/v1/models`` (also without ``/v1``), ``/sessions/...``,
    ``/health``."""
    from fastapi import FastAPI, Header, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    from agentrl.rollout.client import GenerateRequestError, GenerateTimeoutError, RolloutClientError
    from agentrl.trajectory import UnknownSessionError
    from agentrl.trajectory.sample import NonFiniteRewardError

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if on_shutdown is not None:
            result = on_shutdown()
            if asyncio.iscoroutine(result):
                await result

    app = FastAPI(title="agentrl gateway", lifespan=lifespan)
    app.state.gateway = gateway

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, param=exc.param, code=exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg')}")
        return JSONResponse(error_body("invalid request: " + "; ".join(problems)), status_code=422)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list",
                "data": [{"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}]}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")  # for clients configured with a base URL without /v1
    async def chat_completions(body: ChatCompletionRequest,
                               x_session_id: str | None = Header(default=None)) -> Any:
        session_id = session_id_of(body, x_session_id)
        try:
            done = await gateway.complete(body, session_id)
        except GenerateRequestError as err:  # the engine refused the request (e.g. too long)
            return JSONResponse(error_body(f"engine rejected the request: {err.message}"), status_code=400)
        except GenerateTimeoutError as err:
            return JSONResponse(error_body(str(err), kind="timeout"), status_code=504)
        except RolloutClientError as err:  # engines unreachable after retries, or a malformed answer
            return JSONResponse(error_body(str(err), kind="engine_unavailable"), status_code=503)
        headers = {"X-Session-Id": session_id, "X-Agentrl-Turn": str(done.turn_index),
                   "X-Agentrl-Outcome": done.outcome}
        model = body.model or gateway.model_name
        prompt_tokens, completion_tokens = len(done.turn.prompt_ids), len(done.turn.output_ids)
        if body.stream:
            chunks = stream_chunks(completion_id=done.completion_id, model=model, message=done.message,
                                   content_pieces=gateway.content_pieces(done), finish=done.finish,
                                   prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                   include_usage=body.include_usage)

            async def events():
                for event in sse(chunks):
                    yield event

            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        logprobs = None
        if body.logprobs and done.turn.output_logprobs:
            logprobs = logprobs_content(gateway.token_texts(done.turn), done.turn.output_logprobs)
        return JSONResponse(completion_body(completion_id=done.completion_id, model=model, message=done.message,
                                            finish=done.finish, prompt_tokens=prompt_tokens,
                                            completion_tokens=completion_tokens, logprobs=logprobs),
                            headers=headers)

    @app.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, body: FinishRequest) -> Any:
        try:
            return JSONResponse(gateway.finish(session_id, body))
        except UnknownSessionError:
            return JSONResponse(error_body(
                f"unknown session {session_id!r}: no turn was recorded under this id, or it was already "
                "finished (finish consumes the session)", code="session_not_found"), status_code=404)
        except NonFiniteRewardError as err:
            return JSONResponse(error_body(f"{err}; the session is still open, finish it again with a finite "
                                           "reward", param="reward", code="non_finite_reward"), status_code=400)
        except (TypeError, ValueError) as err:
            return JSONResponse(error_body(str(err)), status_code=400)

    @app.get("/sessions")
    async def sessions() -> dict[str, Any]:
        manager = gateway.manager
        return {"sessions": [{"id": s, "turns": manager.turn_count(s)} for s in manager.sessions],
                "stats": manager.stats}

    @app.delete("/sessions/{session_id}")
    async def drop(session_id: str) -> Any:
        try:
            gateway.manager.drop_session(session_id)
        except UnknownSessionError:
            return JSONResponse(error_body(f"unknown session {session_id!r}", code="session_not_found"),
                                status_code=404)
        return {"dropped": session_id}

    return app


# ---- command line -----------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrl gateway", description=__doc__.splitlines()[0])
    p.add_argument("--router", required=True, help="smg router (or one engine) base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", required=True, help="local HF model directory (its tokenizer and chat template)")
    p.add_argument("--port", type=int, default=8000, help="port to serve on (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--policy", default="realign",
                   help="drift policy: realign (default), fork, truncate, or module:Class")
    p.add_argument("--fork-threshold-tokens", type=int, default=1024,
                   help="realign: drifted tokens above this fork instead (default 1024)")
    p.add_argument("--served-model-name", default=None, help="model id reported by /v1/models (default: dir name)")
    p.add_argument("--context-length", type=int, default=None,
                   help="the model's context (default: max_position_embeddings of config.json)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per /generate attempt (default 300)")
    return p


def _check_args(args: argparse.Namespace) -> str | None:
    from agentrl.rollout.serve import model_and_port_problem
    from agentrl.trajectory import make_policy

    problem = model_and_port_problem(args.model, args.port)
    if problem:
        return problem
    if not args.router.startswith(("http://", "https://")):
        return f"--router must be an http(s) URL, got {args.router!r}"
    try:
        make_policy(args.policy, args.fork_threshold_tokens)
    except (ValueError, TypeError, ImportError, AttributeError) as err:
        return f"--policy: {err}"
    if args.context_length is not None and args.context_length < 2:
        return f"--context-length must be >= 2, got {args.context_length}"
    return None


def _reachable(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url.rstrip("/") + "/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def build_gateway(router_url: str, model_dir: str | Path, *, policy: str = "realign",
                  fork_threshold_tokens: int = 1024, context_length: int | None = None,
                  served_model_name: str | None = None, timeout: float = 300.0) -> tuple[Gateway, Any]:
    """A :class:`Gateway` generating through a :class:`RolloutClient` on ``router_url``, and that client."""
    from transformers import AutoTokenizer

    from agentrl.engine.protocol import context_length_of
    from agentrl.rollout.client import RolloutClient

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    client = RolloutClient(router_url, timeout=timeout)
    gateway = Gateway(tokenizer, client.generate_turn, policy=policy, fork_threshold_tokens=fork_threshold_tokens,
                      context_length=context_length or context_length_of(model_dir),
                      model_name=served_model_name or Path(model_dir).resolve().name)
    return gateway, client


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = _check_args(args)
    if problem:
        print(f"agentrl gateway: {problem}", file=sys.stderr)
        return 2
    import uvicorn

    gateway, client = build_gateway(args.router, args.model, policy=args.policy,
                                    fork_threshold_tokens=args.fork_threshold_tokens,
                                    context_length=args.context_length, served_model_name=args.served_model_name,
                                    timeout=args.timeout)
    if not _reachable(args.router):
        print(f"agentrl gateway: warning: {args.router}/health does not answer yet; requests fail with 503 "
              "until it does", file=sys.stderr)
    app = create_app(gateway, on_shutdown=client.aclose)
    print(f"agentrl gateway: http://{args.host}:{args.port}/v1 -> {args.router} (model {gateway.model_name}, "
          f"policy {gateway.manager.policy.name}); session id = the request's `user` field", file=sys.stderr,
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
