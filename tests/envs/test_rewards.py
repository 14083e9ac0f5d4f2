"""Named reward components: weighted into the training reward, kept on the Sample, averaged in the
summary; a non-finite component fails the episode."""

from __future__ import annotations

import asyncio
import math

import pytest

from agentrl.envs import generate_rollout
from agentrl.envs.arithmetic import ArithmeticEnv, make_tasks
from agentrl.envs.rewards import combine_reward
from agentrl.envs.scripted import ScriptedPolicy
from agentrl.trajectory.sample import NonFiniteRewardError


def test_components_are_weighted_and_unlisted_ones_weigh_one() -> None:
    assert combine_reward({"correct": 1.0, "format": 0.5}, {"format": 0.2}) == (1.1, {"correct": 1.0, "format": 0.5})
    assert combine_reward(0.25, {"format": 3.0}) == (0.25, {})


@pytest.mark.parametrize("raw", [{"correct": math.nan}, {"a": math.inf}, math.nan])
def test_a_non_finite_component_is_refused(raw) -> None:
    with pytest.raises(NonFiniteRewardError):
        combine_reward(raw, {})


@pytest.mark.parametrize("raw", [{}, True, {"a": "1"}])
def test_not_a_reward_is_refused(raw) -> None:
    with pytest.raises((ValueError, TypeError)):
        combine_reward(raw, {})


class Graded(ArithmeticEnv):
    reward_weights = {"format": 0.5}

    def reward(self):
        return {"correct": super().reward(), "format": 1.0 if self.submitted is not None else 0.0}


def test_an_episode_with_components_trains_their_weighted_sum_and_logs_each(tokenizer, renderer) -> None:
    tasks = make_tasks(2, seed=1)
    right = [f'<tool_call>{{"name": "submit", "arguments": {{"answer": {t["a"] + t["b"]}}}}}</tool_call>' for t in tasks]
    policy = ScriptedPolicy(tokenizer, lambda prompt, turn: next(r for r, t in zip(right, tasks, strict=True)
                                                                 if f"{t['a']}+{t['b']}" in prompt))
    result = asyncio.run(generate_rollout(Graded, tasks, policy, renderer, n_samples_per_task=2))
    assert all(s.reward == 1.5 and s.metadata["reward_components"] == {"correct": 1.0, "format": 1.0}
               for s in result.samples) and len(result.samples) == 4
    assert result.summary()["reward_components"] == {"correct": 1.0, "format": 1.0}
