"""The ``fully_async`` schedule: the rollout actor keeps a pool of episodes in flight
(:class:`~agentrl.rollout.episode_pool.EpisodePool`); the trainer takes groups as they complete, and the
weights change between engine steps (pause, update, continue) while episodes are in flight.

Nothing waits for the slowest episode of a batch: a straggler's group is simply trained later, on a newer
trainer, which is what ``max_staleness`` bounds (``stale_groups``: drop it or generate it again). A
resumed run restarts the pool at the checkpoint's step: tasks that were in flight are read again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agentrl.run.session import PendingBatch, Run


class EpisodeStream:
    """The driver's handle on the rollout actor's episode pool: started and stopped with a ``with``."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.counts: dict[str, int] = {}

    def __enter__(self) -> EpisodeStream:
        import ray

        cfg = self.run.cfg
        r = cfg.rollout
        settings: dict[str, Any] = {
            "samples_per_prompt": r.samples_per_prompt, "prompts_per_batch": r.prompts_per_step,
            "groups_per_batch": r.prompts_per_step, "concurrency": r.concurrency,
            "max_staleness": cfg.max_staleness, "stale_groups": cfg.stale_groups,
            "partial_rollout": cfg.partial_rollout, "dynamic_sampling": cfg.dynamic_sampling,
            "max_oversample": cfg.max_oversample, "temperature": r.temperature, "max_new_tokens": r.max_new_tokens,
        }
        ray.get(self.run.rollout.start_pool.remote(self.run.tasks, self.run.first_step, settings))
        return self

    def __exit__(self, exc_type: type[BaseException] | None = None, *exc: object) -> None:
        import ray

        stopping = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        if self.run.rollout is not None and not stopping:  # on a stop signal the rollout actor's shutdown stops it
            self.counts = ray.get(self.run.rollout.stop_pool.remote())

    def take(self, step: int) -> PendingBatch:
        """The next batch of completed groups, for the trainer's weights of version ``step``."""
        samples, metrics, examples = self.run.rollout.take_batch.options(num_returns=3).remote(
            step, self.run.cfg.log_samples)
        return PendingBatch(step, samples, metrics, examples)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No turn is generated inside: turns in flight finished or were aborted (``partial_rollout``)."""
        import ray

        ray.get(self.run.rollout.pause_generation.remote())
        try:
            yield
        finally:
            ray.get(self.run.rollout.continue_generation.remote())


def train_fully_async(run: Run) -> None:
    with EpisodeStream(run) as stream:
        for step in run.steps():
            batch = stream.take(step)
            metrics = run.train(batch)
            with stream.paused():
                metrics |= run.update_weights(step + 1)
            if run.end_step(step + 1, metrics):
                break
