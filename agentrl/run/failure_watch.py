"""Stop a run that trains on nothing: when every episode of ``ALL_FAILED_STEPS`` steps in a row failed,
all with the same exception class (a task key the environment reads missing from every row, a reward
server that refuses everything), the run ends with that error instead of running to its last step."""

from __future__ import annotations

from typing import Any

# Three steps: one bad step can be bad luck (an outage that heals), three in a row of nothing but
# the same failure is a run that cannot train; at the main job's ~2 s a step this costs seconds.
ALL_FAILED_STEPS = 3
_REASON = "rollout/failure_reasons/"


class AllEpisodesFailedError(RuntimeError):
    """Every episode of the last ``ALL_FAILED_STEPS`` steps failed the same way."""


class FailureWatch:
    """Counts consecutive steps whose episodes all failed with one exception class."""

    def __init__(self, patience: int = ALL_FAILED_STEPS) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience = patience
        self._streak: list[int] = []
        self._reason: str | None = None

    @classmethod
    def of(cls, owner: Any) -> FailureWatch:
        """The watch kept on ``owner`` (a run session), made on first use."""
        watch = getattr(owner, "_failure_watch", None)
        if watch is None:
            watch = cls()
            owner._failure_watch = watch
        return watch

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """Feed one step's metrics (``rollout/episodes``, ``rollout/failed``,
        ``rollout/failure_reasons/<class>``); raise :class:`AllEpisodesFailedError` on the ``patience``-th
        step in a row whose episodes all failed with one and the same class."""
        episodes, failed = metrics.get("rollout/episodes", 0), metrics.get("rollout/failed", 0)
        reasons = [k[len(_REASON):] for k, v in metrics.items() if k.startswith(_REASON) and v]
        if not (episodes and failed >= episodes and len(reasons) == 1):
            self._streak, self._reason = [], None
            return
        if reasons[0] != self._reason:
            self._streak, self._reason = [], reasons[0]
        self._streak.append(step)
        if len(self._streak) >= self.patience:
            raise AllEpisodesFailedError(
                f"every episode of steps {self._streak[0]}-{self._streak[-1]} failed with {self._reason} "
                f"({int(failed)} of {int(episodes)} in the last): the run stops instead of training on nothing; "
                "the episodes' errors are in the log and in the failed episodes' metrics")
