"""Memory settings of the Megatron trainer (issue 41): chunked log-probs in the train step, selective / full
recomputation and optimizer CPU offload reach megatron-core and train like the plain step."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode
from trainer_samples import synthetic_samples

from agentrl.trainer.trainer_config import TrainerConfig

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _two_steps(trainer, batch) -> tuple[list[float], list[list[float]]]:
    """Grad norms of two steps and the log-probs after them. (The GRPO loss of a step whose behaviour
    log-probs are its own forward's is -mean(advantage) whatever the weights: it compares nothing.)"""
    norms = [trainer.train_step(batch)["grad_norm"] for _ in range(2)]
    return norms, trainer.compute_logprobs(batch)


def _assert_same_training(got, want, tol):
    (norms, lps), (ref_norms, ref_lps) = got, want
    assert norms == pytest.approx(ref_norms, rel=tol, abs=tol)
    for a, b in zip(lps, ref_lps, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < tol


def test_recompute_values_reach_megatron_and_old_booleans_still_mean_full_or_none():
    assert TrainerConfig(recompute=True).recompute == "full"
    assert TrainerConfig(recompute=False).recompute == "none"
    with pytest.raises(ValidationError, match="recompute"):
        TrainerConfig(recompute="some")
    with pytest.raises(ValidationError, match="recompute_modules"):
        TrainerConfig(recompute="selective", recompute_modules=["layernorm"])  # needs TransformerEngine
    from transformers import Qwen2Config

    from agentrl.trainer.model import transformer_config_from_hf

    hf = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    sel = transformer_config_from_hf(hf, recompute="selective", recompute_modules=["mlp", "core_attn"])
    assert (sel.recompute_granularity, sel.recompute_modules) == ("selective", ["mlp", "core_attn"])
    full = transformer_config_from_hf(hf, recompute="full")
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert transformer_config_from_hf(hf).recompute_granularity is None


@pytest.mark.parametrize("recompute,modules", [("selective", ["core_attn", "mlp"]), ("full", [])])
def test_recomputation_trains_like_no_recomputation(tiny_dir, recompute, modules):
    from agentrl.trainer.actor import MegatronTrainer

    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)
    cfg = dict(lr=1e-3, max_tokens_per_microbatch=64)
    ref = _two_steps(MegatronTrainer(tiny_dir, TrainerConfig(**cfg)), batch)
    trainer = MegatronTrainer(tiny_dir, TrainerConfig(recompute=recompute, recompute_modules=modules or ["core_attn"],
                                                      **cfg))
    layer = trainer.gpt.decoder.layers[0]
    if recompute == "selective":
        assert layer.recompute_mlp and layer.self_attention.checkpoint_core_attention
    else:
        assert trainer.gpt.config.recompute_granularity == "full"
    # the same fp32 ops run again on the same values: equal to fp32 rounding (1e-6 on values of order 1-10)
    _assert_same_training(_two_steps(trainer, batch), ref, 1e-6)


def test_optimizer_offload_needs_the_distributed_optimizer_and_bf16():
    with pytest.raises(ValidationError, match="use_distributed_optimizer"):
        TrainerConfig(optimizer_cpu_offload=True, dtype="bfloat16")
    with pytest.raises(ValidationError, match="bfloat16"):
        TrainerConfig(optimizer_cpu_offload=True, use_distributed_optimizer=True)
    with pytest.raises(ValidationError, match="optimizer_offload_fraction"):
        TrainerConfig(optimizer_offload_fraction=1.5)


class _Stream:  # torch.cuda's stream API as the hybrid optimizer uses it, for a CPU-only torch
    def wait_stream(self, *args):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass

    def wait(self, *args):
        pass


def test_optimizer_offload_runs_the_hybrid_optimizer_and_trains_like_adam(tiny_dir, monkeypatch):
    """On the CPU every parameter is "host" memory: the hybrid optimizer is given its CPU copies by hand
    (the device copy is the parameter itself) and torch.cuda's streams become no-ops; what remains is
    megatron-core's offload path, inside the distributed optimizer, against the plain distributed Adam."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from agentrl.trainer.actor import MegatronTrainer

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)
    cfg = dict(lr=1e-3, dtype="bfloat16", use_distributed_optimizer=True, max_tokens_per_microbatch=64)
    ref = _two_steps(MegatronTrainer(tiny_dir, TrainerConfig(**cfg)), batch)
    trainer = MegatronTrainer(tiny_dir, TrainerConfig(optimizer_cpu_offload=True, **cfg))
    (inner,) = [opt.optimizer for opt in trainer.optimizer.chained_optimizers]
    assert isinstance(inner, HybridDeviceOptimizer) and inner.cpu_optimizers and inner.gpu_optimizer is None
    assert trainer.optimizer.config.optimizer_cpu_offload and trainer.optimizer.config.optimizer_offload_fraction == 1
    for opt in inner.cpu_optimizers:
        for group in opt.param_groups:
            inner.cpu_copys_map_gpu_param.update({p: p for p in group["params"]})
    inner.pin_cpu_grads = False
    # torch's AdamW on the same fp32 main params and gradients as Megatron's: the same update, so the same
    # bf16 weights; the tolerance is one bf16 rounding of the log-probs (2**-8 relative, values of ~7)
    _assert_same_training(_two_steps(trainer, batch), ref, 0.03)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_a_train_step_never_holds_tokens_times_vocab_logits(monkeypatch):
    """A vocabulary larger than anything else in the model: the biggest tensor of a whole train step
    (behaviour forward, training forward and backward, optimizer) is one chunk's logits or the gradient
    buffer, never the micro-batch's logits."""
    from transformers import Qwen2Config

    from agentrl.trainer import chunked_logprobs
    from agentrl.trainer.actor import MegatronTrainer

    vocab = 4096
    hf = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    trainer = MegatronTrainer(None, TrainerConfig(max_tokens_per_microbatch=512, packing="padded"), hf_config=hf)
    batch = synthetic_samples(n_groups=2, per_group=4, seed=1, vocab=vocab)
    tokens = max(mb.model_tokens.numel() for mb in trainer._micro_batches(batch))
    monkeypatch.setattr(chunked_logprobs, "CHUNK_ELEMENTS", 16 * vocab)
    spy = _LargestTensor()
    with spy:
        metrics = trainer.train_step(batch)
    assert metrics["grad_norm"] > 0
    params = sum(p.numel() for p in trainer.gpt.parameters())  # DDP's one gradient buffer holds them all
    assert spy.largest <= max(16 * vocab, params) < tokens * vocab, (tokens, params, spy.largest)
