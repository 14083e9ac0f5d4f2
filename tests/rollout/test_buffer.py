"""DataBuffer keeps GRPO groups whole, filters zero-variance groups and survives a checkpoint round trip."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.rollout.buffer import (
    DataBuffer,
    has_reward_variance,
    keep_all,
    load_samples_jsonl,
    save_samples_jsonl,
    staleness_metrics,
)
from agentrl.trajectory import Provenance, Sample, TokenProvenance


def _sample(group: str, reward: float, n_prompt: int = 2, n_resp: int = 3) -> Sample:
    prov = [TokenProvenance("prompt", 0, None)] * n_prompt + [TokenProvenance("model", 0, "1")] * n_resp
    return Sample(
        tokens=list(range(n_prompt + n_resp)), response_start=n_prompt, loss_mask=[1] * n_resp,
        rollout_logprobs=[-0.5] * n_resp, provenance=Provenance.from_entries(prov), reward=reward, group_id=group,
    )


def test_zero_variance_groups_are_dropped_and_counted() -> None:
    buf = DataBuffer()
    buf.add_groups([[_sample("a", 1.0), _sample("a", 0.0)], [_sample("b", 1.0), _sample("b", 1.0)]])
    assert len(buf) == 1 and buf.groups_added == 2 and buf.groups_dropped == 1
    assert {s.group_id for s in buf.take()} == {"a"}


def test_take_returns_whole_groups_oldest_first_and_advances_cursor() -> None:
    buf = DataBuffer(group_filter=keep_all)
    buf.add_groups([[_sample(g, r) for r in (0.0, 1.0, 0.5)] for g in "xyz"])
    first = buf.take(2)
    assert [s.group_id for s in first] == ["x"] * 3 + ["y"] * 3
    assert buf.cursor == 2 and len(buf) == 1
    assert [s.group_id for s in buf.take()] == ["z"] * 3 and buf.cursor == 3


def test_a_group_mixing_ids_is_rejected_without_losing_earlier_groups() -> None:
    buf = DataBuffer(group_filter=keep_all)
    buf.add_groups([[_sample("a", 0.0), _sample("a", 1.0)]])
    with pytest.raises(ValueError, match="mixes group ids"):
        buf.add_groups([[_sample("b", 0.0), _sample("c", 1.0)]])
    assert len(buf) == 1


def test_state_dict_round_trip_restores_pending_groups_and_cursor() -> None:
    buf = DataBuffer()
    buf.add_groups([[_sample("a", 0.0), _sample("a", 1.0)], [_sample("b", 0.0), _sample("b", 1.0)]])
    buf.take(1)
    restored = DataBuffer()
    restored.load_state_dict(buf.state_dict())
    assert restored.cursor == 1 and len(restored) == 1
    assert [s.to_dict() for s in restored.take()] == [s.to_dict() for s in buf.take()]


def test_jsonl_round_trip(tmp_path) -> None:
    samples = [_sample("a", 0.0), _sample("b", 1.0)]
    assert save_samples_jsonl(samples, tmp_path / "s.jsonl") == 2
    assert [s.to_dict() for s in load_samples_jsonl(tmp_path / "s.jsonl")] == [s.to_dict() for s in samples]


def test_has_reward_variance() -> None:
    assert has_reward_variance([_sample("a", 0.0), _sample("a", 1.0)])
    assert not has_reward_variance([_sample("a", 1.0), _sample("a", 1.0)])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0])), min_size=1, max_size=30))
def test_dynamic_sampling_keeps_exactly_mixed_groups(pairs):
    # The one zero-variance filter (DAPO's dynamic sampling) is the buffer's default group filter.
    buf = DataBuffer()
    by_group: dict[int, list[Sample]] = {}
    for g, r in pairs:
        by_group.setdefault(g, []).append(_sample(str(g), r))
    buf.add_groups(by_group.values())
    kept = {s.group_id for s in buf.take()}
    for g, _ in pairs:
        distinct = {r for gg, r in pairs if gg == g}
        assert (str(g) in kept) == (len(distinct) > 1)


def test_staleness_is_the_lag_of_trained_tokens_and_absent_when_none_is_trained() -> None:
    # _sample's 3 trained tokens were sampled by version "1"
    assert staleness_metrics([_sample("a", 0.0), _sample("a", 1.0)], trainer_version=2) == {
        "rollout/staleness_hist/1": 6.0, "rollout/staleness_max": 1.0, "rollout/staleness_mean": 1.0}
    # A step whose groups were all filtered trains nothing: no lag is claimed (a plain one-step-off run
    # showed staleness 0 on such steps, which read as "fresh")
    assert staleness_metrics([], trainer_version=2) == {}
    untrained = _sample("a", 0.0)
    untrained.loss_mask = [0] * len(untrained.loss_mask)
    assert staleness_metrics([untrained], trainer_version=2) == {}
