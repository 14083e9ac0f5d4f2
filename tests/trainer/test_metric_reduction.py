"""Step metrics combine over micro-batches and data-parallel ranks by kind: ``*_max`` is a max, ``*_min`` a
min, ``loss`` a sum of shares, the rest means weighted by trained tokens (a mean of per-micro-batch maxima
under-reports the max as soon as a batch needs two micro-batches)."""

from __future__ import annotations

import math
import os
import socket
import warnings

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from trainer_samples import synthetic_samples

from agentrl.trainer.actor import accumulate_metric, metric_kind, reduce_metrics

warnings.filterwarnings("ignore")


def test_kinds_follow_the_name() -> None:
    assert [metric_kind(k) for k in ("is_ratio_max", "x_min", "loss", "is_capped_frac", "kl")] == [
        "max", "min", "sum", "mean", "mean"]


def test_micro_batches_fold_by_kind_and_an_empty_one_gives_no_extreme() -> None:
    totals: dict[str, float] = {}
    # (value, trained tokens) per micro-batch; the third has no trained token and reports placeholders.
    for ratio_max, ratio_min, frac, w in [(3.0, 0.5, 0.25, 4.0), (7.0, 0.9, 1.0, 1.0), (0.0, 0.0, 0.0, 0.0)]:
        accumulate_metric(totals, "is_ratio_max", ratio_max, w)
        accumulate_metric(totals, "is_ratio_min", ratio_min, w)
        accumulate_metric(totals, "is_capped_frac", frac, w)
        accumulate_metric(totals, "loss", -0.5 * w, w)
    out = reduce_metrics(totals, token_weight=5.0)
    assert out["is_ratio_max"] == 7.0  # not the mean of 3 and 7, nor dragged by the empty micro-batch
    assert out["is_ratio_min"] == 0.5  # the empty micro-batch's 0 is no minimum
    assert out["is_capped_frac"] == pytest.approx((0.25 * 4 + 1.0 * 1) / 5, rel=1e-12)  # float64 sums
    assert out["loss"] == pytest.approx(-2.5, rel=1e-12)


def test_an_extreme_nobody_measured_is_zero() -> None:
    totals: dict[str, float] = {}
    accumulate_metric(totals, "is_ratio_max", 0.0, 0.0)
    accumulate_metric(totals, "kl", 0.0, 0.0)
    assert totals["is_ratio_max"] == -math.inf  # the name is held (every rank must reduce the same names)
    assert reduce_metrics(totals, token_weight=0.0) == {"is_ratio_max": 0.0, "kl": 0.0}
    assert reduce_metrics({"kl": 0.0}, 0.0) == {"kl": 0.0}


# ------------------------------------------------------------------------------------ across ranks (gloo)

# Per rank: (is_ratio_max, is_ratio_min, is_capped_frac, trained tokens); rank 2 trained no token.
RANKS = [(2.0, 0.6, 0.5, 2.0), (9.0, 0.8, 0.0, 6.0), (None, None, None, 0.0)]


def _rank_main(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ratio_max, ratio_min, frac, w = RANKS[rank]
    totals: dict[str, float] = {}
    accumulate_metric(totals, "is_ratio_max", ratio_max or 0.0, w)
    accumulate_metric(totals, "is_ratio_min", ratio_min or 0.0, w)
    accumulate_metric(totals, "is_capped_frac", frac or 0.0, w)
    out[rank] = reduce_metrics(totals, w, group=dist.group.WORLD)
    dist.destroy_process_group()


def test_data_parallel_ranks_max_and_min_reduce() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        # spawn, not fork: in the suite an earlier test has set up this process's default process group,
        # and a forked child would inherit it ("initialize the default process group twice")
        mp.start_processes(_rank_main, args=(len(RANKS), port, out), nprocs=len(RANKS), join=True,
                           start_method="spawn")
        results = [dict(out[r]) for r in range(len(RANKS))]
    want = {"is_ratio_max": 9.0, "is_ratio_min": 0.6, "is_capped_frac": (0.5 * 2 + 0.0 * 6) / 8}
    for got in results:  # every rank reports the same global values
        assert got == pytest.approx(want, rel=1e-12)  # float64 sums of exact binary fractions


# ------------------------------------------------------------------------------------ through train_step


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_train_step_reports_the_largest_ratio_of_the_whole_batch(tiny_dir) -> None:
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.losses import LossConfig
    from agentrl.trainer.trainer_config import TrainerConfig

    samples = synthetic_samples(n_groups=3, per_group=3, seed=1)
    # 40 padded tokens a micro-batch: several micro-batches, each with its own largest ratio.
    trainer = MegatronTrainer(tiny_dir, TrainerConfig(max_tokens_per_microbatch=40, attention="sdpa",
                                                      loss=LossConfig(importance_weights="tis")))
    assert len(trainer._micro_batches(samples)) > 1
    old = trainer.compute_logprobs(samples)  # the behaviour log-probs the step's ratio is taken against
    ratios = [[math.exp(o - r) for o, r, m in zip(lp, s["rollout_logprobs"], s["loss_mask"], strict=True) if m]
              for lp, s in zip(old, samples, strict=True)]
    flat = [x for row in ratios for x in row]
    metrics = trainer.train_step(samples)
    # log-probs of two forwards agree within 1e-5 (test_trainer): the ratio within about 1e-5 relative
    assert metrics["is_ratio_max"] == pytest.approx(max(flat), rel=1e-4)
    assert metrics["is_ratio_mean"] == pytest.approx(sum(flat) / len(flat), rel=1e-4)
