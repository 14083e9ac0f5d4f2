"""A pool of episodes always in flight, for fully asynchronous training.

The pool keeps up to ``concurrency`` episodes running, drawing tasks from a task source batch by batch;
an episode's group (``samples_per_prompt`` episodes of one task) is proved and becomes *ready* when its
last episode ends. :meth:`EpisodePool.take` hands out the next batch of ready groups while the others
keep running: weights then change *between turns* of episodes in flight, so one sample may hold turns
of several weight versions; each turn's version is the one the engine reported for it, and so is each
of its tokens' (:func:`agentrl.rollout.buffer.trained_token_versions`).

A weight update goes through :meth:`pause` / :meth:`resume`. The pool's :class:`WeightGate` stops new
turns from starting, then either waits for the turns being generated to finish on the old weights
(``partial_rollout="continue"``) or has the engines abort them (``"abort"``); an aborted turn is sent
again, once the gate reopens, on the new weights: its episode keeps its finished turns and is never
lost. Either way no turn is sampled by two weight versions, and the engines are paused (SGLang's
``/pause_generation``) while the weights change, so no forward pass sees half an update.

:meth:`take` enforces the staleness bound: a group with a trained token more than ``max_staleness``
versions behind the weights being trained is dropped or generated again (``stale_groups``). With
``dynamic_sampling`` it keeps taking groups until ``groups_per_batch`` of them pass the group filter
(DAPO's dynamic sampling), considering at most ``max_oversample`` x ``groups_per_batch`` groups.

Each batch's metrics carry, as ``env/<name>``, what the environment's class-level ``rollout_metrics()``
hook reports (its own infrastructure since the last call, e.g. sandbox timings), as the synchronous
rollout's do (:meth:`agentrl.rollout.manager.RolloutManager.rollout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from agentrl.rollout.buffer import GroupFilter, group_lag, staleness_metrics
from agentrl.trajectory import Sample, StopReason, TurnRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSettings:
    """How the pool runs (each field is a run setting of the same name, see ``docs/config.md``)."""

    samples_per_prompt: int
    prompts_per_batch: int  # tasks read per batch of the task source
    groups_per_batch: int  # groups handed out by one take
    concurrency: int  # episodes in flight
    max_staleness: int
    stale_groups: Literal["drop", "regenerate"] = "drop"
    partial_rollout: Literal["continue", "abort"] = "continue"
    dynamic_sampling: bool = False
    max_oversample: float = 2.0
    temperature: float = 1.0
    max_new_tokens: int = 48

    def __post_init__(self) -> None:
        if min(self.samples_per_prompt, self.prompts_per_batch, self.groups_per_batch, self.concurrency) < 1:
            raise ValueError("samples_per_prompt, prompts_per_batch, groups_per_batch and concurrency must be >= 1")
        if self.max_staleness < 0 or self.max_oversample < 1:
            raise ValueError("max_staleness must be >= 0 and max_oversample >= 1")
        if self.stale_groups not in ("drop", "regenerate") or self.partial_rollout not in ("continue", "abort"):
            raise ValueError(f"stale_groups {self.stale_groups!r} / partial_rollout {self.partial_rollout!r}")


class WeightGate:
    """Turns enter while the gate is open; :meth:`close` bumps the epoch and (``drain``) waits until no
    turn is in flight. A turn that finds the epoch changed when it returns overlapped a weight update."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self.epoch = 0
        self.busy_s = 0.0  # wall time with at least one turn in flight (the engines had work)
        self._busy_since: float | None = None

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def enter(self) -> int:
        while not self._open.is_set():
            await self._open.wait()
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1
        self._idle.clear()
        return self.epoch

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()
            if self._busy_since is not None:
                self.busy_s += time.monotonic() - self._busy_since
                self._busy_since = None

    def busy_seconds(self) -> float:
        running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self.busy_s + running

    async def close(self, *, drain: bool) -> None:
        self._open.clear()
        self.epoch += 1
        if drain:
            await self._idle.wait()

    def open(self) -> None:
        self._open.set()


