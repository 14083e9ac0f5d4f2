"""A huge but finite reward (1e39, -1e308, 10**400) never reaches the trainer: its episode is counted and
dropped, and every reward that is accepted stays finite through float32 group normalisation."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from agentrl.envs import generate_rollout
from agentrl.envs.arithmetic import ArithmeticEnv, make_tasks
from agentrl.envs.formats import HermesFormat, ToolCall
from agentrl.envs.rewards import combine_reward
from agentrl.envs.scripted import ScriptedPolicy
from agentrl.trainer.losses import grpo_advantages
from agentrl.trajectory.sample import (
    REWARD_LIMIT,
    BadRewardError,
    NonNumericRewardError,
    RewardOutOfRangeError,
    check_reward,
)

HUGE = [1e39, -1e308, 10**400, -(10**20), REWARD_LIMIT * 1.0000001]


@pytest.mark.parametrize("reward", HUGE, ids=lambda r: f"{r:.3g}" if isinstance(r, float) else "big int")
def test_a_reward_beyond_the_limit_is_refused_by_name(reward):
    with pytest.raises(RewardOutOfRangeError, match="reward must be within"):
        check_reward(reward)
    with pytest.raises(RewardOutOfRangeError, match="reward component 'score' must be within"):
        check_reward({"score": reward})
    assert issubclass(RewardOutOfRangeError, BadRewardError) and issubclass(BadRewardError, ValueError)


def test_weights_cannot_push_the_sum_beyond_the_limit():
    with pytest.raises(RewardOutOfRangeError):
        combine_reward({"a": REWARD_LIMIT, "b": REWARD_LIMIT}, {})


@pytest.mark.parametrize("reward", ["1", None, 1j, [1.0]], ids=repr)
def test_a_non_number_is_a_value_error_too(reward):
    with pytest.raises(NonNumericRewardError, match="must be a number"):
        check_reward(reward)


def test_rewards_at_the_limit_give_finite_float32_advantages():
    # The bound's claim: the trainer's float32 normalisation squares deviations and sums them.
    for n in (2, 8, 4096):
        rewards = torch.tensor([REWARD_LIMIT, -REWARD_LIMIT] * (n // 2), dtype=torch.float64)
        adv = grpo_advantages(rewards, [0] * n)
        assert torch.isfinite(adv).all() and adv.abs().max() > 0.5
    check_reward(REWARD_LIMIT)
    check_reward(-REWARD_LIMIT)
    check_reward(torch.tensor(2.5))  # a 0-d tensor is a number


def test_an_env_scoring_1e39_loses_those_episodes_counted_and_the_rest_train(tokenizer, renderer):
    class Jackpot(ArithmeticEnv):
        def reward(self):
            return 1e39 if super().reward() > 0 else 0.0

    tasks = make_tasks(4, seed=11)
    right = tasks[:2]
    answers = [t["answer"] if t in right else 0 for t in tasks]

    results = []
    for task, answer in zip(tasks, answers, strict=True):
        policy = ScriptedPolicy(tokenizer, [HermesFormat().render_calls([ToolCall("submit", {"answer": answer})])])
        results.append(asyncio.run(generate_rollout(Jackpot, [task], policy, renderer, n_samples_per_task=2)))
    for task, result in zip(tasks, results, strict=True):
        summary = result.summary()
        if task in right:
            assert not result.samples
            assert summary["failed"] == 2 and summary["failure_reasons"] == {"RewardOutOfRangeError": 2}
        else:
            assert len(result.samples) == 2 and summary["failed"] == 0
            rewards = torch.tensor([s.reward for s in result.samples])
            assert torch.isfinite(grpo_advantages(rewards, [0, 0])).all()
            assert math.isfinite(summary["reward_mean"])
