"""Reference tests for agentrl.trainer.losses: each function against a plain-Python loop on random tensors."""

from __future__ import annotations

import math
import random

import pytest
import torch

from agentrl.trainer import losses as L


def _rand(seed: int, b: int = 4, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3
    old = lp + torch.randn(b, t, generator=g) * 0.3
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    return lp, old, adv, mask


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_advantages_match_loop(scale_by_std):
    rng = random.Random(0)
    rewards = [rng.choice([0.0, 0.5, 1.0]) + rng.random() for _ in range(12)]
    groups = [i // 4 for i in range(12)]
    got = L.grpo_advantages(torch.tensor(rewards), groups, scale_by_std=scale_by_std)
    for g in set(groups):
        rs = [r for r, gg in zip(rewards, groups, strict=True) if gg == g]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
        for i, gg in enumerate(groups):
            if gg == g:
                want = (rewards[i] - mean) / (std + 1e-6) if scale_by_std else rewards[i] - mean
                assert got[i].item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_grpo_advantages_singleton_and_constant_groups_are_zero():
    adv = L.grpo_advantages(torch.tensor([1.0, 3.0, 3.0, 5.0]), ["a", "b", "b", "c"])
    assert torch.equal(adv, torch.zeros(4))


def test_grpo_advantages_rejects_mismatched_groups():
    with pytest.raises(ValueError, match="one group id each"):
        L.grpo_advantages(torch.tensor([1.0, 2.0]), [0])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_formulas(kind):
    lp, old, _, _ = _rand(1)
    ref = old
    got = L.kl_penalty(lp, ref, kind)
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            r = lp[i, j].item() - ref[i, j].item()
            want = {"k1": r, "k2": 0.5 * r * r, "k3": math.exp(-r) - 1 + r, "low_var_kl": min(max(math.exp(-r) - 1 + r, -10), 10)}[kind]
            assert got[i, j].item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_low_var_kl_is_bounded_and_k3_is_nonnegative():
    lp = torch.tensor([[0.0, -30.0, 5.0]])
    ref = torch.tensor([[-30.0, 0.0, 0.0]])
    assert L.kl_penalty(lp, ref, "low_var_kl").abs().max() <= 10.0
    assert (L.kl_penalty(*_rand(2)[:2], "k3") >= 0).all()
    with pytest.raises(ValueError):
        L.kl_penalty(lp, ref, "k9")  # type: ignore[arg-type]


def test_kl_in_reward_subtracts_masked_sum():
    lp, old, _, mask = _rand(3)
    r = torch.randn(4)
    got = L.kl_in_reward(r, lp, old, mask, 0.1)
    want = r - 0.1 * ((lp - old) * mask).sum(-1)
    torch.testing.assert_close(got, want)


def test_reductions():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert L.reduce_tokens(v, m, "token_mean").item() == pytest.approx(10 / 4)
    assert L.reduce_tokens(v, m, "seq_mean").item() == pytest.approx((2 + 4) / 2)
    assert L.reduce_tokens(v, m, "token_sum").item() == pytest.approx(10)
    # Global denominators: two halves with n_tokens=4 sum to the whole-batch token mean.
    halves = L.reduce_tokens(v[:1], m[:1], n_tokens=4) + L.reduce_tokens(v[1:], m[1:], n_tokens=4)
    assert halves.item() == pytest.approx(10 / 4)
    with pytest.raises(ValueError):
        L.reduce_tokens(v, m, "mean")  # type: ignore[arg-type]


@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_clip_matches_loop(eps_high, dual):
    lp, old, adv, _ = _rand(4)
    lp = old + torch.randn_like(lp)  # large ratios so every branch is hit
    loss, clipped = L.ppo_clip_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=eps_high, eps_clip_c=dual)
    hi = 0.2 if eps_high is None else eps_high
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            ratio = math.exp(lp[i, j].item() - old[i, j].item())
            a = adv[i, j].item()
            want = max(-a * ratio, -a * min(max(ratio, 0.8), 1 + hi))
            was_clipped = -a * min(max(ratio, 0.8), 1 + hi) > -a * ratio
            if dual is not None and a < 0:
                if want > -a * dual:
                    was_clipped = True
                want = min(want, -a * dual)
            assert loss[i, j].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
            assert bool(clipped[i, j].item()) == was_clipped


def test_ppo_clip_rejects_bad_dual_clip():
    lp, old, adv, _ = _rand(5)
    with pytest.raises(ValueError, match="eps_clip_c"):
        L.ppo_clip_loss(lp, old, adv, eps_clip_c=0.5)


def test_ppo_gradient_at_ratio_one_is_minus_advantage():
    lp, _, adv, mask = _rand(6)
    lp = lp.clone().requires_grad_(True)
    loss, _ = L.ppo_clip_loss(lp, lp.detach(), adv)
    L.reduce_tokens(loss, mask, "token_sum").backward()
    torch.testing.assert_close(lp.grad, -adv * mask)


def test_gspo_ratio_value_and_gradient():
    lp, old, _, mask = _rand(7)
    lp = lp.clone().requires_grad_(True)
    lr = L.gspo_log_ratio(lp, old, mask)
    for i in range(lp.shape[0]):
        n = mask[i].sum().item()
        s = sum((lp[i, j].item() - old[i, j].item()) * mask[i, j].item() for j in range(lp.shape[1])) / n
        assert torch.allclose(lr[i], torch.full_like(lr[i], s), atol=1e-6)
    lr.sum().backward()
    torch.testing.assert_close(lp.grad, torch.ones_like(lp))


def test_tis_weights_truncate_and_carry_no_grad():
    old = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    rollout = torch.tensor([0.0, -2.0, 2.0])
    w = L.tis_weights(old, rollout, clip=2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 2.0, math.exp(-2.0)]))
    assert not w.requires_grad


