"""A NaN or infinite reward never becomes a Sample: refused where samples are built or loaded."""

from __future__ import annotations

import json
import math

import pytest

from agentrl.trajectory import Sample, TrajectoryManager, TurnRecord
from agentrl.trajectory.sample import NonFiniteRewardError, check_reward

USER = {"role": "user", "content": "q"}
ANSWER = {"role": "assistant", "content": "a"}
BAD = [math.nan, math.inf, -math.inf, {"score": 1.0, "format": math.nan}, {"score": -math.inf}]


def _manager() -> TrajectoryManager:
    manager = TrajectoryManager()
    turn = TurnRecord(prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.5, -0.25], finish_reason="stop")
    manager.record_turn("s", turn=turn, prompt_messages=[USER], response_message=ANSWER)
    return manager


@pytest.mark.parametrize("reward", BAD, ids=repr)
def test_get_trajectory_refuses_a_non_finite_reward_and_keeps_the_session(reward):
    manager = _manager()
    with pytest.raises(NonFiniteRewardError, match="must be a finite number"):
        manager.get_trajectory("s", reward=reward)
    assert manager.has_session("s")
    (sample,) = manager.get_trajectory("s", reward=1.0)  # the corrected call finds the session
    assert sample.reward == 1.0


@pytest.mark.parametrize("reward", BAD, ids=repr)
def test_sample_from_dict_refuses_a_non_finite_reward(reward):
    (sample,) = _manager().get_trajectory("s", reward=0.5)
    data = json.loads(json.dumps({**sample.to_dict(), "reward": reward}))  # JSON's NaN / Infinity tokens
    with pytest.raises(NonFiniteRewardError, match="reward.* must be a finite number"):
        Sample.from_dict(data)
    assert Sample.from_dict(sample.to_dict()).reward == 0.5


def test_check_reward_names_the_component():
    check_reward(0)
    check_reward({"score": 1.0, "format": -2})
    with pytest.raises(NonFiniteRewardError, match=r"reward component 'format' must be a finite number, got nan"):
        check_reward({"score": 1.0, "format": math.nan})
    with pytest.raises(TypeError, match="reward component 'score' must be a number, got str"):
        check_reward({"score": "1"})
    assert issubclass(NonFiniteRewardError, ValueError)
