"""TP=2 and DP=2 on two gloo processes (the session's one torchrun launch) agree with TP=1 in this process."""

from __future__ import annotations

import warnings

import pytest
import torch
from trainer_samples import synthetic_samples

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def dist_results(two_ranks):
    """The ``dist`` part (dist_worker.py) of the session's two-rank launch (conftest.py)."""
    res = torch.load(two_ranks["root"] / "dist" / "results.pt", weights_only=False)
    return two_ranks["tiny"], two_ranks["qwen3"], res


def test_tp2_logits_match_hf_and_export_is_exact(dist_results):
    tiny, qwen3, res = dist_results
    for d in (str(tiny), str(qwen3)):
        assert res["logit_diff"][d] < 1e-5, (d, res["logit_diff"][d])
        assert res["export_equal"][d], d


def test_tp2_and_dp2_match_tp1(dist_results):
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    tiny, _, res = dist_results
    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)
    trainer = MegatronTrainer(tiny, TrainerConfig(optimizer="sgd", lr=1.0, max_tokens_per_microbatch=64, attention="sdpa"))
    lp = trainer.compute_logprobs(batch)
    for a, b in zip(lp, res["tp2_logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    ref = trainer.train_step(batch)
    weights = dict(trainer.export_hf_named_tensors())
    for layout in ("tp2", "dp2"):
        got = res[f"{layout}_metrics"]
        for key in ("loss", "entropy", "clip_frac", "grad_norm"):
            assert got[key] == pytest.approx(ref[key], abs=1e-5), (layout, key, got[key], ref[key])
        diff = max((res[f"{layout}_weights"][k] - w).abs().max().item() for k, w in weights.items())
        assert diff < 1e-5, (layout, diff)
    distopt = res["dp2_distopt_metrics"]
    for key in ("loss", "entropy", "grad_norm"):  # measured before the (Adam) update
        assert distopt[key] == pytest.approx(ref[key], abs=1e-5), (key, distopt[key], ref[key])
