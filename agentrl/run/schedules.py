"""The training schedules: each a screen of :class:`~agentrl.run.session.Run` verbs.

Every schedule trains on the one rollout path, the rollout actor's episode pool
(:class:`~agentrl.rollout.episode_pool.EpisodePool`); they differ only in *when a batch is admitted* and
*where they wait* for it (as in slime). ``sync`` admits batch t at ``generate(t)``, after the weights of
step t-1 reached the engines; ``async`` (one step off) admits batch t+1 before training on batch t and
lets it finish before the sync, so every batch is sampled by exactly one weight version and is at most one
step stale; ``fully_async`` never waits for a batch: the pool keeps admitting, episodes stay in flight
across weight updates (the engines pause between turns while the weights change), and ``max_staleness``
bounds how old a trained token may be (``stale_groups``: drop it or generate it again). A resumed
fully_async run restarts the pool at the checkpoint's step: tasks that were in flight are read again.
``score_with_teacher`` gives a batch its teacher targets when the run distills (``distill``), else it is the batch.
A new schedule is a new function in :data:`SCHEDULES`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agentrl.run.config import RunConfig
from agentrl.run.session import Run


def train_sync(run: Run) -> None:
    for step in run.steps():
        batch = run.score_with_teacher(run.generate(step))
        metrics = run.train(batch)
        metrics |= run.update_weights(step + 1)
        if run.end_step(step + 1, metrics):
            break


def train_one_step_off(run: Run) -> None:
    pending = run.score_with_teacher(run.generate(run.first_step)) if run.steps() else None
    for step in run.steps():
        batch = pending
        pending = run.score_with_teacher(run.generate(step + 1)) if step + 1 < run.steps().stop else None
        metrics = run.train(batch)
        run.wait(pending)  # the in-flight batch finishes on the weights it started with
        metrics |= run.update_weights(step + 1)
        if run.end_step(step + 1, metrics):
            break


def train_fully_async(run: Run) -> None:
    for step in run.steps():
        batch = run.score_with_teacher(run.generate(step))  # the next ready groups; the pool keeps admitting
        metrics = run.train(batch)
        with run.generation_paused():  # no turn runs on the engines while the weights change
            metrics |= run.update_weights(step + 1)
        if run.end_step(step + 1, metrics):
            break


SCHEDULES: dict[str, Callable[[Run], None]] = {"sync": train_sync, "async": train_one_step_off,
                                                "fully_async": train_fully_async}


def train(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False) -> Path:
    """Run ``cfg`` under its schedule; returns the output directory (metrics.jsonl, reward_curve.png,
    checkpoints/, logs/, and the final and best policies as HF dirs in hf/final, hf/best)."""
    with Run(cfg, resume=resume, overwrite=overwrite) as run:
        SCHEDULES[cfg.schedule](run)
        run.export("final")
    return run.out
