"""LoRA in the trainer (one rank): only the adapters train, the base stays bit-identical and outside the
optimizer, a fresh adapter changes nothing, recomputed layers still train theirs, and bad settings fail."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from trainer_samples import synthetic_samples

from agentrl.trainer.trainer_config import TrainerConfig

CFG = dict(lr=1e-2, max_tokens_per_microbatch=128, attention="sdpa")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", seed=0)


def _trainer(model, **cfg):
    from agentrl.trainer.actor import MegatronTrainer

    return MegatronTrainer(model, TrainerConfig(**{**CFG, **cfg}))


def _base_state(trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.gpt.state_dict().items() if ".lora." not in n and "extra_state" not in n}


def test_only_adapters_train_and_the_base_stays_bit_identical(tiny):
    plain = _trainer(tiny)
    trainer = _trainer(tiny, lora={"rank": 4, "target_modules": ["q_proj", "up_proj", "down_proj"]})
    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)
    assert trainer.compute_logprobs(batch) == plain.compute_logprobs(batch)  # B = 0: the base model exactly
    trainable = {n for n, p in trainer.gpt.named_parameters() if p.requires_grad}
    assert trainable and all(".lora." in n for n in trainable)
    assert {n.split(".lora.")[1] for n in trainable} == {f"lora_{m}.{t}" for m in "AB" for t in ("q_proj", "up_proj",
                                                                                                 "down_proj")}
    in_optimizer = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for p in trainer.gpt.parameters() if p.requires_grad)
    base = _base_state(trainer)
    adapters = [(n, a.clone(), b.clone()) for n, a, b in trainer.export_adapter_tensors()]
    for seed in (3, 4):
        trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=seed))
    assert all(torch.equal(t, base[n]) for n, t in _base_state(trainer).items())
    for (name, a0, b0), (_, a1, b1) in zip(adapters, trainer.export_adapter_tensors(), strict=True):
        assert not torch.equal(b0, b1) and not torch.equal(a0, a1), name
    assert trainer.compute_logprobs(batch) != plain.compute_logprobs(batch)


def test_recomputed_layers_with_dropout_still_train_their_adapters(tiny):
    trainer = _trainer(tiny, recompute=True, lora={"rank": 2, "dropout": 0.1})
    trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=3))
    assert all(b.abs().max() > 0 for _, _, b in trainer.export_adapter_tensors())


@pytest.mark.parametrize("lora, message", [
    ({"rank": -1}, "greater than or equal to 0"),
    ({"rank": 4, "target_modules": []}, "at least 1"),
    ({"rank": 4, "target_modules": ["lm_head"]}, "q_proj"),
    ({"rank": 4, "alpha": 0}, "greater than 0"),
    ({"rank": 4, "dropout": 1.0}, "less than 1"),
    ({"rnak": 4}, "did you mean 'rank'"),
])
def test_bad_lora_settings_are_refused(lora, message):
    with pytest.raises(ValidationError, match=message):
        TrainerConfig(lora=lora)


def test_rank_zero_or_none_is_full_fine_tuning():
    for rank in (0, None):
        assert not TrainerConfig(lora={"rank": rank}).lora.enabled
    assert TrainerConfig(lora={"rank": 8, "alpha": 16}).lora.scale == 2.0


def test_kl_reference_of_a_random_init_lora_model_is_its_frozen_base():
    """kl_coef > 0 on a random-init LoRA model: the reference is the policy with its adapters off (no second
    model; it used to be loaded from the policy's state dict and refused the adapter keys): the same
    log-probs as a full fine-tune's reference copy of the same init, unchanged by training."""
    from transformers import Qwen2Config

    from agentrl.trainer.actor import MegatronTrainer

    hf = Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    cfg = {**CFG, "loss": {"kl_coef": 0.01}}
    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)

    def reference(t) -> list[torch.Tensor]:
        return t._behaviour_and_reference(t._micro_batches(batch), True)[1]

    want = reference(MegatronTrainer(None, TrainerConfig(**cfg), hf_config=hf))  # same seed: the same init
    trainer = MegatronTrainer(None, TrainerConfig(**cfg, lora={"rank": 4}), hf_config=hf)
    assert trainer.ref_model is None and trainer.ref_is_base
    # The same forward on the same weights in this process (the adapters add nothing): bitwise
    assert all(torch.equal(a, b) for a, b in zip(reference(trainer), want, strict=True))
    first = trainer.train_step(batch)
    second = trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=4))
    assert first["kl"] == 0.0 and second["kl"] > 0  # B = 0: the first step's policy is the reference
    assert all(torch.equal(a, b) for a, b in zip(reference(trainer), want, strict=True))
