"""pass@k and mean@k evaluation: greedy and sampled episodes per held-out task, summarised per task family.

pass@k is the unbiased estimator of Chen et al. 2021 (the HumanEval paper): from ``n >= k`` episodes of a
task, ``c`` of them passing, the chance that ``k`` episodes drawn without replacement hold at least one pass,
``1 - C(n-c, k) / C(n, k)``; the task's estimates are averaged over the tasks of a family. mean@k is the mean
reward of a task's episodes (an unbiased estimate of the mean of any ``k`` of them), averaged likewise. An
episode passes when its reward reaches ``threshold``; an episode that failed (no sample) passes nothing and
scores 0. Every value comes with a 95% confidence interval over tasks (normal approximation of the mean of
the per-task values, clipped to the values' range).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import uuid
from collections.abc import Sequence
from typing import Any

Z_95 = 1.959963984540054  # two-sided 95% normal quantile
ALL = "all"  # the family every task belongs to


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` episodes of which ``c`` passed: ``1 - C(n-c, k) / C(n, k)``, computed as a
    product (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_up_to(k: int) -> list[int]:
    """The k reported for ``k`` episodes per task: 1, 2, 4, ... below ``k``, and ``k``."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    return sorted({2**i for i in range(k.bit_length()) if 2**i < k} | {k})


def mean_ci(values: Sequence[float], low: float = 0.0, high: float = 1.0) -> tuple[float, float, float]:
    """``(mean, ci_low, ci_high)``: the mean of ``values`` and its 95% normal-approximation interval (standard
    error over the values), clipped to ``[low, high]``; one value gives a zero-width interval."""
    if not values:
        raise ValueError("mean_ci of no values")
    mean = statistics.fmean(values)
    half = Z_95 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, max(low, mean - half), min(high, mean + half)


def summarize(rewards: Sequence[Sequence[float | None]], families: Sequence[str], *, threshold: float = 1.0,
              ks: Sequence[int] | None = None) -> dict[str, dict[str, float]]:
    """Per family (and :data:`ALL`): ``pass@k``, ``mean@k`` and their ``_ci_low`` / ``_ci_high``, from each
    task's episode rewards (``None``: a failed episode). ``ks`` default: :func:`ks_up_to` the episodes per task."""
    if len(rewards) != len(families) or not rewards:
        raise ValueError(f"need one family per task and at least one task, got {len(rewards)} / {len(families)}")
    n = len(rewards[0])
    if any(len(r) != n for r in rewards) or n == 0:
        raise ValueError("every task needs the same number (at least one) of episodes")
    ks = list(ks or ks_up_to(n))
    scored = [[0.0 if r is None else float(r) for r in task] for task in rewards]
    groups: dict[str, list[int]] = {ALL: list(range(len(rewards)))}
    for t, family in enumerate(families):
        if family != ALL:
            groups.setdefault(family, []).append(t)
    out: dict[str, dict[str, float]] = {}
    for family, tasks in groups.items():
        row: dict[str, float] = {"tasks": float(len(tasks)),
                                 "failed_episodes": float(sum(r is None for t in tasks for r in rewards[t]))}
        for k in ks:
            passes = [pass_at_k(n, sum(r >= threshold for r in scored[t]), k) for t in tasks]
            row[f"pass@{k}"], row[f"pass@{k}_ci_low"], row[f"pass@{k}_ci_high"] = mean_ci(passes)
        means = [statistics.fmean(scored[t]) for t in tasks]
        lo, hi = min(0.0, *means), max(1.0, *means)
        row[f"mean@{n}"], row[f"mean@{n}_ci_low"], row[f"mean@{n}_ci_high"] = mean_ci(means, lo, hi)
        out[family] = row
    return out


def family_of(task: Any, key: str) -> str:
    """The task's family: its ``key`` field (a dict key or attribute), else :data:`ALL`."""
    value = task.get(key) if isinstance(task, dict) else getattr(task, key, None)
    return ALL if value is None else str(value)


async def episode_rewards(manager: Any, tasks: Sequence[Any], episodes: int, temperature: float) -> list[list[float | None]]:
    """``episodes`` episodes of each task through ``manager``'s engines (an
    :class:`~agentrl.rollout.manager.RolloutManager`) at ``temperature``: each episode's reward, ``None`` for
    one that failed. Nothing is trained, so samples are not proved."""
    from agentrl.rollout.episode_pool import EpisodeRunner
    from agentrl.trajectory import TrajectoryManager

    runner = EpisodeRunner(manager.env_factory, manager.renderer, manager.client().generate_turn,
                           trajectories=TrajectoryManager(policy=manager.settings.policy),
                           episode_function=manager.episode_function(), max_context_tokens=manager.max_context_tokens)
    gate = asyncio.Semaphore(manager.settings.concurrency or 1)
    sampling = {"temperature": temperature, "max_new_tokens": manager.settings.max_new_tokens}
    run_id = uuid.uuid4().hex[:8]

    async def one(t: int, j: int) -> float | None:
        async with gate:
            session = f"passk-{run_id}-{t}-{j}"
            episode = await runner(tasks[t], session, f"passk-{run_id}-{t}", sampling)
        return float(episode.samples[0].reward) if episode.samples else None

    flat = await asyncio.gather(*(one(t, j) for t in range(len(tasks)) for j in range(episodes)))
    return [list(flat[t * episodes:(t + 1) * episodes]) for t in range(len(tasks))]


async def evaluate_passk(manager: Any, tasks: Sequence[Any], *, k: int, temperature: float,
                         family_key: str = "family", threshold: float = 1.0) -> dict[str, Any]:
    """``{"greedy": summary, "sampled": summary}`` (:func:`summarize`): one greedy episode per task, and with
    ``k > 1`` also ``k`` episodes per task sampled at ``temperature``."""
    families = [family_of(t, family_key) for t in tasks]
    result = {"greedy": summarize(await episode_rewards(manager, tasks, 1, 0.0), families, threshold=threshold)}
    if k > 1:
        sampled = await episode_rewards(manager, tasks, k, temperature)
        result["sampled"] = summarize(sampled, families, threshold=threshold)
    return result


def flat_metrics(result: dict[str, Any]) -> dict[str, float]:
    """A :func:`evaluate_passk` result as metric-row keys: ``eval/<greedy|sampled>/<name>`` for all tasks,
    ``eval/<greedy|sampled>/<family>/<name>`` per family."""
    return {(f"eval/{mode}/{name}" if family == ALL else f"eval/{mode}/{family}/{name}"): value
            for mode, summary in result.items() for family, row in summary.items() for name, value in row.items()}


def headline(result: dict[str, Any]) -> dict[str, float]:
    """The all-task values at the top of ``agentrl eval``'s JSON: every ``pass@k`` and ``mean@k`` of the
    sampled episodes (greedy only: of the greedy ones), and ``greedy_accuracy``."""
    rows = result.get("sampled", result["greedy"])[ALL]
    top = {name: value for name, value in rows.items() if "@" in name and "_ci_" not in name}
    return {**top, "greedy_accuracy": result["greedy"][ALL]["mean@1"]}


def run_metrics(result: dict[str, Any]) -> dict[str, float]:
    """A run's evaluation row: :func:`flat_metrics` plus ``eval_accuracy`` (greedy mean reward, failed episodes
    scoring 0) and ``eval_episodes`` (greedy episodes that ended with a sample), as the run has always logged."""
    greedy = result["greedy"][ALL]
    return {"eval_accuracy": greedy["mean@1"], "eval_episodes": greedy["tasks"] - greedy["failed_episodes"],
            **flat_metrics(result)}