def test_policy_loss_combines_terms_and_reports_metrics():
    lp, old, adv, mask = _rand(8)
    ref = old - 0.1
    rollout = old + 0.05
    ent = torch.rand_like(lp)
    cfg = L.LossConfig(kl_coef=0.1, kl_type="k3", entropy_coef=0.01, importance_weights="tis", eps_clip_high=0.3)
    loss, m = L.policy_loss(lp, old, adv, mask, cfg, rollout_logprobs=rollout, ref_logprobs=ref, entropy=ent)
    pg, clipped = L.ppo_clip_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=0.3)
    w = L.tis_weights(old, rollout)
    want = (
        L.reduce_tokens(pg * w, mask)
        + 0.1 * L.reduce_tokens(L.kl_penalty(lp, ref, "k3"), mask)
        - 0.01 * L.reduce_tokens(ent, mask)
    )
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert m["clip_frac"].item() == pytest.approx(L.reduce_tokens(clipped, mask).item())
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(0.05, rel=1e-4)
    assert {"pg_loss", "kl", "entropy", "tis_mean", "ratio_mean"} <= set(m)


def test_policy_loss_sequence_advantages_broadcast_and_missing_inputs():
    lp, old, _, mask = _rand(9)
    adv = torch.randn(4)
    a, _ = L.policy_loss(lp, old, adv, mask, L.LossConfig())
    b, _ = L.policy_loss(lp, old, adv[:, None].expand_as(lp), mask, L.LossConfig())
    assert a.item() == pytest.approx(b.item())
    with pytest.raises(ValueError, match="ref_logprobs"):
        L.policy_loss(lp, old, adv, mask, L.LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        L.policy_loss(lp, old, adv, mask, L.LossConfig(importance_weights="tis"))
    with pytest.raises(ValueError, match="entropy"):
        L.policy_loss(lp, old, adv, mask, L.LossConfig(entropy_coef=0.1))


def test_policy_loss_gspo_at_on_policy_equals_token_ppo():
    lp, _, adv, mask = _rand(10)
    a, _ = L.policy_loss(lp, lp.clone(), adv, mask, L.LossConfig(log_ratio="gspo", normalization="seq_mean"))
    b, _ = L.policy_loss(lp, lp.clone(), adv, mask, L.LossConfig(normalization="seq_mean"))
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
