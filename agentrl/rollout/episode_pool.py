"""The one training rollout: an admission-controlled pool of episodes.

The pool runs up to ``rollout.concurrency`` episodes at once, each through the per-episode seam
(:func:`agentrl.envs.loop.run_episode`, or ``rollout.episode_function``); a group (``samples_per_prompt``
episodes of one task) is proved and becomes *ready* when its last episode ends. Where the schedule waits is
only a matter of *admission*:

* ``sync`` and ``async``: :meth:`EpisodePool.take` ``(version, batch=t)`` admits batch ``t`` of the task
  source and returns when all of its groups ended (one-step-off calls it for ``t + 1`` before training
  ``t``; the schedule waits for it before the weight update, so the batch sees one weight version).
* ``fully_async``: the pool admits on its own, batch after batch, at most one batch ahead of the trainer;
  :meth:`take` ``(version)`` hands out the next ready groups while the others keep running. Weights then
  change *between turns* of episodes in flight, so one sample may hold turns of several weight versions
  (each token's version is the engine's report, per token for a turn continued across an update,
  :func:`agentrl.rollout.buffer.trained_token_versions`); a
  group with a trained token more than ``max_staleness`` versions behind is dropped or generated again
  (``stale_groups``); with ``dynamic_sampling`` takes go on until ``prompts_per_step`` groups pass the
  group filter, looking at most at ``max_oversample`` x that many.

A weight update goes through :meth:`pause` / :meth:`resume`. The pool's :class:`WeightGate` stops new
turns from starting, then either waits for the turns being generated to finish on the old weights
(``partial_rollout="continue"``), has the engines abort them (``"abort"``): an aborted turn is sent
again, once the gate reopens, on the new weights, its episode keeps its finished turns and is never lost;
or (``"resume"``) has the engines retract them, which keeps every token drawn so far: after the update each
such turn is prefilled again on the new weights and goes on from its last sampled token, and the engine
reports which tokens each version drew (``meta_info.weight_version_spans``, kept as the turn's
``TurnRecord.weight_version_spans`` and so as each token's provenance version: staleness and
``max_staleness`` count every token at the version that drew it); the trainer's per-token importance
weights (``importance_weights: tis``) correct each token by its own sampler's log-prob.

Each batch's metrics (one builder, :meth:`EpisodePool._metrics`) carry, as ``env/<name>``, what the
environment class's ``rollout_metrics()`` hook reports (its own infrastructure since the last call).
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
from typing import Any, Protocol

from agentrl.rollout.buffer import DataBuffer, group_lag, staleness_metrics
from agentrl.rollout.settings import RolloutSettings
from agentrl.trajectory import MODEL, Sample, StopReason, TurnRecord

log = logging.getLogger(__name__)


class ScheduleFields(Protocol):
    """The schedule fields of :class:`agentrl.run.config.RunConfig` the pool reads (documented there)."""

    schedule: str
    max_staleness: int
    stale_groups: str
    partial_rollout: str
    dynamic_sampling: bool
    max_oversample: float


def unproven_trained_tokens(sample: Sample) -> int:
    """Trained tokens (loss mask 1) whose provenance is not a model output: must always be 0."""
    count = 0
    for run in sample.provenance.runs:
        if run.source == MODEL:
            continue
        lo, hi = max(run.start, sample.response_start), run.end
        count += sum(sample.loss_mask[lo - sample.response_start : hi - sample.response_start]) if hi > lo else 0
    return count


def example_row(episode: Any) -> dict[str, Any]:
    """An episode's (first) sample as a dict, with the chat and the episode's stop reason in its metadata."""
    row = episode.samples[0].to_dict()
    row["metadata"] = {**row["metadata"], "messages": episode.messages,
                       "stop_reason": str(episode.metrics.stop_reason) if episode.metrics.stop_reason else None}
    return row


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """A :class:`~agentrl.envs.loop.RolloutResult` summary as metric names (nested counts flatten to a/b)."""
    metrics: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            prefix = "drift" if key == "drift" else f"rollout/{key}"
            metrics.update({f"{prefix}/{k}": float(v) for k, v in value.items()})
        else:
            metrics[f"rollout/{key}"] = float(value)
    return metrics


class EpisodeRunner:
    """Plays one episode through the per-episode function; an episode that raises becomes an error
    result (no samples) instead of cancelling the others. Shared by the pool and greedy evaluation."""

    def __init__(self, env_factory: Callable[[], Any], renderer: Any, generate: Callable[..., Any], *,
                 trajectories: Any, episode_function: Callable[..., Any] | None = None,
                 max_context_tokens: int | None = None) -> None:
        from agentrl.envs.loop import run_episode

        self.env_factory, self.renderer, self.generate = env_factory, renderer, generate
        self.trajectories, self.max_context_tokens = trajectories, max_context_tokens
        self.play = episode_function or run_episode
        self.env_classes: dict[type, None] = {}  # classes of the environments made, in order (an ordered set)

    async def __call__(self, task: Any, session_id: str, group_id: str, sampling: dict[str, Any]) -> Any:
        from agentrl.envs.loop import EpisodeMetrics, EpisodeResult

        env = None
        try:
            env = self.env_factory()
            self.env_classes.setdefault(type(env))
            return await self.play(env, task, self.generate, self.renderer, session_id=session_id,
                                   group_id=group_id, sampling_params=sampling, trajectory_manager=self.trajectories,
                                   max_context_tokens=self.max_context_tokens)
        except asyncio.CancelledError:
            self._drop(session_id)
            raise
        except Exception as err:
            log.warning("episode %s failed: %s: %s", session_id, type(err).__name__, err, exc_info=err)
            self._drop(session_id)
            metrics = EpisodeMetrics(stop_reason=StopReason.ERROR, error=f"{type(err).__name__}: {err}",
                                     error_type=type(err).__name__)
            return EpisodeResult(session_id=session_id, group_id=group_id, task=task, samples=[],
                                 metrics=metrics, messages=list(getattr(env, "messages", [])))

    def _drop(self, session_id: str) -> None:
        if self.trajectories.has_session(session_id):  # a custom episode function may not have cleaned up
            self.trajectories.drop_session(session_id)

    def env_metrics(self) -> dict[str, float]:
        """``env/<name>`` from each environment class's ``rollout_metrics()`` (since its last call); looked
        up on the classes made, as ``env_factory`` may be a wrapper with no hooks itself."""
        out: dict[str, float] = {}
        for cls in self.env_classes:
            report = getattr(cls, "rollout_metrics", None)
            if callable(report):
                out.update({f"env/{k}": float(v) for k, v in report().items()})
        return out


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
    batch: int | None  # the admitted batch (sync, async); None: admitted by the pool itself (fully_async)
    episodes: list[Any] = field(default_factory=list)  # EpisodeResult
    samples: list[Sample] = field(default_factory=list)  # proved
    proof: dict[str, float] = field(default_factory=dict)
    done: bool = False


@dataclass
class _Batch:
    """The batch a :meth:`EpisodePool.take` assembles."""

    kept: list[_Group] = field(default_factory=list)
    considered: list[_Group] = field(default_factory=list)  # fresh groups looked at (kept or filtered)
    stale: int = 0
    regenerated: int = 0
    started: float = field(default_factory=time.monotonic)


# the engines' pause mode per ``partial_rollout``: ``retract`` drops the KV drawn on the old weights, so
# a resumed turn's later tokens see only new-weight activations (``in_place`` would keep the old KV)
ENGINE_PAUSE = {"continue": "in_place", "abort": "abort", "resume": "retract"}
Pauser = Callable[[str], Any]  # engine-side pause(mode) / continue (mode "") — blocking, run in a thread


class EpisodePool:
    """Episodes of ``env_factory`` on tasks of ``task_source`` (``.train(n, index)``), under ``rollout``
    (:class:`~agentrl.rollout.settings.RolloutSettings`) and the schedule fields of ``schedule`` (None: a
    pool that plays only the batches :meth:`take` admits, as under ``sync``).

    ``generate`` is the rollout client's ``generate_turn``; ``engine_control(mode)`` pauses the engines
    (``mode`` ``"abort"`` or ``"in_place"``) and ``engine_control("")`` continues them (None: no engine
    call, for tests without engines). ``buffer`` applies the group filter and counts what it dropped (its
    counts are checkpointed). ``first_batch``: the task-source index of the first batch a ``fully_async``
    pool admits. ``episode_function``: replaces :func:`~agentrl.envs.loop.run_episode` (same signature).
    """

    def __init__(self, *, env_factory: Callable[[], Any], renderer: Any, generate: Callable[..., Any],
                 task_source: Any, rollout: RolloutSettings, schedule: ScheduleFields | None, buffer: DataBuffer,
                 max_context_tokens: int | None = None, engine_control: Pauser | None = None,
                 first_batch: int = 0, episode_function: Callable[..., Any] | None = None) -> None:
        from agentrl.rollout.proof import RecordingTrajectoryManager

        self.task_source, self.rollout, self.schedule, self.buffer = task_source, rollout, schedule, buffer
        self.admits_ahead = schedule is not None and schedule.schedule == "fully_async"
        self.client_generate = generate
        self.engine_control = engine_control
        self.next_batch = first_batch
        self.trajectories = RecordingTrajectoryManager(policy=rollout.policy)
        self.runner = EpisodeRunner(env_factory, renderer, self._generate, trajectories=self.trajectories,
                                    episode_function=episode_function, max_context_tokens=max_context_tokens)
        self.sampling = {"temperature": rollout.temperature, "max_new_tokens": rollout.max_new_tokens}
        self.gate = WeightGate()
        self.queue: deque[tuple[_Group, int]] = deque()  # (group, episode index) not yet started
        self.ready: deque[_Group] = deque()  # proved groups the pool admitted itself, in completion order
        self.running: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self._pool_id = uuid.uuid4().hex[:6]
        self._groups_made = 0
        self.closed = False
        self.counts: Counter[str] = Counter()  # lifetime: episodes_started/ended, turns_aborted/requeued, ...
        self._since_take: Counter[str] = Counter()
        self._clock = (time.monotonic(), 0.0)  # (wall, busy) at the last take

    @property
    def groups_per_batch(self) -> int:
        return self.rollout.prompts_per_step

    # -- admission ---------------------------------------------------------------------------------

    def _new_group(self, task: Any, batch: int | None) -> _Group:
        self._groups_made += 1
        return _Group(f"{self._pool_id}-g{self._groups_made}", task, self.rollout.samples_per_prompt, batch)

    def _admit(self, index: int, *, tagged: bool) -> list[_Group]:
        groups = [self._new_group(task, index if tagged else None)
                  for task in self.task_source.train(self.rollout.prompts_per_step, index)]
        self.queue.extend((g, i) for g in groups for i in range(g.size))
        return groups

    def _pump(self) -> None:
        """Start episodes while there is room. Fully async, read the next batch of tasks when the queue
        runs dry, running at most one batch ahead: no new group starts while a batch's worth is ready."""
        while not self.closed and len(self.running) < self.rollout.concurrency:
            if not self.queue:
                if not self.admits_ahead or len(self.ready) >= self.groups_per_batch:
                    break
                self._admit(self.next_batch, tagged=False)
                self.next_batch += 1
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
                turn = await self.client_generate(input_ids, session_id=session_id, sampling_params=sampling_params)
            finally:
                self.gate.leave()
            self._since_take["tokens_generated"] += len(turn.output_ids)
            if turn.finish_reason == "abort" and self.gate.epoch != epoch:
                self.counts["turns_aborted"] += 1
                self._since_take["turns_aborted"] += 1
                self._since_take["tokens_discarded"] += len(turn.output_ids)  # drawn, then generated again
                requeued = True
                continue
            return turn

    async def _episode(self, group: _Group, index: int) -> None:
        self.counts["episodes_started"] += 1
        result = await self.runner(group.task, f"{group.group_id}-{index}", group.group_id, self.sampling)
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
        group.done = True
        if group.batch is None:
            self.ready.append(group)

    # -- the trainer's side ------------------------------------------------------------------------

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self._pump()
            if not self.running and not self.ready and not condition():
                raise RuntimeError("the episode pool has nothing running and nothing ready: is the task source empty?")
            self._changed.clear()
            await self._changed.wait()

    def _keeps(self, group: _Group) -> bool:
        if group.samples and self.buffer.keeps(group.samples):
            return True
        self.counts["groups_filtered"] += 1
        return False

    async def take(self, trainer_version: int, batch: int | None = None,
                   ) -> tuple[list[list[Sample]], dict[str, float], list[Any]]:
        """The next batch for the weights ``trainer_version`` (those about to be trained): the groups worth
        training, their metrics, and the episodes of every group looked at. ``batch``: admit batch ``batch``
        of the task source and return all of its groups (sync, async); None: the next ready groups, each at
        most ``max_staleness`` versions behind (fully_async)."""
        b = _Batch()
        if batch is not None:
            groups = self._admit(batch, tagged=True)
            await self._until(lambda: all(g.done for g in groups))
            b.considered = groups
            b.kept = [g for g in groups if self._keeps(g)]
        else:
            await self._take_ready(trainer_version, b)
        self._pump()  # room was made: keep the pool full while the trainer trains
        return [g.samples for g in b.kept], self._metrics(b, trainer_version), [e for g in b.considered for e in g.episodes]

    def _batch_done(self, b: _Batch) -> bool:
        n, s = self.groups_per_batch, self.schedule
        assert s is not None  # only a pool that admits on its own takes ready groups
        if not s.dynamic_sampling:
            return len(b.considered) >= n
        return len(b.kept) >= n or len(b.considered) >= math.ceil(s.max_oversample * n)

    async def _take_ready(self, trainer_version: int, b: _Batch) -> None:
        s = self.schedule
        assert s is not None
        while not self._batch_done(b):
            await self._until(lambda: bool(self.ready))
            group = self.ready.popleft()
            lag = group_lag(group.samples, trainer_version)
            if lag is None or lag > s.max_staleness:
                b.stale += 1
                if s.stale_groups == "regenerate":
                    b.regenerated += 1
                    fresh = self._new_group(group.task, None)
                    self.queue.extendleft((fresh, i) for i in reversed(range(fresh.size)))  # next to start
                continue
            b.considered.append(group)
            if self._keeps(group):
                b.kept.append(group)

    def _metrics(self, b: _Batch, trainer_version: int) -> dict[str, float]:
        from agentrl.envs.loop import RolloutResult

        result = RolloutResult(groups=[g.episodes for g in b.considered])
        metrics = summary_metrics(result.summary())
        proof: Counter[str] = Counter()
        for g in b.considered:
            proof.update(g.proof)
        metrics.update({k: float(v) for k, v in proof.items()})
        kept = [x for g in b.kept for x in g.samples]
        metrics.update(staleness_metrics(kept, trainer_version))
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
            "rollout/oversampled_groups": float(max(0, len(b.considered) - self.groups_per_batch)),
            "rollout/turns_aborted": float(self._since_take["turns_aborted"]),
            "rollout/turns_requeued": float(self._since_take["turns_requeued"]),
            "rollout/tokens_generated": float(self._since_take["tokens_generated"]),
            "rollout/tokens_discarded": float(self._since_take["tokens_discarded"]),
            "rollout/episodes_in_flight": float(len(self.running)),
            "rollout/groups_ready": float(len(self.ready)),
            "rollout/generate_busy_fraction": (busy - last_busy) / max(wall - last_wall, 1e-9),
            "rollout/groups_filtered": float(len(b.considered) - len(b.kept)),
            "rollout/unproven_trained_tokens": float(sum(map(unproven_trained_tokens, kept))),
            "rollout/trained_tokens": float(sum(x.trained_tokens for x in kept)),
            "train/groups_dropped": float(self.buffer.groups_dropped),  # run total (checkpointed)
        })
        self._since_take.clear()
        metrics.update(self.runner.env_metrics())
        return metrics

    # -- weight updates ----------------------------------------------------------------------------

    async def pause(self) -> None:
        """Stop new turns and pause the engines: turns being generated finish on the old weights
        (``continue``), are aborted, to be sent again after :meth:`resume` (``abort``), or are retracted
        with their tokens, to go on after :meth:`resume` on the new weights (``resume``)."""
        mode = self.schedule.partial_rollout if self.schedule is not None else "continue"
        await self.gate.close(drain=mode == "continue")
        if self.engine_control is not None:
            await asyncio.to_thread(self.engine_control, ENGINE_PAUSE[mode])

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
