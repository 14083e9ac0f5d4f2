"""The Megatron trainer on a tiny Qwen3-MoE: moe/* metrics in the step, routing replay forces the recorded
experts exactly, bad routing records are refused."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

LAYERS, TOPK, EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe") / "m", seed=0, arch="qwen3_moe")


def _samples(n: int, seed: int = 0, routed: bool = False) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length, start = rng.randint(12, 24), 5
        tokens = [rng.randint(3, 1000) for _ in range(length)]
        sample = {"tokens": tokens, "response_start": start, "loss_mask": [1] * (length - start),
                  "rollout_logprobs": [-6.9] * (length - start), "reward": float(i % 2), "group_id": i // 4}
        if routed:  # arbitrary expert choices (distinct per layer), the last token left unrecorded
            sample["routed_experts"] = [
                [e for _ in range(LAYERS) for e in rng.sample(range(EXPERTS), TOPK)] for _ in range(length - start - 1)
            ] + [None]
        out.append(sample)
    return out


def _trainer(moe_dir, **moe):
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    return MegatronTrainer(moe_dir, TrainerConfig(lr=1e-3, moe=moe))


def test_train_step_reports_router_metrics(moe_dir):
    trainer = _trainer(moe_dir, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    router = dict(trainer.gpt.named_parameters())["decoder.layers.0.mlp.router.weight"]
    before = router.detach().clone()
    metrics = trainer.train_step(_samples(8))
    # Switch aux loss is 1 for a perfectly balanced router and at least ~1 otherwise (here 8 random experts)
    assert 0.9 < metrics["moe/aux_loss"] < 2.0
    assert metrics["moe/z_loss"] > 0
    assert metrics["moe/load_max"] >= 1.0 >= metrics["moe/load_min"] >= 0.0
    assert "moe/routing_mismatch" not in metrics  # no routing records in these samples
    assert not torch.equal(before, router.detach())  # the router trains


def test_replay_forces_the_recorded_experts(moe_dir):
    trainer = _trainer(moe_dir, routing_replay=True)
    (sample,) = _samples(1, seed=3, routed=True)
    trainer.compute_logprobs([sample])
    start = sample["response_start"]
    chosen = trainer.moe.last_choices()  # [tokens, k] per layer, packed order = the sample's positions
    for i, experts in enumerate(sample["routed_experts"]):
        if experts is None:
            continue
        for layer in range(LAYERS):
            want = sorted(experts[layer * TOPK:(layer + 1) * TOPK])
            assert sorted(chosen[layer][start + i - 1].tolist()) == want, (i, layer)
    metrics = trainer.train_step(_samples(4, seed=4, routed=True))
    assert metrics["moe/routing_mismatch"] > 0.5  # random records: the free router disagrees with most
    assert metrics["moe/replayed_tokens"] > 0


def test_without_replay_the_router_routes_freely(moe_dir):
    trainer = _trainer(moe_dir)
    (sample,) = _samples(1, seed=3, routed=True)
    free = trainer.compute_logprobs([{k: v for k, v in sample.items() if k != "routed_experts"}])
    assert trainer.compute_logprobs([sample]) == free  # records alone change nothing


def test_bad_routing_records_are_refused(moe_dir):
    trainer = _trainer(moe_dir, routing_replay=True)
    (sample,) = _samples(1, routed=True)
    sample["routed_experts"][0] = [0, 1, 2]  # not layers x top-k long
    with pytest.raises(ValueError, match="routed_experts\\[0\\]"):
        trainer.compute_logprobs([sample])
    sample["routed_experts"][0] = [0, 1, 2, EXPERTS]
    with pytest.raises(ValueError, match="expert ids in"):
        trainer.compute_logprobs([sample])


def test_moe_settings_are_validated():
    from pydantic import ValidationError

    from agentrl.trainer.trainer_config import TrainerConfig

    assert TrainerConfig(moe={"routing_replay": True}).moe.routing_replay
    with pytest.raises(ValidationError, match="aux_loss_coeff"):
        TrainerConfig(moe={"aux_loss_coeff": -1})
    with pytest.raises(ValidationError, match="did you mean 'routing_replay'"):
        TrainerConfig(moe={"routing_replays": True})
