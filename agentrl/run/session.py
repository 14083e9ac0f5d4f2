"""``Run``: one training run's processes and records behind five verbs — :meth:`~Run.generate`,
:meth:`~Run.train`, :meth:`~Run.update_weights`, :meth:`~Run.evaluate`, :meth:`~Run.save` — so that a
schedule (:mod:`agentrl.run.schedules`) is a screen of those verbs and nothing else.

Behind the verbs: Ray start, the rollout actor (engines, router, agent loop, data buffer), the cached
base and warm-up models, the trainer ranks and where they sync to, resume, metric rows, checkpoint names
and rotation, memory release around training when colocated, and stopping every process on exit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.run import stopping
from agentrl.run.bookkeeping import (
    CheckpointDir,
    MetricsLog,
    SampleLog,
    claim_output_dir,
    plot_curves,
    train_row,
)
from agentrl.run.config import RunConfig
from agentrl.run.failure_watch import FailureWatch
from agentrl.run.tracking import make_trackers


@dataclass(frozen=True)
class PendingBatch:
    """A rollout in flight: Ray references to its samples (they go to the trainers without passing
    through the driver) and its metrics."""

    step: int
    samples: Any
    metrics: Any
    examples: Any


class Run:
    """Use as a context manager: ``with Run(cfg, resume=...) as run: schedule(run)``."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, overwrite: bool = False) -> None:
        """Claims the output directory (:func:`claim_output_dir`) before anything starts."""
        from agentrl.run.placement import absolute_paths

        self.cfg = cfg = absolute_paths(cfg)  # actors on a cluster do not run in this directory
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        claim_output_dir(self.out, resume=resume, overwrite=overwrite)
        self.checkpoints = CheckpointDir(self.out / "checkpoints")
        self.resume = resume
        self.log_dir = self.out / "logs"
        self.tasks = cfg.task_source()  # a user's data is read and every row checked here, before Ray
        self.heldout = self.tasks.heldout(cfg.eval.num_tasks)
        cap = self.tasks.max_steps(cfg.rollout.prompts_per_step)
        self.last_step = cfg.steps if cap is None else min(cfg.steps, cap)
        resume_step = self.checkpoints.latest_step() if resume else None
        self.trackers = make_trackers(cfg.report_to, self.out, cfg.model_dump(mode="json"), self.out.name,
                                      resume_step=resume_step)
        self.log = MetricsLog(self.out / "metrics.jsonl", resume_step=resume_step, trackers=self.trackers)
        self.sample_log = SampleLog(self.out / "samples", trackers=self.trackers)
        self.first_step = 0
        self.rollout: Any = None
        self.teacher: Any = None  # agentrl.run.distill.Teacher when distilling
        self.trainers: list[Any] = []
        self.plan: Any = None  # agentrl.run.placement.Plan: the placement groups and slots
        self.placement: dict[str, Any] = {}  # where every engine and rank runs (in the first metric row)
        self._deadline = float("inf")
        self.best: tuple[float, int] | None = None  # (best_metric, step)

    # ------------------------------------------------------------------------------------------ lifetime

    def __enter__(self) -> Run:
        import ray

        from agentrl.run.actors import RolloutWorker, remote, start_trainer_group, training_cpu_threads
        from agentrl.run.models import base_model_dir, starting_model_dir, warm_model_dir

        cfg = self.cfg
        # SIGINT/SIGTERM raise in this thread and unwind into __exit__ (agentrl.run.stopping).
        self._signal_scope = stopping.handling()
        handles_signals = self._signal_scope.__enter__()
        (self.out / "config.json").write_text(cfg.model_dump_json(indent=2))
        self.log_dir.mkdir(exist_ok=True)
        print(f"agentrl train: output in {self.out}, process logs in {self.log_dir}", flush=True)
        from agentrl.engine.auth import SECRET_ENV, run_secret
        from agentrl.run import placement

        # Every actor, on every node, gets the run's engine secret (the job's runtime env): engines require
        # it on their weight and control routes, the router on its control plane, the weight sync sends it.
        try:
            cluster = placement.connect(cfg.ray, env_vars={"TOKENIZERS_PARALLELISM": "false", SECRET_ENV: run_secret()},
                                        default_cpus=max(4, cfg.trainer_ranks + 1))
            if handles_signals:  # ray.init set SIGTERM to a handler that kills every Ray process, actors and all
                stopping.install()
            self.plan = placement.reserve_for(cfg, cluster)
            base = base_model_dir(cfg)
            self.rollout = remote(RolloutWorker, num_cpus=0).options(**placement.on_this_node()).remote(
                str(base), cfg.env, cfg.rollout.model_dump(), dtype=cfg.trainer.dtype,
                group_filter=cfg.group_filter, log_dir=str(self.log_dir), **self.plan.rollout_kwargs(),
                external_agent=cfg.external_agent.model_dump() if cfg.external_agent else None, cwd=os.getcwd())
            threads = training_cpu_threads(cfg.schedule, cfg.trainer_ranks, cfg.ray.gpus_per_rank, self.plan.cluster)

            def start_trainers(model_dir: Path) -> list[Any]:
                return start_trainer_group(model_dir, cfg.trainer.model_dump(), cfg.rollout.temperature,
                                           cfg.trainer_ranks, plan=self.plan, cpu_threads=threads)

            # Without a warm-up to run first, the ranks start while the engines do (a run's start-up was
            # these two one after the other: ~16 s and ~9 s for the tiny model on 2 cores). Not when
            # colocated: there the ranks start once the engines have taken their share of the GPUs' memory.
            known = None if cfg.colocate else starting_model_dir(cfg, base)
            if known is not None:
                self.trainers = start_trainers(known)
            engines = ray.get(self.rollout.where.remote())
            placement.check_sync_support(cfg.sync_mode, cfg.sync_options, ray.get(self.rollout.engine_kinds.remote()))
            model_dir = warm_model_dir(cfg, base, self.rollout, self.tasks, self.heldout,
                                       None if self.resume else self.log)
            if known is None:
                self.trainers = start_trainers(model_dir)
            elif model_dir != known:
                raise RuntimeError(f"the ranks started on {known}, the warm-up chose {model_dir}")
            ranks = ray.get([t.where.remote() for t in self.trainers])
            self.placement = placement.placement_record(cluster, engines, ranks)
            print(f"agentrl train: placement: {placement.describe(self.placement)}", flush=True)
            placement.check_reachable(cfg.sync_mode, cfg.sync_options, engines, ranks[0])
            urls = ray.get(self.rollout.engine_urls.remote())
            options = placement.sync_options_for(cfg.sync_mode, cfg.sync_options, self.plan)
            ray.get([t.configure_sync.remote(cfg.sync_mode, urls, options) for t in self.trainers])
            from agentrl.run.distill import Teacher

            self.teacher = Teacher.start(cfg, base, self.trainers, self.log_dir)
            self._start(model_dir)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _start(self, model_dir: Path) -> None:
        """Resume from the latest checkpoint, or record step 0 (the starting model's evaluation) and
        checkpoint it, so a crash in step 1 resumes without a new warm-up."""
        import ray

        if self.resume:
            extra = ray.get([t.load_checkpoint.remote(str(self.checkpoints.latest())) for t in self.trainers])[0]
            self.first_step = extra["step"]
            ray.get(self.rollout.load_buffer_state.remote(extra["buffer"]))
            self.tasks.load_state_dict(extra.get("data", {}), self.first_step)
        self.update_weights(self.first_step)  # engines serve exactly the trainer's weights before any sample
        if not self.resume:
            evaluation = self.evaluate()
            with stopping.deferred():
                self.log.write({"step": 0, "model_dir": str(model_dir), "placement": self.placement, **evaluation})
            self._keep_if_best(0, evaluation)
            self.save(0)
        else:
            self._placement_due = True  # the resumed run records where it runs in its first row
            scored = [(r[self.cfg.eval.best_metric], r["step"]) for r in self.log.rows()
                      if "step" in r and self.cfg.eval.best_metric in r]
            self.best = max(scored, key=lambda b: (b[0], -b[1])) if scored else None
        # After the step-0 evaluation: a fully_async pool starts admitting at once.
        ray.get(self.rollout.start_pool.remote(self.tasks, self.first_step, self.cfg))
        self._deadline = time.monotonic() + self.cfg.max_minutes * 60

    def __exit__(self, exc_type: type[BaseException] | None = None, *exc: object) -> None:
        """Stop the rollout actor (its episodes, the environments' ``close_resources()``, router, engines)
        and the trainer ranks, each wait bounded, then Ray. Stop signals cannot cut it short; a stop
        signal that ended the run is reported with the checkpoint a ``--resume`` starts from."""
        import ray

        started = time.monotonic()
        stopped_by = stopping.requested() if exc_type is not None and issubclass(exc_type, KeyboardInterrupt) else None
        errors: list[BaseException] = []
        with stopping.shielded():
            if stopped_by is not None:
                _say(f"stopping every process of the run (at most {ROLLOUT_SHUTDOWN_S + TRAINER_CLOSE_S:.0f} s)")
            try:
                waits = []  # issued together, so the rollout shutdown does not queue behind a trainer step
                if self.rollout is not None:
                    waits.append(("the rollout actor (episodes, environment resources, router, engines)",
                                  [self.rollout.shutdown.remote()], ROLLOUT_SHUTDOWN_S))
                if self.trainers:
                    waits.append(("the trainer ranks", [t.close.remote() for t in self.trainers], TRAINER_CLOSE_S))
                if self.teacher is not None:
                    waits.append(("the distillation teacher's engines", [self.teacher.shutdown()], ROLLOUT_SHUTDOWN_S))
                for what, refs, timeout in waits:
                    errors += _settle(refs, started + timeout, what)
            finally:
                self.trainers, self.rollout, self.teacher = [], None, None
                if self.plan is not None:
                    self.plan.remove()
                    self.plan = None
                ray.shutdown()
                if errors:  # the rollout actor may have died holding sandboxes: remove what has no owner now
                    _remove_orphaned_sandboxes()
                for tracker in self.trackers:
                    tracker.close()
                self.trackers = self.log.trackers = self.sample_log.trackers = []
                if (self.out / "metrics.jsonl").exists():
                    plot_curves(self.out / "metrics.jsonl", self.out / "reward_curve.png")
                scope, self._signal_scope = getattr(self, "_signal_scope", None), None
                if scope is not None:
                    scope.__exit__(None, None, None)
        if stopped_by is not None:
            latest = self.checkpoints.latest_step()
            where = f"step {latest} (`--resume` continues from it)" if latest is not None else "none"
            _say(f"{stopping.signal_name(stopped_by)}: every process of the run stopped in "
                 f"{time.monotonic() - started:.1f} s; last checkpoint: {where}")
        if errors and exc_type is None:
            raise errors[0]

    def steps(self) -> range:
        return range(self.first_step, self.last_step)

    # ------------------------------------------------------------------------------------------ the verbs

    def generate(self, step: int) -> PendingBatch:
        """The batch trained at the weights of version ``step`` (update_weights(step) precedes its training):
        ``sync`` and ``async`` admit the step's tasks now (a function of the step, so a resumed run reads on)
        and the batch is all of their groups; ``fully_async`` takes the next groups its pool completed."""
        admit = None if self.cfg.schedule == "fully_async" else step
        samples, metrics, examples = self.rollout.take_batch.options(num_returns=3).remote(
            step, self.cfg.log_samples, admit)
        return PendingBatch(step, samples, metrics, examples)

    def score_with_teacher(self, batch: PendingBatch) -> PendingBatch:
        """``batch`` with teacher log-probs on the student's sampled tokens (``distill``); as it is without one."""
        return batch if self.teacher is None else self.teacher.score(batch)

    @contextmanager
    def generation_paused(self) -> Iterator[None]:
        """No turn is generated inside: turns in flight finished or were aborted (``partial_rollout``)."""
        import ray

        ray.get(self.rollout.pause_generation.remote())
        try:
            yield
        finally:
            ray.get(self.rollout.continue_generation.remote())

    def train(self, batch: PendingBatch) -> dict[str, Any]:
        """One GRPO step of every trainer rank on ``batch``; returns its rollout and training metrics."""
        import ray

        metrics = ray.get(batch.metrics)
        examples = ray.get(batch.examples)
        with stopping.deferred():
            self.sample_log.write(batch.step + 1, examples)
        if self.cfg.colocate:
            ray.get(self.rollout.release_memory.remote())
        started = time.perf_counter()
        trained = ray.get([t.train.remote(batch.samples) for t in self.trainers])[0]
        metrics.update(train_row(trained))
        metrics["train/seconds"] = time.perf_counter() - started
        if self.cfg.colocate:
            ray.get(self.rollout.resume_memory.remote())
        return metrics

    def update_weights(self, version: int) -> dict[str, float]:
        """Send the trainer's weights to every engine as ``version``; the engines confirm it."""
        import ray

        report = ray.get([t.sync_weights.remote(str(version)) for t in self.trainers])[0]
        return {"sync/seconds": report["seconds"], "sync/bytes_sent": report["bytes_sent"],
                "sync/full_bytes": report["full_bytes"]}

    def evaluate(self) -> dict[str, float]:
        """Held-out pass@k of the weights the engines serve (``eval_accuracy``: greedy; :mod:`agentrl.rollout.passk`)."""
        import ray

        return ray.get(self.rollout.evaluate.remote(self.heldout, self.cfg.eval.passk(self.cfg.rollout.temperature)))

    def save(self, step: int) -> None:
        """Checkpoint every rank and the data buffer as ``step``; point ``latest`` at it."""
        import ray

        with stopping.deferred():  # a stop signal waits for the checkpoint and its `latest` pointer
            state = {"step": step, "buffer": ray.get(self.rollout.buffer_state.remote()),
                     "data": self.tasks.state_dict(step, self.cfg.rollout.prompts_per_step)}
            path = str(self.checkpoints.path(step))
            ray.get([t.save_checkpoint.remote(path, state) for t in self.trainers])
            self.checkpoints.mark_latest(step, protect=self.best[1] if self.best else None)

    def export(self, name: str) -> Path:
        """The current policy as a HF model dir, ``OUTPUT_DIR/hf/<name>``."""
        import ray

        out = self.out / "hf" / name
        with stopping.deferred():
            ray.get([t.export_hf.remote(str(out)) for t in self.trainers])
        return out

    def _keep_if_best(self, step: int, evaluation: dict[str, float]) -> None:
        value = evaluation.get(self.cfg.eval.best_metric)
        if value is not None and (self.best is None or value > self.best[0]):
            self.best = (value, step)
            with stopping.deferred():
                self.export("best")
                (self.out / "hf" / "best" / "agentrl_step.json").write_text(
                    json.dumps({"step": step, self.cfg.eval.best_metric: value}))

    def wait(self, batch: PendingBatch | None) -> None:
        """Block until ``batch``'s rollout finished (it then sampled only the weights it started on)."""
        import ray

        if batch is not None:
            ray.wait([batch.metrics])

    def end_step(self, step: int, metrics: dict[str, Any]) -> bool:
        """Record ``step``: evaluate and checkpoint when due (and always on the last step), write its
        metric row. True when the run is over (step cap or time budget)."""
        last = step >= self.last_step or time.monotonic() > self._deadline
        if step % self.cfg.eval.every == 0 or last:
            started = time.perf_counter()
            evaluation = self.evaluate()
            evaluated = time.perf_counter()
            metrics.update(evaluation)
            self._keep_if_best(step, evaluation)
            self.save(step)
            # The evaluation's and the checkpoint's (with the best-policy export) share of the step's wall time.
            metrics["eval/seconds"] = evaluated - started
            metrics["checkpoint/seconds"] = time.perf_counter() - evaluated
        if getattr(self, "_placement_due", False):
            metrics["placement"], self._placement_due = self.placement, False
        with stopping.deferred():
            self.log.write({"step": step, **metrics})
        FailureWatch.of(self).observe(step, metrics)  # every episode failing the same way ends the run
        return last


ROLLOUT_SHUTDOWN_S = 120.0  # episodes cancelled, environment resources closed, router and engines stopped
TRAINER_CLOSE_S = 60.0  # queued behind a trainer step in flight


def _say(message: str) -> None:
    print(f"agentrl train: {message}", file=sys.stderr, flush=True)


def _settle(refs: list[Any], deadline: float, what: str) -> list[BaseException]:
    """Wait for ``refs`` until ``deadline``; the errors (a timeout is one), each reported."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
    except GetTimeoutError as exc:
        _say(f"{what} did not stop in time; Ray's shutdown kills it")
        return [exc]
    except Exception as exc:
        _say(f"stopping {what} failed: {type(exc).__name__}: {exc}")
        return [exc]
    return []


def _remove_orphaned_sandboxes() -> None:
    """Sandboxes whose owner process is gone (a rollout actor killed before its environments closed them)."""
    from agentrl.sandbox.gc import collect_garbage

    try:
        removed = collect_garbage(only_dead_owners=True)
    except Exception as exc:
        _say(f"could not look for sandboxes left behind: {exc} (`agentrl sandbox gc` removes them)")
        return
    if any(removed.values()):
        _say(f"removed sandboxes left behind by a killed actor: {removed}")