@dataclass
class _Group:
    group_id: str
    task: Any
    size: int
    episodes: list[Any] = field(default_factory=list)  # EpisodeResult
    samples: list[Sample] = field(default_factory=list)  # proved
    proof: dict[str, float] = field(default_factory=dict)


@dataclass
class _Batch:
    """The batch being assembled across :meth:`EpisodePool.take` calls."""

    kept: list[_Group] = field(default_factory=list)
    considered: list[_Group] = field(default_factory=list)  # fresh groups looked at (kept or filtered)
    stale: int = 0
    regenerated: int = 0
    started: float = field(default_factory=time.monotonic)


Pauser = Callable[[str], Any]  # engine-side pause(mode) / continue (mode "") — blocking, run in a thread


class EpisodePool:
    """Episodes of ``env_factory`` on tasks of ``task_source`` (``.train(n, index)``), always in flight.

    ``generate`` is the rollout client's ``generate_turn``; ``engine_control(mode)`` pauses the engines
    (``mode`` ``"abort"`` or ``"in_place"``) and ``engine_control("")`` continues them (None: no engine
    call, for tests without engines). ``first_batch``: the task-source index of the first batch read.
    The ``rollout_metrics`` hook is looked up on the classes of the environments made: ``env_factory``
    may be a wrapper (the rollout manager's, which applies the run's settings) that has no hooks itself.
    """

    def __init__(self, *, env_factory: Callable[[], Any], renderer: Any, generate: Callable[..., Any],
                 task_source: Any, settings: PoolSettings, group_filter: GroupFilter, policy: str = "realign",
                 max_context_tokens: int | None = None, engine_control: Pauser | None = None,
                 first_batch: int = 0) -> None:
        from agentrl.rollout.proof import RecordingTrajectoryManager

        self.env_factory, self.renderer, self._client_generate = env_factory, renderer, generate
        self.task_source, self.settings, self.group_filter = task_source, settings, group_filter
        self.max_context_tokens = max_context_tokens
        self.engine_control = engine_control
        self.next_batch = first_batch
        self.trajectories = RecordingTrajectoryManager(policy=policy)
        self.gate = WeightGate()
        self.queue: deque[tuple[_Group, int]] = deque()  # (group, episode index) not yet started
        self.ready: deque[_Group] = deque()  # proved groups, in completion order
        self.running: set[asyncio.Task] = set()
        self.open_groups = 0  # groups with an episode queued or running
        self._changed = asyncio.Event()
        self._batch = _Batch()
        self._pool_id = uuid.uuid4().hex[:6]
        self._groups_made = 0
        self.closed = False
        self.counts: Counter[str] = Counter()  # lifetime: episodes_started/ended, turns_aborted/requeued, ...
        self._since_take: Counter[str] = Counter()
        self._clock = (time.monotonic(), 0.0)  # (wall, busy) at the last take
        self._env_classes: dict[type, None] = {}  # classes of the environments made, in order (an ordered set)

    # -- filling -----------------------------------------------------------------------------------

    def _new_group(self, task: Any) -> _Group:
        self._groups_made += 1
        group = _Group(f"{self._pool_id}-g{self._groups_made}", task, self.settings.samples_per_prompt)
        self.open_groups += 1
        return group

    def _read_tasks(self) -> None:
        for task in self.task_source.train(self.settings.prompts_per_batch, self.next_batch):
            group = self._new_group(task)
            self.queue.extend((group, i) for i in range(group.size))
        self.next_batch += 1

    def _pump(self) -> None:
        """Start episodes while there is room; read the next batch of tasks when the queue runs dry.
        The pool runs at most one batch ahead: it starts no new group while a batch's worth is ready."""
        s = self.settings
        while not self.closed and len(self.running) < s.concurrency and len(self.ready) < s.groups_per_batch:
            if not self.queue:
                self._read_tasks()
                if not self.queue:
                    break
            group, index = self.queue.popleft()
            task = asyncio.ensure_future(self._episode(group, index))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    def start(self) -> EpisodePool:
        self._pump()
        return self

    # -- one episode -------------------------------------------------------------------------------

    async def _generate(self, input_ids: list[int], *, session_id: str,
                        sampling_params: dict[str, Any] | None = None) -> TurnRecord:
        """One turn through the gate; a turn aborted by a weight update is sent again after it."""
        requeued = False
        while True:
            epoch = await self.gate.enter()
            if requeued:
                self.counts["turns_requeued"] += 1
                self._since_take["turns_requeued"] += 1
            try:
                turn = await self._client_generate(input_ids, session_id=session_id, sampling_params=sampling_params)
            finally:
                self.gate.leave()
            if turn.finish_reason == "abort" and self.gate.epoch != epoch:
                self.counts["turns_aborted"] += 1
                self._since_take["turns_aborted"] += 1
                requeued = True
                continue
            return turn

    async def _episode(self, group: _Group, index: int) -> None:
        from agentrl.envs.loop import EpisodeMetrics, EpisodeResult, run_episode

        session_id = f"{group.group_id}-{index}"
        s = self.settings
        self.counts["episodes_started"] += 1
        env = None
        try:
            env = self.env_factory()
            self._env_classes.setdefault(type(env))
            result = await run_episode(
                env, group.task, self._generate, self.renderer, session_id=session_id, group_id=group.group_id,
                sampling_params={"temperature": s.temperature, "max_new_tokens": s.max_new_tokens},
                trajectory_manager=self.trajectories, max_context_tokens=self.max_context_tokens)
        except asyncio.CancelledError:
            if self.trajectories.has_session(session_id):
                self.trajectories.drop_session(session_id)
            raise
        except Exception as err:
            log.warning("episode %s failed: %s: %s", session_id, type(err).__name__, err, exc_info=err)
            if self.trajectories.has_session(session_id):
                self.trajectories.drop_session(session_id)
            metrics = EpisodeMetrics(stop_reason=StopReason.ERROR, error=f"{type(err).__name__}: {err}",
                                     error_type=type(err).__name__)
            result = EpisodeResult(session_id=session_id, group_id=group.group_id, task=group.task, samples=[],
                                   metrics=metrics, messages=list(getattr(env, "messages", [])))
        self.counts["episodes_ended"] += 1
        group.episodes.append(result)
        if len(group.episodes) == group.size:
            self._complete(group)
        # out of ``running`` now, not in the done callback a loop iteration later: a take that runs before that
        # callback would count this finished episode as room taken, start nothing, and wait with nothing running
        self.running.discard(asyncio.current_task())
        self._pump()
        self._changed.set()

    def _complete(self, group: _Group) -> None:
        from agentrl.rollout.proof import prove_groups

        samples = [s for e in group.episodes for s in e.samples]
        records = {e.session_id: self.trajectories.emitted.pop(e.session_id) for e in group.episodes
                   if e.session_id in self.trajectories.emitted}
        proved, group.proof, refusals = prove_groups([samples] if samples else [], records)
        for message in refusals:
            log.warning("refused an unproven sample: %s", message)
        group.samples = proved[0] if proved else []
        self.open_groups -= 1
        self.ready.append(group)

    # -- the trainer's side ------------------------------------------------------------------------

    def _regenerate(self, group: _Group) -> None:
        fresh = self._new_group(group.task)
        self.queue.extendleft((fresh, i) for i in reversed(range(fresh.size)))  # next to start

    def _batch_done(self) -> bool:
        s, b = self.settings, self._batch
        if not s.dynamic_sampling:
            return len(b.considered) >= s.groups_per_batch
        return len(b.kept) >= s.groups_per_batch or len(b.considered) >= math.ceil(s.max_oversample * s.groups_per_batch)

    async def take(self, trainer_version: int) -> tuple[list[list[Sample]], dict[str, float], list[Any]]:
        """The next batch: groups whose every trained token is at most ``max_staleness`` versions behind
        ``trainer_version`` (the weights about to be trained), their metrics, and their episodes."""
        s, b = self.settings, self._batch
        self._pump()
        while not self._batch_done():
            while self.ready and not self._batch_done():
                group = self.ready.popleft()
                lag = group_lag(group.samples, trainer_version)
                if lag is None or lag > s.max_staleness:
                    b.stale += 1
                    if s.stale_groups == "regenerate":
                        b.regenerated += 1
                        self._regenerate(group)
                    continue
                b.considered.append(group)
                if group.samples and self.group_filter(group.samples):
                    b.kept.append(group)
                else:
                    self.counts["groups_filtered"] += 1
            if self._batch_done():
                break
            self._pump()
            if not self.running and not self.ready:
                raise RuntimeError("the episode pool has nothing running and nothing ready: is the task source empty?")
            self._changed.clear()
            if not self.ready:
                await self._changed.wait()
        self._batch = _Batch()
        self._pump()  # room was made: keep the pool full while the trainer trains
        return [g.samples for g in b.kept], self._metrics(b, trainer_version), [e for g in b.considered for e in g.episodes]

    def _metrics(self, b: _Batch, trainer_version: int) -> dict[str, float]:
        from agentrl.envs.loop import RolloutResult

        result = RolloutResult(groups=[g.episodes for g in b.considered])
        metrics: dict[str, float] = {}
        for key, value in result.summary().items():
            if isinstance(value, dict):
                prefix = "drift" if key == "drift" else f"rollout/{key}"
                metrics.update({f"{prefix}/{k}": float(v) for k, v in value.items()})
            else:
                metrics[f"rollout/{key}"] = float(value)
        proof: Counter[str] = Counter()
        for g in b.considered:
            proof.update(g.proof)
        metrics.update({k: float(v) for k, v in proof.items()})
        metrics.update(staleness_metrics([x for g in b.kept for x in g.samples], trainer_version))
        wall, busy = time.monotonic(), self.gate.busy_seconds()
        last_wall, last_busy = self._clock
        self._clock = (wall, busy)
        generated = sum(e.metrics.generated_tokens for e in result.episodes)
        metrics.update({
            "rollout/seconds": wall - b.started,
            "rollout/tokens_per_s": generated / max(wall - b.started, 1e-9),
            "rollout/groups_considered": float(len(b.considered)),
            "rollout/groups_kept": float(len(b.kept)),
            "rollout/stale_groups": float(b.stale),
            "rollout/stale_groups_regenerated": float(b.regenerated),
            "rollout/oversampled_groups": float(max(0, len(b.considered) - self.settings.groups_per_batch)),
            "rollout/turns_aborted": float(self._since_take["turns_aborted"]),
            "rollout/turns_requeued": float(self._since_take["turns_requeued"]),
            "rollout/episodes_in_flight": float(len(self.running)),
            "rollout/groups_ready": float(len(self.ready)),
            "rollout/generate_busy_fraction": (busy - last_busy) / max(wall - last_wall, 1e-9),
            "rollout/groups_filtered": float(len(b.considered) - len(b.kept)),
            "train/groups_dropped": float(self.counts["groups_filtered"]),  # run total, as the data buffer's
        })
        self._since_take.clear()
        metrics.update(self._env_metrics())
        return metrics

    def _env_metrics(self) -> dict[str, float]:
        """``env/<name>`` from each environment class's ``rollout_metrics()`` (since its last call)."""
        out: dict[str, float] = {}
        for cls in self._env_classes:
            report = getattr(cls, "rollout_metrics", None)
            if callable(report):
                out.update({f"env/{k}": float(v) for k, v in report().items()})
        return out

    # -- weight updates ----------------------------------------------------------------------------

    async def pause(self) -> None:
        """Stop new turns and pause the engines: turns being generated finish on the old weights
        (``continue``) or are aborted, to be sent again after :meth:`resume` (``abort``)."""
        mode = self.settings.partial_rollout
        await self.gate.close(drain=mode == "continue")
        if self.engine_control is not None:
            await asyncio.to_thread(self.engine_control, "abort" if mode == "abort" else "in_place")

    async def resume(self) -> None:
        if self.engine_control is not None:
            await asyncio.to_thread(self.engine_control, "")
        self.gate.open()

    async def close(self) -> None:
        """Cancel every episode in flight (their sessions are dropped; nothing of them is trained)."""
        self.closed = True
        self.gate.open()
        tasks = list(self.running)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
