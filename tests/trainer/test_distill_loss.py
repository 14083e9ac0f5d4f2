"""On-policy distillation's loss terms (agentrl.trainer.losses.distill_policy_loss): the task loss when coef is
0, the reverse KL's gradient on exactly the tokens with a teacher target, and the targets' layout."""

from __future__ import annotations

import pytest
import torch

from agentrl.trainer.losses import (
    TEACHER_LOGPROBS,
    DistillLoss,
    LossConfig,
    distill_policy_loss,
    policy_loss,
    teacher_targets,
)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(3, 6, generator=g) * 3).requires_grad_()
    old = lp.detach().clone()
    teacher = -torch.rand(3, 6, generator=g) * 3
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    present = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    return lp, old, torch.tensor([0.5, -1.0, 0.0]), mask, teacher, present


@pytest.mark.parametrize("mode", ["advantage", "reverse_kl"])
def test_coef_zero_is_the_task_loss(mode) -> None:
    lp, old, adv, mask, teacher, present = _batch()
    cfg = LossConfig()
    task, _ = policy_loss(lp, old, adv, mask, cfg)
    mixed, metrics = distill_policy_loss(lp, old, adv, mask, cfg, teacher_logprobs=teacher, teacher_mask=present,
                                         coef=0.0, mode=mode)
    assert torch.equal(mixed, task)  # adding 0 x the term: the same float operations' result
    expected_kl = ((old - teacher) * present * mask).sum() / mask.sum()
    assert float(metrics["distill_reverse_kl"]) == pytest.approx(float(expected_kl), rel=1e-6)
    assert float(metrics["distill_target_fraction"]) == pytest.approx(float((present * mask).sum() / mask.sum()))


@pytest.mark.parametrize("mode", ["advantage", "reverse_kl"])
def test_the_gradient_is_the_reverse_kls_on_targeted_tokens_only(mode) -> None:
    """On-policy (old == lp, ratio 1, inside the clip) with no task advantage, d loss / d lp_t is
    coef * (lp_t - teacher_t) / n_tokens where a target exists and 0 elsewhere: both modes."""
    lp, old, _, mask, teacher, present = _batch(1)
    coef = 0.7
    loss, _ = distill_policy_loss(lp, old, torch.zeros(3), mask, LossConfig(), teacher_logprobs=teacher,
                                  teacher_mask=present, coef=coef, mode=mode)
    loss.backward()
    expected = coef * (old - teacher) * present * mask / mask.sum()
    assert torch.allclose(lp.grad, expected, atol=1e-6)  # float32 sums in another order: 1e-6


def test_a_token_without_target_is_untouched_by_its_teacher_value() -> None:
    lp, old, adv, mask, teacher, present = _batch(2)
    other = teacher.clone()
    other[present == 0] = 123.0  # off-target values must not matter
    a, _ = distill_policy_loss(lp, old, adv, mask, LossConfig(), teacher_logprobs=teacher, teacher_mask=present,
                               coef=1.0, mode="advantage")
    b, _ = distill_policy_loss(lp, old, adv, mask, LossConfig(), teacher_logprobs=other, teacher_mask=present,
                               coef=1.0, mode="advantage")
    assert torch.equal(a, b)


def test_an_unknown_mode_is_refused() -> None:
    lp, old, adv, mask, teacher, present = _batch()
    with pytest.raises(ValueError, match="unknown distill mode"):
        distill_policy_loss(lp, old, adv, mask, LossConfig(), teacher_logprobs=teacher, teacher_mask=present,
                            coef=1.0, mode="forward_kl")


def test_targets_land_at_their_tokens_in_the_padded_layout() -> None:
    samples = [{"tokens": [1, 2, 3, 4, 5], "response_start": 2, "metadata": {TEACHER_LOGPROBS: [-0.5, None, -1.5]}},
               {"tokens": [1, 2, 3], "response_start": 1, "metadata": {}}]
    values, present = teacher_targets(samples, 6)
    assert present.tolist() == [[0, 0, 1, 0, 1, 0], [0] * 6]
    assert values[0, 2] == -0.5 and values[0, 4] == -1.5 and values[1].abs().sum() == 0
    loss_fn = DistillLoss(coef=1.0, mode="advantage").bind(samples, 6)
    assert loss_fn.keywords["teacher_mask"].tolist() == present.tolist()
