"""Off-policy correction: truncated (tis) and masked (mis) importance weights against hand computations,
and their metrics (mean / max ratio, fraction capped) through :func:`policy_loss`."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from agentrl.trainer.losses import LossConfig, mis_weights, policy_loss, tis_weights

# trainer log-probs (old) vs sampler log-probs (rollout), chosen so the ratios are e^0.9, e^-1, e^0.3, e^-0.2
OLD = torch.tensor([[-0.1, -2.0, -0.5, -1.2]])
ROLLOUT = torch.tensor([[-1.0, -1.0, -0.8, -1.0]])
RATIOS = [math.exp(0.9), math.exp(-1.0), math.exp(0.3), math.exp(-0.2)]  # 2.4596, 0.3679, 1.3499, 0.8187


def test_truncated_weights_are_the_clamped_ratio() -> None:
    got = tis_weights(OLD, ROLLOUT, clip=2.0, clip_low=0.5)[0].tolist()
    want = [min(max(r, 0.5), 2.0) for r in RATIOS]  # [2.0, 0.5, 1.3499, 0.8187]
    assert got == pytest.approx(want, rel=1e-6)  # float32 exp vs math.exp


def test_masked_weights_keep_the_ratio_inside_the_bounds_and_zero_outside() -> None:
    got = mis_weights(OLD, ROLLOUT, low=0.5, high=2.0)[0].tolist()
    want = [0.0, 0.0, RATIOS[2], RATIOS[3]]  # e^0.9 > 2 and e^-1 < 0.5 are masked out
    assert got == pytest.approx(want, rel=1e-6)
    assert got[0] == 0.0 and got[1] == 0.0  # exactly zero: no gradient at all


@pytest.mark.parametrize("plugin", ["tis", "mis"])
def test_policy_loss_scales_each_token_by_its_weight_and_reports_ratio_metrics(plugin: str) -> None:
    logprobs = OLD.clone().requires_grad_(True)  # on-policy w.r.t. the trainer: PPO ratio 1, no PPO clip
    adv = torch.tensor([1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is not trained
    cfg = LossConfig(importance_weights=plugin, tis_clip=2.0, tis_clip_low=0.5, mis_low=0.5, mis_high=2.0)
    loss, m = policy_loss(logprobs, OLD, adv, mask, cfg, rollout_logprobs=ROLLOUT)
    loss.backward()
    weights = [2.0, 0.5, RATIOS[2]] if plugin == "tis" else [0.0, 0.0, RATIOS[2]]
    # loss = mean over trained tokens of -A * ratio(=1) * w; d loss / d logprob_t = -w_t / 3
    assert float(loss.detach()) == pytest.approx(-sum(weights) / 3, rel=1e-6)
    assert logprobs.grad[0].tolist() == pytest.approx([-w / 3 for w in weights] + [0.0], rel=1e-6, abs=1e-9)
    assert float(m["is_ratio_mean"]) == pytest.approx(sum(RATIOS[:3]) / 3, rel=1e-6)
    assert float(m["is_ratio_max"]) == pytest.approx(RATIOS[0], rel=1e-6)  # the untrained 4th is not counted
    assert float(m["is_capped_frac"]) == pytest.approx(2 / 3, rel=1e-6)  # tokens 0 and 1 capped / masked
    assert float(m["tis_mean"]) == pytest.approx(sum(weights) / 3, rel=1e-6)


def test_uncapped_batch_reports_nothing_capped() -> None:
    cfg = LossConfig(importance_weights="mis", mis_low=0.1, mis_high=10.0)
    _, m = policy_loss(OLD, OLD, torch.tensor([1.0]), torch.ones(1, 4), cfg, rollout_logprobs=ROLLOUT)
    assert float(m["is_capped_frac"]) == 0.0


def test_masked_is_bounds_must_hold_one() -> None:
    with pytest.raises(ValidationError, match="must hold 1"):
        LossConfig(importance_weights="mis", mis_low=1.2, mis_high=2.0)
    with pytest.raises(ValidationError, match="must hold 1"):
        LossConfig(mis_low=0.5, mis_high=0.9)
