"""The agent loop, string-in / token-out, and the default rollout over many episodes.

One episode: ``messages = env.reset(task)``; then per turn render the messages with the chat template
(:class:`~agentrl.envs.render.ChatRenderer`), ``await generate(prompt_ids, session_id=...,
sampling_params=...)`` (a :class:`~agentrl.trajectory.TurnRecord` exactly as served), record the turn in
the :class:`~agentrl.trajectory.TrajectoryManager`, decode and parse the reply, run its tool calls and
append their results; until ``env.done`` or a limit. Then ``get_trajectory(reward=env.reward())``.

The loop never imports the rollout client: ``generate`` is any async callable with that signature, which
is also how users swap in their own sampling; ``rollout.episode_function`` replaces :func:`run_episode`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentrl.envs.environment import (
    Environment,
    PromptMode,
    ToolCallError,
    check_prompt_mode,
    choose_tool_format,
    maybe_await,
)
from agentrl.envs.formats import ParsedResponse, ToolCall, ToolCallFormat, detect_foreign_calls
from agentrl.envs.render import ChatRenderer
from agentrl.envs.rewards import combine_reward
from agentrl.plugins import load_function
from agentrl.trajectory import Sample, StopReason, TrajectoryManager, TurnRecord

log = logging.getLogger(__name__)


class TurnAbortedError(RuntimeError):
    """The engine aborted a turn (an engine error; a turn aborted for a weight update is sent again by the
    episode pool and never gets here). The episode fails: counted, no Sample. Its reward would judge a reply
    the policy never finished, and a 0 there would train the policy away from what it was saying."""


class Generate(Protocol):
    """``await generate(input_ids, session_id=..., sampling_params=...) -> TurnRecord``."""

    def __call__(self, input_ids: list[int], *, session_id: str,
                 sampling_params: dict[str, Any] | None = None) -> Awaitable[TurnRecord]: ...


EnvFactory = Callable[[], Environment]


@dataclass
class EpisodeMetrics:
    """What happened in one episode (``turns`` = model replies)."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    ill_formed_turns: int = 0  # replies with a malformed call (bad JSON, unknown tool, bad args) or a foreign one
    foreign_format_turns: int = 0  # replies with call markers of another format than the chosen one
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)  # when reward() names its parts
    stop_reason: StopReason | None = None  # set once the episode ends
    finish_reasons: dict[str, int] = field(default_factory=dict)
    drift: dict[str, int] = field(default_factory=dict)  # record_turn outcomes: new/clean/realigned/forked/...
    prompt_tokens: int = 0  # of the first prompt
    generated_tokens: int = 0
    samples: int = 0
    seconds: float = 0.0
    error: str | None = None
    error_type: str | None = None  # the exception's class, e.g. NonFiniteRewardError (rollout/failure_reasons)


