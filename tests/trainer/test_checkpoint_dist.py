"""Checkpoints at data-parallel size 2 (two gloo processes under torchrun), resumed at DP=2 and at DP=1.

The session's one ``torchrun --nproc_per_node 2`` launch (conftest.py, two_rank_worker.py) runs
:func:`_run_worker` as its ``ckpt`` part; rank 0 saves what it saw to ``ROOT/results.pt``, and the tests compare
it here (the DP=1 resume runs in the pytest process).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore")
HERE = Path(__file__).parent
LAYOUTS = {"adam": {}, "adam-distributed": {"use_distributed_optimizer": True}}


def _config(layout: str):
    from agentrl.trainer.trainer_config import TrainerConfig

    return TrainerConfig(lr=1e-3, weight_decay=0.1, lr_warmup_steps=1, lr_decay_steps=10, lr_decay_style="cosine",
                         min_lr=1e-4, max_tokens_per_microbatch=64, attention="sdpa", **LAYOUTS[layout])


def _batches():
    sys.path.insert(0, str(HERE))
    from trainer_samples import synthetic_samples

    return [synthetic_samples(n_groups=2, per_group=4, seed=s) for s in (21, 22, 23)]


def _run_worker(root: Path, tiny: Path) -> None:
    """Per layout: the uninterrupted run A (saves before and after its first step), B resumes from the
    step-0 checkpoint after moving away from it, C resumes from the step-1 checkpoint."""
    import torch
    import torch.distributed as dist

    from agentrl.trainer.actor import MegatronTrainer

    b0, b1, b2 = _batches()
    out: dict = {}
    for layout in LAYOUTS:
        cfg = _config(layout)
        a = MegatronTrainer(tiny, cfg)
        assert a.dp_size == 2
        a.save_checkpoint(root / f"{layout}-0", {"weight_version": 0})
        want = [a.train_step(b0)]
        a.save_checkpoint(root / f"{layout}-1", {"weight_version": 1})
        want.append(a.train_step(b1))
        want_w = dict(a.export_hf_named_tensors())

        b = MegatronTrainer(tiny, cfg)
        b.train_step(b2)
        extra_b = b.load_checkpoint(root / f"{layout}-0")
        got_b = [b.train_step(b0), b.train_step(b1)]
        c = MegatronTrainer(tiny, cfg)
        extra_c = c.load_checkpoint(root / f"{layout}-1")
        got_c = c.train_step(b1)
        out[layout] = {
            "extra": (extra_b, extra_c), "metrics_b": got_b == want, "metrics_c": got_c == want[1],
            "weights_b": all(torch.equal(w, want_w[n]) for n, w in b.export_hf_named_tensors()),
            "weights_c": all(torch.equal(w, want_w[n]) for n, w in c.export_hf_named_tensors()),
            "want": want, "want_weights": want_w,
        }
    if dist.get_rank() == 0:
        torch.save(out, root / "results.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def dp2_run(two_ranks):
    import torch

    root = two_ranks["root"] / "ckpt"
    return root, two_ranks["tiny"], torch.load(root / "results.pt", weights_only=False)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dp2_resume_from_before_and_after_the_first_step_is_bitwise(dp2_run, layout):
    got = dp2_run[2][layout]
    assert got["extra"] == ({"weight_version": 0}, {"weight_version": 1})
    assert got["metrics_b"] and got["weights_b"], "resumed from step 0"
    assert got["metrics_c"] and got["weights_c"], "resumed from step 1"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dp2_checkpoint_resumes_at_dp1(dp2_run, layout):
    from agentrl.trainer.actor import MegatronTrainer

    root, tiny, results = dp2_run
    want = results[layout]
    trainer = MegatronTrainer(tiny, _config(layout))
    assert trainer.dp_size == 1
    with pytest.warns(UserWarning, match="saved by 2 ranks, this run has 1: keeping this run's RNG states"):
        assert trainer.load_checkpoint(root / f"{layout}-1") == {"weight_version": 1}
    assert trainer.step == 1
    got = trainer.train_step(_batches()[1])
    # The same update, reduced over one rank instead of two: equal up to float summation order.
    for key in ("loss", "grad_norm", "lr"):
        assert got[key] == pytest.approx(want["want"][1][key], rel=1e-5, abs=1e-7), key
    diff = max((w - want["want_weights"][n]).abs().max().item() for n, w in trainer.export_hf_named_tensors())
    assert diff < 1e-6, diff
