"""Micro-batch planning and collation: budgets, alignment of masks / log-probs with tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_samples import synthetic_samples

from agentrl.trainer.batch import make_micro_batches, plan_micro_batches, response_values, validate_sample


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 120))
def test_plan_covers_every_sequence_once_within_budget(lengths, budget):
    plans = plan_micro_batches(lengths, budget)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for p in plans:
        longest = max(lengths[i] for i in p)
        assert len(p) == 1 or longest * len(p) <= budget


def test_collate_aligns_mask_and_logprobs_with_tokens():
    samples = synthetic_samples(n_groups=2, per_group=3, seed=0)
    mbs = make_micro_batches(samples, max_tokens=60, advantages=[float(i) for i in range(len(samples))])
    assert len(mbs) > 1
    seen = set()
    for mb in mbs:
        for row, i in enumerate(mb.index):
            s = samples[i]
            n, start = len(s["tokens"]), s["response_start"]
            assert mb.tokens[row, :n].tolist() == s["tokens"]
            assert mb.loss_mask[row, :start].sum() == 0 and mb.loss_mask[row, n:].sum() == 0
            assert mb.loss_mask[row, start:n].tolist() == s["loss_mask"]
            assert mb.advantages[row].item() == float(i)
            seen.add(i)
        values = response_values(mb.rollout_logprobs, mb)
        for row, i in enumerate(mb.index):
            assert values[row] == pytest.approx(samples[i]["rollout_logprobs"])
        assert torch.equal(mb.position_ids[0], torch.arange(mb.tokens.shape[1]))
    assert seen == set(range(len(samples)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"response_start": 0}, "response_start=0"),
        ({"loss_mask": [1]}, "loss_mask has 1 entries"),
        ({"rollout_logprobs": [0.0]}, "rollout_logprobs has 1 entries"),
        ({"tokens": None}, "needs tokens"),
    ],
)
def test_bad_samples_are_named(change, message):
    s = dict(synthetic_samples(1, 1, seed=0)[0], **change)
    with pytest.raises(ValueError, match=message):
        validate_sample(s, 0)
    with pytest.raises(ValueError, match="budget|positive"):
        plan_micro_batches([3], 0)


def test_trajectory_sample_objects_are_accepted():
    from agentrl.trajectory import Sample

    d = synthetic_samples(1, 1, seed=0)[0]
    fields = {k: d[k] for k in ("tokens", "response_start", "loss_mask", "rollout_logprobs", "reward", "group_id")}
    sample = Sample(provenance=None, **fields)  # provenance is not read by the trainer
    (mb,) = make_micro_batches([sample], max_tokens=1000)
    assert mb.tokens[0].tolist() == d["tokens"]