def _component_means(parts: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({k for p in parts for k in p})
    return {k: sum(p[k] for p in parts if k in p) / sum(1 for p in parts if k in p) for k in names}


@dataclass
class EpisodeResult:
    """One episode: its Samples (usually one; more after a fork), metrics and the final chat."""

    session_id: str
    group_id: str
    task: Any
    samples: list[Sample]
    metrics: EpisodeMetrics
    messages: list[dict[str, Any]]


@dataclass
class RolloutResult:
    """Episodes of a batch, grouped per task."""

    groups: list[list[EpisodeResult]]  # one list per task, n samples each, sharing a group id

    @property
    def episodes(self) -> list[EpisodeResult]:
        return [episode for group in self.groups for episode in group]

    @property
    def samples(self) -> list[Sample]:
        return [sample for episode in self.episodes for sample in episode.samples]

    def summary(self) -> dict[str, Any]:
        """Means over episodes (reward: over those that did not fail, since a failed one has none; turns,
        tool calls), the ill-formed turn rate, failures (and their exception classes), and totals of stop
        reasons, finish reasons and drift outcomes."""
        episodes = self.episodes
        n = max(len(episodes), 1)
        scored = [e.metrics.reward for e in episodes if e.metrics.error is None]
        turns = sum(e.metrics.turns for e in episodes)
        stops: Counter[StopReason | None] = Counter(e.metrics.stop_reason for e in episodes)
        finishes: Counter[str] = Counter()
        drift: Counter[str] = Counter()
        for e in episodes:
            finishes.update(e.metrics.finish_reasons)
            drift.update(e.metrics.drift)
        return {
            "episodes": len(episodes),
            "samples": len(self.samples),
            "reward_mean": sum(scored) / max(len(scored), 1),
            "reward_components": _component_means([e.metrics.reward_components for e in episodes
                                                   if e.metrics.error is None]),
            "turns_mean": turns / n,
            "tool_calls_mean": sum(e.metrics.tool_calls for e in episodes) / n,
            "ill_formed_turn_rate": sum(e.metrics.ill_formed_turns for e in episodes) / max(turns, 1),
            "foreign_format_turn_rate": sum(e.metrics.foreign_format_turns for e in episodes) / max(turns, 1),
            "failed": sum(e.metrics.error is not None for e in episodes),
            "failure_reasons": dict(Counter(e.metrics.error_type or "unknown" for e in episodes
                                            if e.metrics.error is not None)),
            "stop_reasons": dict(stops),
            "finish_reasons": dict(finishes),
            "drift": dict(drift),
        }


async def run_episode(
    env: Environment,
    task: Any,
    generate: Generate,
    renderer: ChatRenderer,
    *,
    session_id: str,
    group_id: str | None = None,
    sampling_params: dict[str, Any] | None = None,
    trajectory_manager: TrajectoryManager | None = None,
    tool_format: ToolCallFormat | str | None = None,
    max_context_tokens: int | None = None,
    prompt_mode: PromptMode | None = None,
) -> EpisodeResult:
    """Play one episode of ``env`` on ``task`` and return its Samples and metrics.

    ``tool_format`` (default ``env.tool_format``) is the call syntax replies are parsed in; a reply whose
    calls are malformed, or that carries another format's call markers, is an ill-formed turn answered
    with a tool message naming the expected format — never a final answer. When the chat template thinks
    in ``<think>`` blocks, the reasoning is split off first: calls in it are not run and
    ``env.on_text_response`` gets the reply without it. ``prompt_mode`` (default ``env.prompt_mode``):
    ``"rerender"`` renders the whole chat each turn; ``"append"`` makes turn N's prompt the tokens turn
    N-1 held (its prompt and output, as served) plus the rendering of only the messages added since.

    ``max_context_tokens`` is the engine's context length; each reply's ``max_new_tokens`` is capped
    so that prompt + reply fits both it and ``env.max_total_tokens``. Failures of ``generate`` or of the
    environment's hooks propagate (the session is dropped and ``env.close()`` still runs), as does a NaN or
    infinite reward (:class:`~agentrl.trajectory.sample.NonFiniteRewardError`) and a turn the engine aborted
    (:class:`TurnAbortedError`); malformed tool calls never do.
    """
    manager = trajectory_manager if trajectory_manager is not None else TrajectoryManager()
    limits = [x for x in (max_context_tokens, env.max_context_tokens) if x]
    ep = _Episode(
        env=env, generate=generate, renderer=renderer, manager=manager, session_id=session_id,
        sampling_params=sampling_params,
        mode=check_prompt_mode(prompt_mode if prompt_mode is not None else env.prompt_mode),
        fmt=choose_tool_format(tool_format if tool_format is not None else env.tool_format, renderer.tokenizer),
        thinking=renderer.reasoning_parser(), context=min(limits) if limits else None,
    )
    started = time.perf_counter()
    messages: list[dict[str, Any]] = []
    try:
        env.task = task
        messages = ep.messages = list(await maybe_await(env.reset(task)))
        env.messages = messages
        ep.tools = env.tool_schemas()
        await _play_turns(ep)
        samples = await _finish(ep, group_id=group_id or session_id)
    except BaseException:
        if manager.has_session(session_id):
            manager.drop_session(session_id)
        raise
    finally:
        ep.metrics.finish_reasons = dict(ep.finish)
        ep.metrics.drift = dict(ep.drift)
        ep.metrics.seconds = time.perf_counter() - started
        await maybe_await(env.close())
    return EpisodeResult(session_id=session_id, group_id=group_id or session_id, task=task, samples=samples,
                         metrics=ep.metrics, messages=messages)


@dataclass
class _Episode:
    """One episode's fixed inputs and the state its turns carry forward."""

    env: Environment
    generate: Generate
    renderer: ChatRenderer
    manager: TrajectoryManager
    session_id: str
    sampling_params: dict[str, Any] | None
    mode: PromptMode
    fmt: ToolCallFormat
    thinking: Any  # the chat template's reasoning parser, or None
    context: int | None  # the binding context length (engine's or env's)
    tools: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    metrics: EpisodeMetrics = field(default_factory=EpisodeMetrics)
    finish: Counter[str] = field(default_factory=Counter)
    drift: Counter[str] = field(default_factory=Counter)
    held: list[int] | None = None  # append mode: the last turn's prompt + output, as served
    reply_closed: bool = True  # the last reply ended with a stop token
    new_from: int = 0  # messages from here on were added after the last turn
    last_finish: str | None = None


def _stop_before_turn(ep: _Episode) -> StopReason | None:
    """Why no further turn is played (the env is done, or max turns reached), or None."""
    if ep.env.done:
        return ep.metrics.stop_reason or StopReason.DONE
    if ep.metrics.turns >= ep.env.max_turns:
        return StopReason.MAX_TURNS
    return None


def _next_prompt(ep: _Episode) -> list[int]:
    """The next turn's prompt: the whole chat rendered, or in append mode the held tokens plus the
    rendering of only the messages added since."""
    if ep.mode == "append" and ep.held is not None:
        return ep.held + ep.renderer.render_continuation(ep.messages, ep.new_from, ep.tools,
                                                         reply_closed=ep.reply_closed)
    return ep.renderer.render(ep.messages, ep.tools).ids


def _capped_params(sampling_params: dict[str, Any] | None, budget: int | None) -> dict[str, Any]:
    """``sampling_params`` with ``max_new_tokens`` capped at ``budget`` (None: no cap)."""
    params = dict(sampling_params or {})
    if budget is not None:
        requested = params.get("max_new_tokens")
        params["max_new_tokens"] = budget if requested is None else min(requested, budget)
    return params


async def _play_turns(ep: _Episode) -> None:
    """Play turns until the env is done or a limit binds; sets ``ep.metrics.stop_reason`` for a limit."""
    while (stop := _stop_before_turn(ep)) is None:
        prompt_ids = _next_prompt(ep)
        if ep.metrics.turns == 0:
            ep.metrics.prompt_tokens = len(prompt_ids)
        budget, limit = _token_budget(len(prompt_ids), ep.context, ep.env.max_total_tokens)
        if budget is not None and budget <= 0:
            ep.metrics.stop_reason = limit
            return
        turn = await ep.generate(prompt_ids, session_id=ep.session_id,
                                 sampling_params=_capped_params(ep.sampling_params, budget))
        if turn.finish_reason == "abort":
            raise TurnAbortedError(f"the engine aborted turn {ep.metrics.turns + 1} of the episode")
        await _take_turn(ep, turn)
    ep.metrics.stop_reason = stop


async def _take_turn(ep: _Episode, turn: TurnRecord) -> None:
    """Parse ``turn``'s reply, run its calls, record the turn and extend the chat with reply and answers."""
    text = ep.renderer.decode_response(turn.output_ids)
    parsed = ep.thinking.parse(text, ep.fmt) if ep.thinking else ep.fmt.parse(text)
    foreign = detect_foreign_calls(parsed.content, ep.fmt) if parsed.content else []
    # The reply goes into the history exactly as recorded (raw sampled text, no parsed tool_calls
    # field): the next prompt re-tokenizes it canonically and the message tree finds its producer.
    reply = {"role": "assistant", "content": text}
    # Act before recording so the turn's metadata says whether any of its calls failed.
    # What the env reads: no reasoning (a <think> block, or a format's own, e.g. gpt-oss's analysis).
    answer = parsed.content if ep.thinking or parsed.reasoning else text
    answers, ill_formed = await _act(ep.env, parsed, answer, ep.metrics, fmt=ep.fmt, foreign=foreign, tools=ep.tools)
    outcome = ep.manager.record_turn(
        ep.session_id, turn=turn, prompt_messages=list(ep.messages), response_message=reply,
        metadata={"tool_calls": [c.name for c in parsed.calls], "malformed_calls": len(parsed.errors),
                  "foreign_formats": foreign, "ill_formed": ill_formed},
    )
    ep.drift[outcome] += 1
    ep.messages.append(reply)
    ep.held = [*turn.prompt_ids, *turn.output_ids]
    ep.reply_closed = bool(turn.output_ids) and turn.output_ids[-1] in ep.renderer.stop_ids
    ep.new_from = len(ep.messages)
    ep.metrics.turns += 1
    ep.metrics.generated_tokens += len(turn.output_ids)
    ep.last_finish = turn.finish_reason
    ep.finish[ep.last_finish] += 1
    ep.messages.extend(answers)


async def _finish(ep: _Episode, *, group_id: str) -> list[Sample]:
    """Score the episode and build its Samples (none when no turn was played)."""
    metrics = ep.metrics
    # NaN or inf would poison every weight it reaches: the episode fails (no Sample), even with no turn.
    metrics.reward, metrics.reward_components = combine_reward(await maybe_await(ep.env.reward()),
                                                               ep.env.reward_weights)
    if metrics.stop_reason == StopReason.NO_TOOL_CALL and ep.last_finish == "length":
        metrics.stop_reason = StopReason.LENGTH  # the final reply was cut off, not finished
    samples = [] if metrics.turns == 0 else ep.manager.get_trajectory(  # zero turns: nothing to train
        ep.session_id, reward=metrics.reward, group_id=group_id, stop_reason=metrics.stop_reason,
        extra_metadata={"episode_turns": metrics.turns, "tool_calls": metrics.tool_calls,
                        "ill_formed_turns": metrics.ill_formed_turns,
                        "reward_components": metrics.reward_components},
    )
    metrics.samples = len(samples)
    return samples


async def _act(env: Environment, parsed: ParsedResponse, text: str, metrics: EpisodeMetrics, *,
               fmt: ToolCallFormat, foreign: list[str], tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """Tool messages answering the reply ``text`` (its calls' results, malformed-call errors and a note on
    calls written in a ``foreign`` format), and whether the reply was ill-formed (a malformed call, a
    foreign-format call, or a call the environment refused)."""
    out: list[dict[str, Any]] = []
    ill_formed = bool(parsed.errors or foreign)
    for error in parsed.errors:
        out.append({"role": "tool", "content": f"Error: {error}"})
    if foreign:
        metrics.foreign_format_turns += 1
        names = " or ".join(foreign)
        out.append({"role": "tool", "content": f"Error: this reply writes a tool call in the {names} format, "
                                               "which is not read here; nothing was run"})
    if out:  # the last error says how a call must look
        out[-1]["content"] = f"{out[-1]['content'].rstrip('. ')}. {_format_hint(fmt, tools)}"
    for call in parsed.calls:
        if env.done:  # a call after the one that ended the episode is not run
            break
        metrics.tool_calls += 1
        try:
            result = await env.call_tool(call)
        except ToolCallError as err:
            metrics.tool_errors += 1
            ill_formed = True
            result = f"Error: {err}"
        out.append({"role": "tool", "name": call.name, "content": result})
    metrics.ill_formed_turns += int(ill_formed)
    if not parsed.calls and not ill_formed:
        more = await maybe_await(env.on_text_response(text))
        out.extend(more or [])
        if not more and not env.done:
            env.done = True
        if env.done:
            metrics.stop_reason = StopReason.NO_TOOL_CALL
    elif env.done:
        metrics.stop_reason = StopReason.DONE
    return out, ill_formed


def _format_hint(fmt: ToolCallFormat, tools: list[dict[str, Any]]) -> str:
    """"Tool calls use the <name> format, e.g. <a call of the first tool, as that format writes it>"."""
    spec = (tools[0].get("function", tools[0]) if tools else {}) or {}
    arguments = {k: "..." for k in (spec.get("parameters") or {}).get("properties", {})}
    example = fmt.render_calls([ToolCall(name=spec.get("name") or "tool_name", arguments=arguments)])
    return f"Tool calls use the {fmt.name} format, e.g. {example}"


def _token_budget(prompt_len: int, context: int | None,
                  max_total: int | None) -> tuple[int | None, StopReason | None]:
    """New tokens allowed after a prompt of ``prompt_len``, and which limit binds."""
    options = []
    if context is not None:
        options.append((context - prompt_len, StopReason.CONTEXT_LENGTH))
    if max_total is not None:
        options.append((max_total - prompt_len, StopReason.MAX_TOTAL_TOKENS))
    if not options:
        return None, None
    return min(options)


async def generate_rollout(
    env_factory: EnvFactory,
    tasks: Sequence[Any],
    generate: Generate,
    renderer: ChatRenderer,
    *,
    n_samples_per_task: int = 1,
    concurrency: int = 32,
    sampling_params: dict[str, Any] | None = None,
    trajectory_manager: TrajectoryManager | None = None,
    tool_format: ToolCallFormat | str | None = None,
    max_context_tokens: int | None = None,
    episode_fn: Callable[..., Awaitable[EpisodeResult]] | str | None = None,
    prompt_mode: PromptMode | None = None,
) -> RolloutResult:
    """Run ``n_samples_per_task`` episodes per task (a GRPO group sharing one group id), at most
    ``concurrency`` at a time. An episode that raises is reported (``metrics.error``, no samples)
    instead of cancelling the others.

    ``episode_fn`` (a function or ``"pkg.mod:fn"``) replaces :func:`run_episode` per sample with the
    same signature — the per-sample generate plug-in. ``tool_format`` and ``prompt_mode`` override each
    environment's (see :func:`run_episode`).
    """
    if n_samples_per_task < 1 or concurrency < 1:
        raise ValueError("n_samples_per_task and concurrency must be >= 1")
    play = load_function(episode_fn) if isinstance(episode_fn, str) else (episode_fn or run_episode)
    manager = trajectory_manager if trajectory_manager is not None else TrajectoryManager()
    fmt = None if tool_format is None else choose_tool_format(tool_format, renderer.tokenizer)  # fail before any episode
    if prompt_mode is not None:
        check_prompt_mode(prompt_mode)
    # Passed on only when set, so an episode function written before prompt modes keeps working.
    mode = {} if prompt_mode is None else {"prompt_mode": prompt_mode}
    gate = asyncio.Semaphore(concurrency)
    rollout_id = uuid.uuid4().hex[:8]

    async def one(task: Any, group_id: str, index: int) -> EpisodeResult:
        session_id = f"{group_id}-{index}"
        async with gate:
            env = None
            try:
                env = env_factory()
                return await play(env, task, generate, renderer, session_id=session_id, group_id=group_id,
                                  sampling_params=sampling_params, trajectory_manager=manager,
                                  tool_format=fmt, max_context_tokens=max_context_tokens, **mode)
            except Exception as err:
                log.warning("episode %s failed: %s: %s", session_id, type(err).__name__, err, exc_info=err)
                if manager.has_session(session_id):  # a custom episode function may not have cleaned up
                    manager.drop_session(session_id)
                metrics = EpisodeMetrics(stop_reason=StopReason.ERROR, error=f"{type(err).__name__}: {err}",
                                         error_type=type(err).__name__)
                return EpisodeResult(session_id=session_id, group_id=group_id, task=task, samples=[],
                                     metrics=metrics, messages=list(getattr(env, "messages", [])))

    groups = []
    for t, task in enumerate(tasks):
        group_id = f"{rollout_id}-g{t}"
        groups.append([one(task, group_id, i) for i in range(n_samples_per_task)])
    flat = await asyncio.gather(*(c for group in groups for c in group))
    it = iter(flat)
    return RolloutResult(groups=[[next(it) for _ in range(n_samples_per_task)] for _ in tasks])
