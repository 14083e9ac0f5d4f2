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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.rollout.gateway_openai import (
    ChatCompletionRequest,
    FinishRequest,
    RequestError,
    check_finish_reward,
    finish_reason,
    new_call_id,
    new_completion_id,
    normalize_message,
    normalize_messages,
    sampling_params,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from agentrl.envs.formats import ThinkParser, ToolCallFormat
    from agentrl.envs.loop import Generate
    from agentrl.envs.render import ChatRenderer
    from agentrl.trajectory import DriftPolicy, Sample, TrajectoryManager, TurnRecord

SESSION_HEADER = "x-session-id"
STREAM_PIECES = 256  # at most this many content deltas per streamed reply (each is one prefix decode)
REASONING_PARSERS = ("auto", "think", "none")


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


@dataclass
class Episode:
    """A session a training run handed to an external agent (:meth:`Gateway.open_episode`).

    Its turns are generated with ``generate`` and recorded into ``manager`` (the run's, so the batch
    proof sees them); ``sampling`` replaces the agent's temperature and top-p and caps its token budget
    (the trainer computes log-probs at the run's temperature). What the gateway served is kept here for
    the run: the replies in order, the last transcript, counts, the agent's finish call. The run, not the
    gateway, decides when the episode is over."""

    session_id: str
    manager: TrajectoryManager
    generate: Generate
    sampling: dict[str, Any]
    max_turns: int | None = None
    tool_format: ToolCallFormat | None = None  # the environment's, over the gateway's
    replies: list[dict[str, Any]] = field(default_factory=list)
    malformed: list[int] = field(default_factory=list)  # malformed calls of each reply
    transcript: list[dict[str, Any]] = field(default_factory=list)  # the last request's messages + its reply
    turns: int = 0
    prompt_tokens: int = 0  # of the first turn
    generated_tokens: int = 0
    malformed_turns: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    finish: FinishRequest | None = None  # the agent's finish call, if it made one
    hit_turn_limit: bool = False  # a request past max_turns was refused
    dropped: bool = False  # the agent dropped the session (DELETE /sessions/<id>)

    def params(self, requested: dict[str, Any]) -> dict[str, Any]:
        """The agent's sampling parameters with the run's ``sampling`` forced over them: the temperature is
        the run's, top-p is dropped, ``max_new_tokens`` is at most the run's (stop strings and seed stay)."""
        params = {k: v for k, v in requested.items() if k in ("stop", "sampling_seed", "max_new_tokens")}
        params["temperature"] = self.sampling.get("temperature", 1.0)
        cap = self.sampling.get("max_new_tokens")
        if cap is not None:
            params["max_new_tokens"] = min(params.get("max_new_tokens", cap), cap)
        return params


class Gateway:
    """The state behind the HTTP app: renderer, tool-call format, ``generate`` and the trajectory manager.

    ``generate`` is any ``async (input_ids, *, session_id, sampling_params) -> TurnRecord`` — in production
    :meth:`RolloutClient.generate_turn`, in tests a scripted policy. All manager calls happen on the event
    loop, so the manager needs no lock. Prompts are tokenized in a worker thread: do not hand the same
    tokenizer object to code that encodes on another thread (a HF fast tokenizer switches shared backend
    state per call for ``split_special_tokens``, so concurrent encodes can corrupt each other).

    ``tool_format``: a format, a name of :func:`~agentrl.envs.formats.get_tool_call_format` or a
    ``module:attr`` path (default: the one the chat template speaks). ``reasoning``: ``auto`` (split a
    ``<think>`` block into ``reasoning_content`` when the chat template has one), ``think``, ``none``, or a
    :class:`~agentrl.envs.formats.ThinkParser`. ``chat_template_kwargs``: passed to every render (a
    request's own ``chat_template_kwargs`` override them).

    Training mode (``episodes_only``): only sessions opened with :meth:`open_episode` are served, an agent
    slot's base URL (``/agents/<slot>/v1``) names the slot's open episode, and with ``api_key`` every
    request must carry ``Authorization: Bearer <api_key>``.
    """

    def __init__(self, tokenizer: Any, generate: Generate, *, policy: str | DriftPolicy = "realign",
                 fork_threshold_tokens: int = 1024, context_length: int | None = None,
                 model_name: str = "agentrl", tool_format: ToolCallFormat | str | None = None,
                 reasoning: str | ThinkParser | None = "auto", chat_template_kwargs: dict[str, Any] | None = None,
                 trajectory_manager: TrajectoryManager | None = None, episodes_only: bool = False,
                 api_key: str | None = None) -> None:
        from agentrl.envs.environment import choose_tool_format
        from agentrl.envs.formats import ThinkParser
        from agentrl.trajectory import TrajectoryManager

        if not isinstance(reasoning, ThinkParser) and reasoning not in (*REASONING_PARSERS, None):
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {reasoning!r}")

        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._renderers: dict[str, ChatRenderer] = {}
        self.renderer = self._renderer_for(None)
        self.tool_format = choose_tool_format(tool_format, tokenizer)
        self.reasoning = reasoning
        self.generate = generate
        self.manager = trajectory_manager if trajectory_manager is not None else TrajectoryManager(
            policy=policy, fork_threshold_tokens=fork_threshold_tokens)
        self.context_length = context_length
        self.model_name = model_name
        self.episodes: dict[str, Episode] = {}
        self.slots: dict[str, str] = {}  # agent slot -> the session id of its open episode
        self.episodes_only = episodes_only
        self.api_key = api_key
        # Renders run in worker threads (off the event loop); one at a time, because a HF fast tokenizer
        # is not guaranteed to be safe under concurrent calls.
        self._render_lock = threading.Lock()

    # ---- training mode: episodes a run hands out ---------------------------------------------------
    def open_episode(self, episode: Episode, *, slot: str | None = None) -> None:
        """Serve ``episode`` (under its session id, and under ``slot``'s base URL when given)."""
        if episode.session_id in self.episodes:
            raise ValueError(f"episode {episode.session_id!r} is already open")
        self.episodes[episode.session_id] = episode
        if slot is not None:
            self.slots[slot] = episode.session_id

    def close_episode(self, session_id: str) -> Episode | None:
        """Stop serving ``session_id``; a turn still in flight for it is then not recorded."""
        episode = self.episodes.pop(session_id, None)
        for slot in [s for s, sid in self.slots.items() if sid == session_id]:
            del self.slots[slot]
        return episode

    def session_of_slot(self, slot: str) -> str:
        session = self.slots.get(slot)
        if session is None:
            raise RequestError(f"agent slot {slot!r} has no open episode (its episode ended, or it was never "
                               "given one)", code="no_open_episode")
        return session

    # ---- rendering ---------------------------------------------------------------------------------
    def _renderer_for(self, overrides: dict[str, Any] | None) -> ChatRenderer:
        from agentrl.envs.render import ChatRenderer

        kwargs = {**self.chat_template_kwargs, **(overrides or {})}
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in self._renderers:
            if len(self._renderers) >= 16:  # bounded: a client could send endless variations
                raise RequestError("too many distinct chat_template_kwargs", param="chat_template_kwargs")
            self._renderers[key] = ChatRenderer(self.tokenizer, **kwargs)
        return self._renderers[key]

    def _render(self, renderer: ChatRenderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None):
        with self._render_lock:
            return renderer.render(messages, tools)

    async def complete(self, request: ChatCompletionRequest, session_id: str) -> Completion:
        """Render, generate, parse and record one turn of ``session_id``."""
        request.check_supported()
        episode = self.episodes.get(session_id)
        if episode is None and self.episodes_only:
            raise RequestError(f"unknown episode {session_id!r}: the run serves only the episodes it handed out "
                               "(or this one has ended)", param="user", code="unknown_episode")
        if episode is not None and episode.max_turns is not None and episode.turns >= episode.max_turns:
            episode.hit_turn_limit = True
            raise RequestError(f"the episode's turn limit ({episode.max_turns}) is reached", code="turn_limit")
        messages = normalize_messages(request.messages)
        renderer = self._renderer_for(request.chat_template_kwargs)
        try:  # tokenizing a long history is CPU work: keep the event loop free for other sessions
            rendered = await asyncio.to_thread(self._render, renderer, messages, request.tools)
        except RequestError:
            raise
        except Exception as err:  # the template refused these messages (e.g. a role order it forbids)
            raise RequestError(f"the chat template cannot render these messages: {type(err).__name__}: {err}",
                               param="messages") from err
        params = sampling_params(request, len(rendered.ids), self.context_length)
        generate, manager = (episode.generate, episode.manager) if episode is not None else (self.generate, self.manager)
        if episode is not None:
            params = episode.params(params)
        turn = await generate(rendered.ids, session_id=session_id, sampling_params=params)
        if episode is not None and self.episodes.get(session_id) is not episode:
            raise RequestError(f"episode {session_id!r} ended while this turn was generated; it is not recorded",
                               code="episode_ended")
        text = renderer.decode_response(list(turn.output_ids))
        fmt = episode.tool_format if episode is not None and episode.tool_format is not None else self.tool_format
        message, malformed = self._reply(text, parse=request.parse_tool_calls, fmt=fmt,
                                         think=self.think_parser(renderer, rendered.text))
        index = manager.turn_count(session_id) if manager.has_session(session_id) else 0
        outcome = manager.record_turn(
            session_id, turn=turn, prompt_messages=messages, response_message=message,
            metadata={"tool_calls": [c["function"]["name"] for c in message.get("tool_calls", [])],
                      "malformed_calls": malformed},
        )
        done = Completion(new_completion_id(), session_id, message,
                          finish_reason(turn.finish_reason, "tool_calls" in message), turn, index, outcome, malformed)
        if episode is not None:
            if episode.turns == 0:
                episode.prompt_tokens = len(turn.prompt_ids)
            episode.turns += 1
            episode.generated_tokens += len(turn.output_ids)
            episode.malformed_turns += int(malformed > 0)
            episode.finish_reasons[turn.finish_reason] += 1
            episode.outcomes[outcome] += 1
            episode.replies.append(message)
            episode.malformed.append(malformed)
            episode.transcript = [*messages, message]
        return done

    def think_parser(self, renderer: ChatRenderer, prompt_text: str) -> ThinkParser | None:
        """The parser splitting reasoning off this reply: ``auto`` = the renderer's (a ``<think>`` parser
        when the chat template thinks), ``think`` = always one, ``none`` = never. It starts inside the
        block when the prompt left one open."""
        from agentrl.envs.formats import ThinkParser

        if isinstance(self.reasoning, ThinkParser):
            parser: ThinkParser | None = self.reasoning
        elif self.reasoning == "auto":
            parser = renderer.reasoning_parser()
        else:
            parser = ThinkParser() if self.reasoning == "think" else None
        if parser is not None and not parser.starts_inside and prompt_text.rstrip().endswith(parser.open_tag):
            parser = replace(parser, starts_inside=True)
        return parser

    def _reply(self, text: str, *, parse: bool, fmt: ToolCallFormat | None = None,
               think: ThinkParser | None = None) -> tuple[dict[str, Any], int]:
        """The OpenAI assistant message of a reply, normalised as an echoed history message would be, and the
        number of malformed calls. A reply with a malformed call is returned as plain text (like vLLM):
        the agent sees exactly what the model said. With a think parser the reasoning block goes to
        ``reasoning_content`` (calls written inside it are drafts, not parsed)."""
        reasoning = ""
        if think is not None:
            reasoning, text = think.split(text)
        extra = {"reasoning_content": reasoning} if reasoning else {}
        if not parse:
            return normalize_message({"role": "assistant", "content": text, **extra}), 0
        parsed = (fmt or self.tool_format).parse(text)
        if parsed.errors or not parsed.calls:
            return normalize_message({"role": "assistant", "content": text, **extra}), len(parsed.errors)
        reasoning = "\n".join(r for r in (parsed.reasoning, reasoning) if r)  # e.g. gpt-oss's analysis channel
        extra = {"reasoning_content": reasoning} if reasoning else {}
        message = {"role": "assistant", "content": parsed.content or None,
                   "tool_calls": [call.to_openai(new_call_id()) for call in parsed.calls], **extra}
        return normalize_message(message), 0

    def content_pieces(self, completion: Completion) -> list[str]:
        """The reply content split at token boundaries, for streaming deltas: per-token decodes grouped
        into at most ``STREAM_PIECES`` pieces when they join to the content (one batched decode), else
        prefix decodes (a character split across tokens, or a tokenizer that drops leading spaces alone)."""
        content = completion.message.get("content") or ""
        if "tool_calls" in completion.message:
            return [content]
        ids = list(completion.turn.output_ids)
        while ids and ids[-1] in self.renderer.stop_ids:
            ids.pop()
        step = max(1, -(-len(ids) // STREAM_PIECES))
        tokenizer = self.renderer.tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)  # one Rust call: a fifth of batch_decode's time
        texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=False) if backend is not None else \
            tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if "".join(texts) == content:
            return ["".join(texts[start:start + step]) for start in range(0, len(texts), step)]
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

        Everything that could make the answer unsendable is checked before the session is consumed. An
        open episode (training mode) is not consumed: the call is kept as its reward and the run trains
        the samples, so the answer holds none."""
        from agentrl.trajectory import UnknownSessionError

        check_finish_reward(body.reward)
        try:
            json.dumps(body.metadata, allow_nan=False)
        except ValueError:
            raise ValueError("metadata must not hold NaN or infinity (the answer is strict JSON)") from None
        episode = self.episodes.get(session_id)
        if episode is not None:
            episode.finish = body
            return {"samples": [], "recorded": True}
        if self.episodes_only:
            raise UnknownSessionError(session_id)
        turns = self.manager.turns(session_id) if body.return_turns else None
        samples = self.finish_session(session_id, body.reward, group_id=body.group_id, metadata=body.metadata)
        out: dict[str, Any] = {"samples": [s.to_dict() for s in samples]}
        if turns is not None:
            out["turns"] = [t.to_dict() for t in turns]
        return out


def session_id_of(request: ChatCompletionRequest, header: str | None) -> str:
    """The session a request belongs to: the ``X-Session-Id`` header, else the ``user`` field."""
    from agentrl.rollout.gateway_routes import session_id_of as session_of

    return session_of(header, request.user)


def create_app(gateway: Gateway, *, on_shutdown: Callable[[], Any] | None = None) -> FastAPI:
    """The FastAPI app: ``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages``, ``/v1/models`` (each
    also without ``/v1``), ``/sessions/...``, ``/agents/<slot>/...``, ``/health``; the handlers are the
    routers of :mod:`agentrl.rollout.gateway_routes` and the protocol modules."""
    from fastapi import FastAPI

    from agentrl.rollout import gateway_routes as routes
    from agentrl.rollout.gateway_anthropic import MessagesRoutes
    from agentrl.rollout.gateway_responses import ResponsesRoutes

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if on_shutdown is not None:
            result = on_shutdown()
            if asyncio.iscoroutine(result):
                await result

    app = FastAPI(title="agentrl gateway", lifespan=lifespan)
    app.state.gateway = gateway
    routes.install_error_handlers(app)
    routes.install_api_key_check(app, gateway.api_key)
    for group in (routes.HealthRoutes, routes.ChatRoutes, ResponsesRoutes, MessagesRoutes, routes.SessionRoutes):
        app.include_router(group(gateway).router)
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
    p.add_argument("--tool-format", default=None,
                   help="tool-call format: hermes, qwen3, llama3_json, ... or module:attr (default: the chat "
                        "template's)")
    p.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                   help="split <think> blocks into reasoning_content: auto (when the chat template has one, "
                        "default), think, none")
    p.add_argument("--chat-template-kwargs", default=None, type=_json_object, metavar="JSON",
                   help='keyword arguments of the chat template, e.g. \'{"enable_thinking": false}\'')
    return p


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


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
    if args.tool_format is not None:
        from agentrl.envs.formats import get_tool_call_format

        try:
            get_tool_call_format(args.tool_format)
        except (ValueError, TypeError, ImportError, AttributeError) as err:
            return f"--tool-format: {err}"
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
                  served_model_name: str | None = None, timeout: float = 300.0,
                  tool_format: str | None = None, reasoning: str = "auto",
                  chat_template_kwargs: dict[str, Any] | None = None) -> tuple[Gateway, Any]:
    """A :class:`Gateway` generating through a :class:`RolloutClient` on ``router_url``, and that client."""
    from transformers import AutoTokenizer

    from agentrl.engine.protocol import context_length_of
    from agentrl.rollout.client import RolloutClient

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    client = RolloutClient(router_url, timeout=timeout)
    gateway = Gateway(tokenizer, client.generate_turn, policy=policy, fork_threshold_tokens=fork_threshold_tokens,
                      context_length=context_length or context_length_of(model_dir),
                      model_name=served_model_name or Path(model_dir).resolve().name, tool_format=tool_format,
                      reasoning=reasoning, chat_template_kwargs=chat_template_kwargs)
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
                                    timeout=args.timeout, tool_format=args.tool_format,
                                    reasoning=args.reasoning_parser, chat_template_kwargs=args.chat_template_kwargs)
    if not _reachable(args.router):
        print(f"agentrl gateway: warning: {args.router}/health does not answer yet; requests fail with 503 "
              "until it does", file=sys.stderr)
    app = create_app(gateway, on_shutdown=client.aclose)
    print(f"agentrl gateway: http://{args.host}:{args.port}/v1 -> {args.router} (model {gateway.model_name}, "
          f"policy {gateway.manager.policy.name}, tool format {gateway.tool_format.name}, reasoning parser "
          f"{args.reasoning_parser}); session id = the request's `user` field", file=sys.stderr,
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
