"""Expert parallelism 2 over the two data-parallel ranks of a gloo torchrun launch: each rank holds half the
experts, and log-probs, the step and the exported weights equal one process holding them all (the launch is
the session's one two-rank torchrun, tests/trainer/conftest.py)."""

from __future__ import annotations

import warnings

import torch
from trainer_samples import synthetic_samples

warnings.filterwarnings("ignore")


def test_ep2_matches_one_process(two_ranks):
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    model = two_ranks["moe"]  # the ``ep`` part (moe_ep_worker.py) of the session's two-rank launch (conftest.py)
    ep2 = torch.load(two_ranks["root"] / "ep2.pt", weights_only=False)
    assert ep2["local_experts_per_layer"] == 4  # 8 experts over 2 ranks

    trainer = MegatronTrainer(model, TrainerConfig(optimizer="sgd", lr=1.0, max_tokens_per_microbatch=64))
    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)
    for a, b in zip(trainer.compute_logprobs(batch), ep2["logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5  # fp32; expert outputs summed apart
    ref = trainer.train_step(batch)
    assert abs(ref["loss"] - ep2["metrics"]["loss"]) < 1e-5
    weights = dict(trainer.export_hf_named_tensors())
    assert set(weights) == set(ep2["weights"])
    for name, w in weights.items():
        assert (w - ep2["weights"][name]).abs().max().item() < 1e-5, name
