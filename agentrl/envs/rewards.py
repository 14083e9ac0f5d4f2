"""Named reward components: an environment's ``reward()`` may return ``{"correct": 1.0, "format": 0.5}``;
the episode's training reward is their weighted sum. Every component is kept (``Sample.metadata
["reward_components"]``) and logged (``rollout/reward_components/<name>``)."""

from __future__ import annotations

from collections.abc import Mapping

from agentrl.trajectory.sample import check_reward


def combine_reward(raw: float | Mapping[str, float], weights: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """``(training reward, components)``. A plain number is its own reward with no components; a mapping
    sums ``weights.get(name, 1.0) * value``. Every value and the sum must be finite
    (:class:`~agentrl.trajectory.sample.NonFiniteRewardError` otherwise)."""
    if isinstance(raw, Mapping):
        if not raw:
            raise ValueError("reward() returned no components")
        components = {str(k): v for k, v in raw.items()}
        check_reward(components)
        components = {k: float(v) for k, v in components.items()}
        reward = sum(weights.get(k, 1.0) * v for k, v in components.items())
    else:
        if isinstance(raw, bool):
            raise TypeError("reward must be a number, got bool")
        check_reward(raw)
        reward, components = float(raw), {}
    check_reward(reward)
    return reward, components
