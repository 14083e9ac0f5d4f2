"""Continuous batching in one worker thread: admit waiting sequences, then one decode step for all.

The asyncio side never touches the model: it submits :class:`Sequence` objects and control operations
(weight updates, cache flushes) and is notified through ``loop.call_soon_threadsafe``. Control operations
run in the worker between steps, which makes every weight update atomic with respect to forward passes.

Admission is grouped: a prefill launched from Python costs the host about as much whether it carries one
prompt or many, so while rows run, waiting sequences join only once the oldest has waited ``admit_wait_ratio``
times what an admission has been costing (or at once when they would fill the free rows): admissions then
take at most about ``1 / (1 + admit_wait_ratio)`` of a busy batch's time, as TGI's ``max_waiting_tokens``.

Pause modes mirror SGLang: ``abort`` finishes every in-flight request with ``finish_reason.type ==
"abort"``; ``in_place`` freezes running requests with their KV; ``retract`` moves them back to the queue
and drops their KV, so on ``continue`` they are re-prefilled (with the weights current then). New
requests wait while paused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.engine.prefix_cache import common_prefix_len
from agentrl.engine.protocol import SamplingParams

if TYPE_CHECKING:
    import torch

    from agentrl.engine.metrics import EngineMetrics
    from agentrl.engine.model_runner import ModelRunner
    from agentrl.engine.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)
# Request ids: a random prefix per process and a counter (uuid4 per request cost ~5% of an engine's CPU).
_RID_PREFIX = uuid.uuid4().hex[:12]
_RID_NUMBERS = itertools.count()
# Sequences admitted together without a cached past that share at least this many leading tokens prefill
# them once (Scheduler._share_prefix, decoders with their own prefill only).
SHARED_PREFIX_MIN_TOKENS = 16
# With the runner's fused prefill (new sequences only), a cached prefix shorter than this is not used: it would
# save a few tokens of the fast prefill for the row's run through transformers' forward (random prompts over a
# warm cache hit one or two tokens: issue 40's server runs sent whole admissions down that path).
MIN_CACHED_PREFIX_TOKENS = 16
# Rows a decode step runs at most (--max-batch-size): the one declaration of the engine's batch size, also
# the rollout's default episodes in flight per engine (rollout.settings.EPISODES_PER_ENGINE).
MAX_BATCH_SIZE = 64


@dataclass
class Sequence:
    """One request (one prompt, one sample) as it moves through the scheduler."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"{_RID_PREFIX}{next(_RID_NUMBERS):020x}")
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    routed_experts: list[list[int]] | None = None  # per output token (MoE, when asked): engine/moe.py
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None  # set last, when the result is complete
    pending_finish_reason: dict[str, Any] | None = None  # decided by the worker; finish_reason on removal
    weight_version: str = "default"
    # [first output index, weight version] each time the version of the tokens drawn changes: a sequence
    # retracted at a weight update and admitted again continues on the new weights (pause mode "retract")
    version_spans: list[list[Any]] = field(default_factory=list)
    abort_requested: bool = False
    abort_message: str = "Abort in waiting queue"
    generator: torch.Generator | None = None
    # set by the server: called in the event loop after each emitted update
    notify: Callable[[], None] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    text_cache: str = ""
    created: float = field(default_factory=time.monotonic)
    queued: float = 0.0  # when it last joined the waiting queue (submit, retract): Scheduler._admit_due

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class Scheduler:
    """Owns the running batch and the worker thread."""

    def __init__(
        self,
        runner: ModelRunner,
        prefix_cache: PrefixCache,
        metrics: EngineMetrics,
        *,
        max_batch_size: int = MAX_BATCH_SIZE,
        max_prefill_tokens: int = 8192,
        weight_version: Callable[[], str],
        decoder: Any = None,
        admit_wait_ratio: float = 4.0,
    ) -> None:
        """``decoder``: what runs decode steps and holds the running batch in place of ``runner`` (same
        ``decode`` / ``empty_batch``, e.g. :class:`~agentrl.engine.cpu_decode.LeanDecoder`).
        ``admit_wait_ratio``: see the module docstring (0: admit before every step)."""
        if admit_wait_ratio < 0:
            raise ValueError(f"admit_wait_ratio must be >= 0, got {admit_wait_ratio}")
        self.runner = runner
        self.decoder = decoder if decoder is not None else runner
        self.prefix_cache = prefix_cache
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self._weight_version = weight_version
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admitting: list[Sequence] = []  # popped from the queue, being prefilled (abortable too)
        self.batch = self.decoder.empty_batch()
        self.paused = False
        self._controls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="agentrl-engine-worker", daemon=True)
        self.last_step_time = 0.0
        self.generated_tokens = 0
        self._pending: deque[Any] = deque()  # decode steps queued ahead on the device, oldest first (_decode_step)
        # how many steps may be in flight behind the one being collected: 0 collects every step before the next;
        # 2 keeps the device busy while the host reads a step's tokens and queues the next
        self.pipeline_depth = 2
        self.pipelined_steps = 0
        self.dropped_tokens = 0  # drawn in a queued step for a row that had finished at an earlier step
        self.admit_wait_ratio = admit_wait_ratio
        self.admit_seconds = 0.0  # what an admission costs, a moving average (_admit_due)
        self.admissions = 0
        self.decode_steps = 0
        # where the worker's time goes (stats()): busy = admissions, steps and controls, not idle waits
        self.busy_seconds = 0.0
        self.admit_total_seconds = 0.0
        self.admitted_rows = 0
        self.drop_seconds = 0.0
        self.drains = 0
        self.trace: list[tuple] | None = None  # set to a list: (what, start, seconds, rows) per step/admission

    # ---- called from the event loop / other threads -------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def submit(self, seq: Sequence) -> None:
        seq.queued = time.monotonic()
        with self._cond:
            self.waiting.append(seq)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` in the worker thread between two steps (also while paused)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._controls.append((fn, fut))
            self._cond.notify_all()
        return fut

    def abort(self, rid: str | None = None, *, abort_all: bool = False, message: str = "Abort by request") -> int:
        """Flag matching sequences; the worker finishes them with ``finish_reason.type == "abort"``."""
        n = 0
        with self._cond:
            for seq in itertools.chain(self.waiting, self.admitting, self.running):
                if abort_all or seq.rid == rid or (rid and seq.rid.startswith(f"{rid}-")):
                    seq.abort_requested, seq.abort_message = True, message
                    n += 1
            self._cond.notify_all()
        return n

    def pause(self, mode: str) -> None:
        def op() -> None:
            self.paused = True
            if mode == "abort":
                for seq in [*self.waiting, *self.running]:
                    seq.abort_requested, seq.abort_message = True, "Abort by pause_generation"
                self._reap_aborts()
            elif mode == "retract":
                for seq in reversed(self.running):
                    self.waiting.appendleft(seq)
                self.running, self.batch = [], self.decoder.empty_batch()

        self.call(op).result()

    def resume(self) -> None:
        def op() -> None:
            self.paused = False

        self.call(op).result()

    def load(self) -> dict[str, int]:
        running = len(self.running) + len(self.admitting)
        return {
            "num_reqs": running + len(self.waiting),
            "num_running_reqs": running,
            "num_waiting_reqs": len(self.waiting),
            "num_tokens": sum(self.batch.lengths),
        }

    # ---- worker thread -----------------------------------------------------------------------
    def _admit_due(self) -> bool:
        """Whether waiting sequences join before the next step (see the module docstring)."""
        free = self.max_batch_size - len(self.running)
        if not self.waiting or free <= 0:
            return False
        if not self.running or len(self.waiting) >= free:
            return True
        return time.monotonic() - self.waiting[0].queued >= self.admit_wait_ratio * self.admit_seconds

    def _has_work(self) -> bool:
        return bool(self._controls) or (not self.paused and bool(self.waiting or self.running)) or any(
            s.abort_requested for s in itertools.chain(self.waiting, self.running)
        )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._has_work():
                    self._cond.wait()
                if self._stop:
                    break
                controls = list(self._controls)
                self._controls.clear()
            busy = time.perf_counter()
            try:
                self._work(controls)
            finally:
                self.busy_seconds += time.perf_counter() - busy

    def stats(self) -> dict[str, Any]:
        """Counters of the worker's time and events since start (the runner's under ``runner_``): what a
        benchmark differences over a run to split the host's time per decode step."""
        out = {"decode_steps": self.decode_steps, "pipelined_steps": self.pipelined_steps,
               "admissions": self.admissions, "admitted_rows": self.admitted_rows, "busy_s": self.busy_seconds,
               "admit_s": self.admit_total_seconds, "drop_s": self.drop_seconds, "drains": self.drains,
               "dropped_tokens": self.dropped_tokens, "generated_tokens": self.generated_tokens}
        for key, value in (getattr(self.runner, "stats", None) or {}).items():
            out[f"runner_{key}"] = value
        return out

    def _work(self, controls: list[tuple[Callable[[], Any], concurrent.futures.Future]]) -> None:
        if self._pending and (controls or self._admit_due() or self.paused
                              or any(s.abort_requested for s in self.running)):
            try:
                self._drain()
            except Exception:  # noqa: BLE001 - the step's failure is handled below like any other
                self._pending.clear()
                logger.exception("collecting a queued decode step failed")
        for fn, fut in controls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
        try:
            self._reap_aborts()
            if not self.paused:
                self._admit()
                if self.running:
                    self._decode_step()
        except Exception as exc:  # fail the in-flight requests, keep the worker (and server) alive
            logger.exception("engine step failed; aborting %d in-flight requests", len(self.running) + len(self.waiting))
            self._pending.clear()
            with self._cond:
                failed = [*self.running, *self.admitting, *self.waiting]
                self.running, self.admitting, self.waiting = [], [], deque()
                self.batch = self.decoder.empty_batch()
            for seq in failed:
                self._finish(seq, {"type": "abort", "message": f"engine error: {exc!r}"})

    def _reap_aborts(self) -> None:
        with self._cond:
            aborted_waiting = [s for s in self.waiting if s.abort_requested]
            if aborted_waiting:
                self.waiting = deque(s for s in self.waiting if not s.abort_requested)
        for seq in aborted_waiting:
            self._finish(seq, {"type": "abort", "message": seq.abort_message})
        if any(s.abort_requested for s in self.running):
            self._drain()  # a step queued ahead belongs to the rows as they are
            self._drop_rows([i for i, s in enumerate(self.running) if s.abort_requested], abort=True)

    def _admit(self) -> None:
        """Prefill waiting sequences together (up to the batch and prefill-token budgets)."""
        if not self._admit_due():
            return
        self._drain()  # rows join a batch with no step in flight
        began = time.perf_counter()
        admitted: list[tuple[Sequence, list[int], Any]] = []
        new_tokens = 0
        while len(self.running) + len(admitted) < self.max_batch_size:
            with self._cond:
                if not self.waiting:
                    break
                seq = self.waiting[0]
                tokens = seq.all_tokens()
                cached_len, past = self.prefix_cache.lookup(tokens, len(tokens) - 1)
                if past is not None and cached_len < MIN_CACHED_PREFIX_TOKENS and self._fused_prefill():
                    cached_len, past = 0, None  # saves a few tokens of a fast prefill for a slow one
                if admitted and new_tokens + len(tokens) - cached_len > self.max_prefill_tokens:
                    break
                self.waiting.popleft()
                self.admitting.append(seq)
            if not seq.output_ids:
                seq.cached_tokens = cached_len
                self.metrics.observe_prompt(len(tokens), cached_len)
            new_tokens += len(tokens) - cached_len
            admitted.append((seq, tokens, past))
        if not admitted:
            return
        items = [(tokens, past) for _, tokens, past in admitted]
        seqs = [seq for seq, _, _ in admitted]
        prefill_into = getattr(self.decoder, "prefill_into", None)
        if prefill_into is not None:  # the decoder writes the new rows' KV into its batch itself
            logits = prefill_into(self.batch, self._share_prefix(items))
            first_tokens, logprobs = self._sample(logits, seqs)
            self._keep_routing(seqs)
            kvs_parts = []
        else:
            seqs, first_tokens, logprobs, kvs_parts = self._prefill(admitted)
        with self._cond:
            self.running.extend(seqs)
            self.admitting = []
        for kvs in kvs_parts:
            self.batch = self.batch.extend(kvs)
        version = self._weight_version()
        for seq, tok, lp in zip(seqs, first_tokens, logprobs, strict=True):
            seq.weight_version = version
            if not seq.version_spans or seq.version_spans[-1][1] != version:
                seq.version_spans.append([len(seq.output_ids), version])
            self._append_token(seq, tok, lp)
        self._finish_done()
        self.admissions += 1
        self.admitted_rows += len(seqs)
        took = time.perf_counter() - began
        self.admit_total_seconds += took
        self.admit_seconds += 0.3 * (took - self.admit_seconds)
        if self.trace is not None:
            self.trace.append(("admit", began, took, len(seqs)))

    def _fused_prefill(self) -> bool:
        return bool(getattr(self.runner, "fused_prefill", False))

    def _prefill(self, admitted: list[tuple[Sequence, list[int], Any]]) -> tuple[list[Sequence], list[int], list[float],
                                                                              list[Any]]:
        """The runner's prefill of ``admitted``; with a prefill of its own for new sequences (``fused_prefill``),
        those with a cached past run apart (one past would send the whole group through transformers' slower
        forward). Returns the sequences in the order their rows join, their first tokens and log-probs, and
        the KV of each group, to extend the batch with in that order."""
        groups = [admitted]
        if self._fused_prefill():
            groups = [g for g in ([a for a in admitted if a[2] is None], [a for a in admitted if a[2] is not None]) if g]
        seqs: list[Sequence] = []
        tokens: list[int] = []
        logprobs: list[float] = []
        parts = []
        for group in groups:
            group_seqs = [seq for seq, _, _ in group]
            logits, kvs = self.runner.prefill([(toks, past) for _, toks, past in group])
            drawn, lps = self._sample(logits, group_seqs)
            self._keep_routing(group_seqs)
            seqs += group_seqs
            tokens += drawn
            logprobs += lps
            parts.append(kvs)
        return seqs, tokens, logprobs, parts

    def _share_prefix(self, items: list[tuple[list[int], Any]]) -> list[tuple[list[int], Any]]:
        """``items`` where the sequences without a cached past that start alike (a system prompt, a group's
        one prompt) share one prefill of their common prefix, which the prefix cache keeps for later
        arrivals too (a sequence with a cached past keeps it)."""
        fresh = [i for i, (_, past) in enumerate(items) if past is None]
        if len(fresh) < 2:
            return items
        first = items[fresh[0]][0]
        shared = min(len(items[i][0]) for i in fresh) - 1  # at least one token of each is still to run
        for i in fresh[1:]:
            shared = min(shared, common_prefix_len(first[:shared], items[i][0][:shared]))
        if shared < SHARED_PREFIX_MIN_TOKENS:
            return items
        prefix = first[:shared]
        scratch = self.decoder.empty_batch(1)
        self.decoder.prefill_into(scratch, [(prefix, None)])
        kv = scratch.row(0)
        self.prefix_cache.insert(prefix, kv)
        return [(tokens, kv) if i in fresh else (tokens, past) for i, (tokens, past) in enumerate(items)]

    def _decode_step(self, *, pipeline: bool = True) -> None:
        """One decode step for every running row. On the captured-graph path (``runner.launch_sample``) up to
        ``pipeline_depth`` later steps are queued on the device *before* this step's tokens are appended, when
        nothing can change the batch in between (no row can finish with the token just drawn or run out of
        length or context in the queued steps, no stop strings, no waiting requests, controls, aborts or
        pause): the host's per-row work and the wait for a step's numbers then overlap the device's next step.
        A row may still finish with a token drawn while later steps were queued: those steps' tokens for it
        are dropped, and the queue is collected (``_drain``) before the row leaves the batch."""
        t0 = time.perf_counter()
        launch = getattr(self.runner, "launch_sample", None)
        if self._pending:
            drawn = self.runner.collect(self._pending.popleft())
        else:
            tokens = [seq.output_ids[-1] for seq in self.running]
            drawn = None
            if launch is not None:
                handle = launch(self.batch, tokens, [s.params for s in self.running], [s.generator for s in self.running])
                drawn = None if handle is None else self.runner.collect(handle)
            if drawn is None:
                logits, self.batch = self.decoder.decode(self.batch, tokens)
                drawn = self._sample(logits, self.running)
                self._keep_routing(self.running)
        new_tokens, logprobs = drawn
        version = self._weight_version()
        if version != self.running[0].version_spans[-1][1]:  # weights changed under rows paused in place
            for seq in self.running:
                seq.version_spans.append([len(seq.output_ids), version])
        if pipeline and launch is not None:
            self._queue_ahead(launch, new_tokens)
        appended = 0
        for seq, tok, lp in zip(self.running, new_tokens, logprobs, strict=False):
            if seq.pending_finish_reason is None:  # else it finished at a step before this queued one
                self._append_token(seq, tok, lp, count=False)
                appended += 1
        self.dropped_tokens += len(self.running) - appended
        self.generated_tokens += appended
        self.metrics.generated_tokens.inc(appended)  # one counter update per step, not per row
        self.metrics.observe_batch(len(self.running))
        self.decode_steps += 1
        if self._pending and any(s.pending_finish_reason is not None for s in self.running):
            self._drain()  # rows leave a batch with no step in flight
        self._finish_done()
        self.last_step_time = time.perf_counter() - t0
        if self.trace is not None:
            self.trace.append(("step" if pipeline else "drain", t0, self.last_step_time, len(self.running),
                               len(self._pending)))

    def _queue_ahead(self, launch: Callable[..., Any], new_tokens: list[int]) -> None:
        """Queue steps behind the one just collected, up to ``pipeline_depth`` in flight."""
        while len(self._pending) < self.pipeline_depth and self._may_pipeline(new_tokens, len(self._pending) + 1):
            if self._pending:
                handle = self.runner.launch_next(self._pending[-1])
            else:
                handle = launch(self.batch, new_tokens, [s.params for s in self.running],
                                [s.generator for s in self.running])
            if handle is None:
                return
            self._pending.append(handle)
            self.pipelined_steps += 1

    def _may_pipeline(self, new_tokens: list[int], ahead: int) -> bool:
        """Whether no running row finishes with ``new_tokens``, none runs out of length or context within
        ``ahead`` more steps, and nothing waits to change the batch: then ``ahead`` steps may be in flight
        when they are appended. (A row may still draw a stop token in a queued step; see _decode_step.)"""
        if self._admit_due() or self._controls or self.paused:
            return False
        eos, context = self.runner.eos_token_ids, self.runner.context_length
        for seq, tok in zip(self.running, new_tokens, strict=True):
            p = seq.params
            if (seq.abort_requested or p.stop or tok in p.stop_token_ids or (not p.ignore_eos and tok in eos)
                    or len(seq.output_ids) + ahead >= p.max_new_tokens
                    or len(seq.prompt_ids) + len(seq.output_ids) + ahead >= context):
                return False
        return True

    def _drain(self) -> None:
        """Collect the steps queued ahead (their tokens appended, finished rows dropped) before anything
        else touches the batch."""
        if self._pending:
            self.drains += 1
        while self._pending:
            self._decode_step(pipeline=False)

    def _sample(self, logits, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        if isinstance(logits, tuple):  # the runner drew the tokens itself (null_model.NullRunner)
            return logits
        from agentrl.engine.sampling import sample_next

        return sample_next(logits, [s.params for s in seqs], [s.generator for s in seqs],
                           getattr(self.runner, "sampling_rng", None))

    def _keep_routing(self, seqs: list[Sequence]) -> None:
        """The last forward's experts for the rows that asked for them (``return_routed_experts``), one entry
        per token they are about to append."""
        if any(s.routed_experts is not None for s in seqs):
            for seq, experts in zip(seqs, self.runner.routed_experts(), strict=True):
                if seq.routed_experts is not None:
                    seq.routed_experts.append(experts)

    def _append_token(self, seq: Sequence, token: int, logprob: float, *, count: bool = True) -> None:
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        if count:
            self.generated_tokens += 1
            self.metrics.generated_tokens.inc()
        reason = self._finish_reason_after(seq, token)
        if reason is not None:
            seq.pending_finish_reason = reason
        elif seq.stream:
            _notify(seq)

    def _finish_reason_after(self, seq: Sequence, token: int) -> dict[str, Any] | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.runner.eos_token_ids):
            return {"type": "stop", "matched": token}
        if p.stop:
            text = self.runner.tokenizer.decode(seq.output_ids, skip_special_tokens=p.skip_special_tokens)
            # only the tail can hold a stop string that was not there one token ago
            tail_from = max(0, len(seq.text_cache) - max(len(s) for s in p.stop))
            seq.text_cache = text
            for s in p.stop:
                if s in text[tail_from:]:
                    return {"type": "stop", "matched": s}
        if len(seq.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(seq.prompt_ids) + len(seq.output_ids) >= self.runner.context_length:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def _finish_done(self) -> None:
        done = [i for i, s in enumerate(self.running) if s.pending_finish_reason is not None]
        if done:
            self._drop_rows(done, abort=False)

    def _drop_rows(self, rows: list[int], *, abort: bool) -> None:
        began = time.perf_counter()
        finished = []
        for i in rows:
            seq = self.running[i]
            # the KV covers every token but the last output one (sampled, never fed back), or more: steps queued
            # behind the row's last token fed it and tokens drawn after it (lookups take only the matched columns)
            kv_tokens = seq.all_tokens()[: self.batch.lengths[i]]
            if 0 < len(kv_tokens) <= self.prefix_cache.max_tokens:  # else the cache would not keep the copy
                self.prefix_cache.insert(kv_tokens, self.batch.row(i))
            reason = {"type": "abort", "message": seq.abort_message} if abort else seq.pending_finish_reason
            finished.append((seq, reason))
        remove = getattr(self.batch, "remove", None)
        if remove is not None:  # the batch fills the holes itself (cpu_decode.SlotBatchKV): rows change order
            order = remove(rows)
        else:
            drop = set(rows)
            order = [i for i in range(len(self.running)) if i not in drop]
            self.batch = self.batch.select(order)
        self.running = [self.running[i] for i in order]
        for seq, reason in finished:  # notify only once the scheduler's state no longer holds them
            self._finish(seq, reason)
        self.drop_seconds += time.perf_counter() - began

    def _finish(self, seq: Sequence, reason: dict[str, Any] | None) -> None:
        seq.weight_version = self._weight_version()
        seq.finish_reason = reason
        self.metrics.finished_requests.labels(reason=(reason or {}).get("type", "unknown")).inc()
        _notify(seq)


def _notify(seq: Sequence) -> None:
    if seq.loop is not None and seq.notify is not None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
            seq.loop.call_soon_threadsafe(seq.notify)
