"""DataBuffer judges GRPO groups whole, drops zero-variance groups, counts them across a checkpoint; staleness."""

from __future__ import annotations

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


def test_zero_variance_groups_are_dropped_and_counted_in_order() -> None:
    buf = DataBuffer()
    groups = [[_sample("a", 1.0), _sample("a", 0.0)], [_sample("b", 1.0), _sample("b", 1.0)], [],
              [_sample("c", 0.0), _sample("c", 1.0)]]
    assert [g[0].group_id for g in buf.kept(groups)] == ["a", "c"]  # the empty group is not judged
    assert buf.groups_added == 3 and buf.groups_dropped == 1
    assert DataBuffer(group_filter=keep_all).kept(groups) == [g for g in groups if g]


def test_state_dict_round_trip_restores_the_counts_and_reads_old_checkpoints() -> None:
    buf = DataBuffer()
    buf.kept([[_sample("a", 0.0), _sample("a", 1.0)], [_sample("b", 1.0), _sample("b", 1.0)]])
    restored = DataBuffer()
    restored.load_state_dict(buf.state_dict())
    assert (restored.groups_added, restored.groups_dropped) == (2, 1)
    old = DataBuffer()  # a checkpoint from before the episode pool: a cursor and (never used) pending groups
    old.load_state_dict({"cursor": 7, "groups_added": 9, "groups_dropped": 4, "pending": []})
    assert (old.groups_added, old.groups_dropped) == (9, 4)


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
    kept = {g[0].group_id for g in buf.kept(by_group.values())}
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
