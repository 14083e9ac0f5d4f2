"""LoRA in the embedded engine: a release of the weights takes the adapters' base copy off the device with
them, and after resume the next merge still starts from the exact base; in bf16 the engine's log-probs of
merged adapters stay as close to the trainer's as bf16 allows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from agentrl.engine.weight_loading import update_weights_from_tensor_body

sys.path.insert(0, str(Path(__file__).parent.parent / "trainer"))
from trainer_samples import synthetic_samples  # noqa: E402


def _engine_conftest():
    """This directory's conftest by path: ``from conftest import`` finds another directory's when pytest
    collects several (tests/weights has one too)."""
    spec = importlib.util.spec_from_file_location("engine_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ServerThread = _engine_conftest().ServerThread

Q, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"


def _merger(server: ServerThread):
    """The engine app's ``AdapterMerger`` (held by its weight routes; included routers nest their routes)."""
    from agentrl.engine.weight_routes import WeightRoutes

    routes = list(server.server.config.app.routes)
    while routes:
        r = routes.pop()
        routes += getattr(getattr(r, "original_router", None), "routes", [])
        if isinstance(getattr(getattr(r, "endpoint", None), "__self__", None), WeightRoutes):
            return r.endpoint.__self__.adapters
    raise AssertionError("no weight routes in the engine app")


def _adapter(weight: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, weight.shape[1], generator=g), torch.randn(weight.shape[0], 2, generator=g) * 0.1


def _send(client, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], version: str):
    named = [(f"{m}.lora_{k}.weight", t) for m, (a, b) in adapters.items() for k, t in (("A", a), ("B", b))]
    return client.post("/update_weights_from_tensor", json=update_weights_from_tensor_body(named, weight_version=version))


def test_a_release_takes_the_lora_base_along_and_the_next_merge_starts_from_it(server, client, tiny_model):
    r = client.post("/update_weights_from_disk", json={"model_path": str(tiny_model), "allow_missing_manifest": True})
    assert r.status_code == 200, r.text
    runner = server.engine.runner
    base = {n: t.detach().clone() for n, t in runner.named_tensors().items()}
    first = {Q: _adapter(base[f"{Q}.weight"], 1), DOWN: _adapter(base[f"{DOWN}.weight"], 2)}
    assert _send(client, first, "lora-1").status_code == 200
    merger = _merger(server)
    assert set(merger.base) == {f"{Q}.weight", f"{DOWN}.weight"}

    assert client.post("/release_memory_occupation", json={}).json()["success"]
    assert merger.released and all(t.device.type == "cpu" for t in merger.base.values())
    r = _send(client, first, "while-released")  # refused by the merger itself, before it reads empty weights
    assert r.status_code == 400 and "released" in r.json()["message"]
    assert client.post("/resume_memory_occupation", json={}).json()["success"]
    assert not merger.released

    # Resume gave back lora-1's merged bits; the merge starts from the base copy, not from them. DOWN is not
    # in this update: it goes back to its base.
    a, b = _adapter(base[f"{Q}.weight"], 3)
    assert _send(client, {Q: (a, b)}, "lora-2").status_code == 200
    held = runner.named_tensors()
    want_q = (base[f"{Q}.weight"].float() + b @ a).to(base[f"{Q}.weight"].dtype)  # the merger's own sum: bitwise
    assert torch.equal(held[f"{Q}.weight"], want_q)
    assert all(torch.equal(t, base[n]) for n, t in held.items() if n != f"{Q}.weight")
    r = client.post("/generate", json={"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory is what a release frees")
def test_on_cuda_a_release_frees_the_base_copy_too(tiny_model):
    from agentrl.engine.auth import auth_headers

    with ServerThread(tiny_model, device="cuda") as s:
        import httpx

        with httpx.Client(base_url=s.url, timeout=60, headers=auth_headers(s.secret)) as client:
            base = {n: t.detach().clone().cpu() for n, t in s.engine.runner.named_tensors().items()}
            adapters = {m: _adapter(base[f"{m}.weight"], 1) for m in (Q, DOWN)}
            assert _send(client, adapters, "lora-1").status_code == 200
            copy_bytes = sum(t.numel() * t.element_size() for t in _merger(s).base.values())
            before = torch.cuda.memory_allocated()
            assert client.post("/release_memory_occupation", json={}).json()["success"]
            freed = before - torch.cuda.memory_allocated()
            weights = sum(p.numel() * p.element_size() for p in s.engine.runner.model.parameters())  # tied once
            assert freed >= weights + copy_bytes, (freed, weights, copy_bytes)
            assert client.post("/resume_memory_occupation", json={}).json()["success"]
            assert all(t.device.type == "cuda" for t in _merger(s).base.values())


def test_bf16_engine_logprobs_with_merged_adapters_match_the_trainer(tiny_model):
    """bf16 engine vs bf16 LoRA trainer on sampled conversations. Tolerance 0.02 (measured 0.005 over 48
    tokens): bf16 keeps 8 mantissa bits, so the engine's merged ``W + BA`` is rounded once where the trainer
    rounds ``W`` and adds ``x A^T B^T`` beside it, and the two stacks (HF vs megatron-core) round activations
    differently. The adapters move the log-probs by more than 5x that (0.24), so an engine ignoring them fails."""
    from transformers import AutoTokenizer

    from agentrl.run.check_logprobs import sample_conversations
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.lora import adapters_off
    from agentrl.trainer.trainer_config import TrainerConfig
    from agentrl.weights.adapter_sync import adapter_named_tensors
    from agentrl.weights.sync import make_sync

    trainer = MegatronTrainer(tiny_model, TrainerConfig(dtype="bfloat16", lr=3e-2, lora={"rank": 4, "alpha": 8},
                                                        max_tokens_per_microbatch=256, attention="sdpa"))
    trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=3))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with ServerThread(tiny_model, dtype="bfloat16") as s:
        with make_sync("adapter", [s.url]) as sync:
            sync.sync(list(adapter_named_tensors(trainer.export_adapter_tensors(), trainer.config.lora.scale)), "l1")
        samples = sample_conversations(s.url, tokenizer, 3, turns=2, max_new_tokens=8, temperature=1.0, seed=1)
    mine = trainer.compute_logprobs(samples)
    with adapters_off(trainer.gpt):
        base = trainer.compute_logprobs(samples)

    def trained(rows):
        return [x for s, row in zip(samples, rows, strict=True) for m, x in zip(s["loss_mask"], row, strict=True) if m]

    engine = trained([s["rollout_logprobs"] for s in samples])
    gap = max(abs(a - b) for a, b in zip(engine, trained(mine), strict=True))
    moved = max(abs(a - b) for a, b in zip(trained(base), trained(mine), strict=True))
    assert gap < 0.02 and moved > 5 * 0.02, (gap, moved, len(engine))
