"""The ``adapter`` payload: a LoRA trainer's adapters reach real engines, which merge them from an exact
base copy; the engines' log-probs then equal the trainer's, and hostile adapter updates are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from weights_sync_helpers import control_post, engine_checksum, generate

from agentrl.engine.weight_loading import update_weights_from_tensor_body
from agentrl.weights.adapter_sync import adapter_named_tensors
from agentrl.weights.sync import make_sync

sys.path.insert(0, str(Path(__file__).parent.parent / "trainer"))
from trainer_samples import synthetic_samples  # noqa: E402


@pytest.fixture(scope="module")
def lora_trainer(tiny_model_dir):
    """A rank-4 LoRA trainer that took one large step, so its adapters change the model visibly."""
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    trainer = MegatronTrainer(tiny_model_dir, TrainerConfig(lr=3e-2, lora={"rank": 4, "alpha": 8},
                                                            max_tokens_per_microbatch=256, attention="sdpa"))
    trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=3))
    return trainer


def _adapters(trainer) -> list[tuple[str, torch.Tensor]]:
    return list(adapter_named_tensors(trainer.export_adapter_tensors(), trainer.config.lora.scale))


def _engine_and_trainer_logprobs(url: str, trainer, tokenizer) -> tuple[list[float], list[float]]:
    from agentrl.run.check_logprobs import sample_conversations

    samples = sample_conversations(url, tokenizer, 2, turns=2, max_new_tokens=8, temperature=1.0, seed=1)
    lps = trainer.compute_logprobs(samples)
    engine = [x for s in samples for m, x in zip(s["loss_mask"], s["rollout_logprobs"], strict=True) if m]
    mine = [x for s, lp in zip(samples, lps, strict=True) for m, x in zip(s["loss_mask"], lp, strict=True) if m]
    return engine, mine


def test_adapter_sync_sends_adapters_and_engines_match_the_trainer(engine_urls, lora_trainer, tiny_model_dir):
    from transformers import AutoTokenizer

    from agentrl.trainer.lora import dense_bytes

    dense = dense_bytes(lora_trainer.hf_config, torch.float32)
    with make_sync("full", engine_urls) as full:  # whatever another test left: the base is what LoRA trained on
        full.sync(_base_weights(tiny_model_dir), "base")
    base = engine_checksum(engine_urls[0])["total"]
    with make_sync("adapter", engine_urls, dense_bytes=dense) as sync:
        for version in ("lora-1", "lora-2"):  # the second merge starts from the base again, not from lora-1
            report = sync.sync(_adapters(lora_trainer), version)
        assert report.mode == "adapter" and report.full_bytes == dense
        assert report.bytes_sent < 0.2 * dense  # rank 4 of a 0.6M model with a 1024-token vocabulary
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        for url in engine_urls:
            held = engine_checksum(url)
            assert held["weight_version"] == "lora-2" and held["total"] != base
            engine, trainer = _engine_and_trainer_logprobs(url, lora_trainer, tokenizer)
            # fp32: the engine merged B @ A into W, the trainer adds x A^T B^T beside it (rounding only)
            assert max(abs(a - b) for a, b in zip(engine, trainer, strict=True)) < 1e-4


def _base_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def test_lora_off_equals_base_and_merge_is_from_the_base(engine_urls, tiny_model_dir):
    """Zero adapters give back the base bits exactly, whatever was merged before, and a version change
    alone (``/update_weight_version``) does not make the merged weights the next base."""
    url = engine_urls[0]
    with make_sync("full", engine_urls[:1]) as full:
        full.sync(_base_weights(tiny_model_dir), "base")
    before = engine_checksum(url)["total"]
    module = "model.layers.0.self_attn.q_proj"
    a, b = torch.randn(2, 128), torch.randn(128, 2)
    for version, scale in (("one", 1.0), ("zero", 0.0)):
        body = update_weights_from_tensor_body(
            [(f"{module}.lora_A.weight", a), (f"{module}.lora_B.weight", b * scale)], weight_version=version)
        assert control_post(url + "/update_weights_from_tensor", body).status_code == 200
        assert control_post(url + "/update_weight_version", {"new_version": f"{version}-relabelled"}).status_code == 200
    assert engine_checksum(url)["total"] == before


@pytest.mark.parametrize("named, message", [
    ([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(2, 128))], "without both"),
    ([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(2, 128)),
      ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(128, 3))], "does not make"),
    ([("model.layers.0.self_attn.nope.lora_A.weight", torch.zeros(2, 128)),
      ("model.layers.0.self_attn.nope.lora_B.weight", torch.zeros(128, 2))], "no parameter"),
    ([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.full((2, 128), float("nan"))),
      ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.ones(128, 2))], "not finite"),
    ([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(2, 128)),
      ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(128, 2)),
      ("model.norm.weight", torch.ones(128))], "only lora_A/lora_B"),
])
def test_hostile_adapter_updates_are_refused_and_change_nothing(engine_urls, named, message):
    url = engine_urls[0]
    before = engine_checksum(url)
    prompt_out = generate(url, [1, 5, 9, 12])
    response = control_post(url + "/update_weights_from_tensor",
                            update_weights_from_tensor_body(named, weight_version="hostile"))
    assert response.status_code == 400 and message in response.json()["message"]
    after = engine_checksum(url)
    assert (after["total"], after["weight_version"]) == (before["total"], before["weight_version"])
    assert generate(url, [1, 5, 9, 12])["output_ids"] == prompt_out["output_ids"]


def test_adapter_payload_refuses_a_transport_without_named_tensors():
    from agentrl.weights.adapter_sync import AdapterSync
    from agentrl.weights.transport import Transport

    class DeltaOnly(Transport):
        carries = frozenset({"delta"})

        def send_full(self, tensors, weight_version, urls):  # pragma: no cover - never reached
            raise AssertionError

    with pytest.raises(ValueError, match="cannot carry"):
        AdapterSync.check_carried(DeltaOnly)
