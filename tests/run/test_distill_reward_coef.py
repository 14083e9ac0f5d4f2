"""``distill.reward_coef`` and ``distill.clip``. reward_coef weighs the task advantage beside the teacher's signal:
at 0 the loss is pure distillation (the task advantages change nothing), at 1 the mixed loss as before (bitwise),
in between the task advantage's gradient scales. clip caps each token's teacher gap (the heavy tail of the sampled
reverse KL) and counts the capped tokens. Both reach the trainer's loss and refuse bad values; the two signals'
per-token sizes are reported."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from agentrl.run.distill import DistillSettings
from agentrl.trainer.losses import LossConfig, distill_policy_loss


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(3, 6, generator=g) * 3).requires_grad_()
    teacher = -torch.rand(3, 6, generator=g) * 3
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    present = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    return lp, teacher, mask, present


def _grad(advantages, *, mode, coef, reward_coef, seed=3):
    lp, teacher, mask, present = _batch(seed)
    loss, metrics = distill_policy_loss(lp, lp.detach().clone(), advantages, mask, LossConfig(), teacher_logprobs=teacher,
                                        teacher_mask=present, coef=coef, mode=mode, reward_coef=reward_coef)
    loss.backward()
    return lp.grad, metrics, (lp.detach(), teacher, mask, present)


@pytest.mark.parametrize("mode", ["advantage", "reverse_kl"])
def test_reward_coef_zero_is_pure_distillation(mode) -> None:
    """With reward_coef 0 the task advantages do not change the gradient: it is coef x (lp - teacher) / n on
    the targeted tokens, as with no task advantage at all."""
    pure, _, (lp, teacher, mask, present) = _grad(torch.zeros(3), mode=mode, coef=0.7, reward_coef=1.0)
    ignored, metrics, _ = _grad(torch.tensor([2.0, -1.5, 0.3]), mode=mode, coef=0.7, reward_coef=0.0)
    assert torch.equal(ignored, pure)  # 0 x advantage adds exact zeros: the same sums
    expected = 0.7 * (lp - teacher) * present * mask / mask.sum()
    assert torch.allclose(pure, expected, atol=1e-6)  # float32 sums in another order: 1e-6
    assert float(metrics["distill_task_adv_abs"]) == 0.0


@pytest.mark.parametrize("mode", ["advantage", "reverse_kl"])
def test_reward_coef_scales_the_task_gradient(mode) -> None:
    """On-policy (ratio 1, inside the clip) d loss / d lp_t = (-reward_coef x A + coef x (lp - teacher)) / n."""
    adv = torch.tensor([2.0, -1.5, 0.3])
    grad, metrics, (lp, teacher, mask, present) = _grad(adv, mode=mode, coef=0.5, reward_coef=0.25)
    n = mask.sum()
    expected = (-0.25 * adv[:, None] * mask + 0.5 * (lp - teacher) * present * mask) / n
    assert torch.allclose(grad, expected, atol=1e-6)  # float32 sums in another order: 1e-6
    task_abs = (0.25 * adv.abs()[:, None] * mask).sum() / n
    teacher_abs = (0.5 * (teacher - lp).abs() * present * mask).sum() / n
    assert float(metrics["distill_task_adv_abs"]) == pytest.approx(float(task_abs), rel=1e-6)
    assert float(metrics["distill_teacher_adv_abs"]) == pytest.approx(float(teacher_abs), rel=1e-6)


def test_reward_coef_one_is_the_mixed_loss_bitwise() -> None:
    adv = torch.tensor([2.0, -1.5, 0.3])
    lp, teacher, mask, present = _batch(4)
    kwargs = dict(teacher_logprobs=teacher, teacher_mask=present, coef=1.0, mode="advantage")
    default, _ = distill_policy_loss(lp, lp.detach(), adv, mask, LossConfig(), **kwargs)
    explicit, _ = distill_policy_loss(lp, lp.detach(), adv, mask, LossConfig(), reward_coef=1.0, **kwargs)
    halved, _ = distill_policy_loss(lp, lp.detach(), adv, mask, LossConfig(), reward_coef=0.5, **kwargs)
    assert torch.equal(default, explicit)
    assert not torch.equal(default, halved)


def test_the_setting_reaches_the_loss_and_refuses_negatives(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    settings = DistillSettings(teacher=str(tmp_path), reward_coef=0.0, coef=2.0)
    loss = settings.loss()
    assert (loss.reward_coef, loss.coef, loss.mode) == (0.0, 2.0, "advantage")
    assert DistillSettings(teacher=str(tmp_path)).loss().reward_coef == 1.0
    with pytest.raises(ValidationError, match="reward_coef"):
        DistillSettings(teacher=str(tmp_path), reward_coef=-0.5)
    bound = loss.bind([{"tokens": [1, 2, 3], "response_start": 1, "metadata": {}}], 3)
    assert bound.keywords["reward_coef"] == 0.0


@pytest.mark.parametrize("mode", ["advantage", "reverse_kl"])
def test_clip_caps_each_tokens_gap(mode) -> None:
    """With ``clip`` the gradient is coef x clamp(lp - teacher, -clip, clip) / n on the targeted tokens; the
    reported reverse KL stays the unclipped mean, and the capped fraction is counted."""
    lp, teacher, mask, present = _batch(5)
    teacher = teacher.clone()
    teacher[1, 3] = -40.0  # a heavy-tail token, as a low temperature makes them
    lp_leaf = lp.detach().clone().requires_grad_()
    loss, metrics = distill_policy_loss(lp_leaf, lp.detach(), torch.zeros(3), mask, LossConfig(), teacher_logprobs=teacher,
                                        teacher_mask=present, coef=0.5, mode=mode, clip=1.0)
    loss.backward()
    gap = lp.detach() - teacher
    n = mask.sum()
    assert torch.allclose(lp_leaf.grad, 0.5 * gap.clamp(-1.0, 1.0) * present * mask / n, atol=1e-6)  # float32 sums: 1e-6
    assert float(metrics["distill_reverse_kl"]) == pytest.approx(float((gap * present * mask).sum() / n), rel=1e-6)
    capped = ((gap.abs() > 1.0) & (present * mask > 0)).sum()
    assert capped >= 1
    assert float(metrics["distill_clipped_fraction"]) == pytest.approx(float(capped / n), rel=1e-6)


def test_no_clip_is_the_loss_as_before_bitwise() -> None:
    lp, teacher, mask, present = _batch(6)
    kwargs = dict(teacher_logprobs=teacher, teacher_mask=present, coef=1.0, mode="advantage")
    default, metrics = distill_policy_loss(lp, lp.detach(), torch.tensor([1.0, 0.0, -1.0]), mask, LossConfig(), **kwargs)
    wide, _ = distill_policy_loss(lp, lp.detach(), torch.tensor([1.0, 0.0, -1.0]), mask, LossConfig(), clip=1e9, **kwargs)
    assert torch.equal(default, wide)  # a cap no gap reaches changes no value
    assert "distill_clipped_fraction" not in metrics


def test_clip_setting_reaches_the_loss(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    capped = DistillSettings(teacher=str(tmp_path), clip=2.5).loss()
    assert capped.clip == 2.5
    assert capped.bind([{"tokens": [1, 2, 3], "response_start": 1, "metadata": {}}], 3).keywords["clip"] == 2.5
    assert DistillSettings(teacher=str(tmp_path)).loss().clip is None
    with pytest.raises(ValidationError, match="clip"):
        DistillSettings(teacher=str(tmp_path), clip=0.0)
