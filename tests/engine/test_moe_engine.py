"""The embedded engine on a tiny Qwen3-MoE: it reports the experts it routed each sampled token through
(only when asked), those are the experts of a teacher-forced HF forward, its expert weights carry the
checkpoint's names (weight syncs land by name), and the sorted-by-expert path equals the loop."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import ServerThread

from agentrl.engine.auth import auth_headers

LAYERS, TOPK, EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe") / "m", seed=0, arch="qwen3_moe")


@pytest.fixture(scope="module")
def moe_server(moe_model):
    with ServerThread(moe_model) as s:
        yield s


@pytest.fixture()
def moe_client(moe_server):
    with httpx.Client(base_url=moe_server.url, timeout=60, headers=auth_headers(moe_server.secret)) as c:
        yield c


PROMPT = [1, 77, 301, 12, 9, 400, 2, 1, 55]


def _generate(client, **extra):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True,
                                                     "sampling_seed": 7}, "return_logprob": True, **extra}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _hf_routing(model_dir, tokens: list[int]) -> list[torch.Tensor]:
    """Per layer, the top-k experts transformers' own Qwen3-MoE chooses at every position (teacher forced)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: seen.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return seen


def test_routing_is_reported_only_when_asked_and_matches_hf(moe_client, moe_model):
    plain = _generate(moe_client)
    assert "routed_experts" not in plain["meta_info"]
    out = _generate(moe_client, return_routed_experts=True)
    assert out["output_ids"] == plain["output_ids"]  # asking changes nothing else
    routed = out["meta_info"]["routed_experts"]
    assert len(routed) == len(out["output_ids"]) == out["meta_info"]["completion_tokens"]
    # token i was drawn from the logits at position len(PROMPT) + i - 1 (prefill, then decode steps)
    hf = _hf_routing(moe_model, PROMPT + out["output_ids"][:-1])
    for i, experts in enumerate(routed):
        assert len(experts) == LAYERS * TOPK and all(0 <= e < EXPERTS for e in experts)
        for layer in range(LAYERS):
            want = sorted(hf[layer][len(PROMPT) + i - 1].tolist())
            assert sorted(experts[layer * TOPK:(layer + 1) * TOPK]) == want, (i, layer)


def test_routing_request_is_validated(moe_client, client):
    r = moe_client.post("/generate", json={"input_ids": PROMPT, "return_routed_experts": "yes"})
    assert r.status_code == 400 and "return_routed_experts" in r.text
    r = client.post("/generate", json={"input_ids": PROMPT, "return_routed_experts": True})  # the dense tiny model
    assert r.status_code == 400 and "mixture-of-experts" in r.text


def test_expert_weights_carry_checkpoint_names_and_updates_land(moe_server, moe_model):
    from agentrl.weights.convert import load_hf_state_dict

    runner = moe_server.engine.runner
    assert runner.moe_layers == LAYERS
    names = {n for n, _ in runner.named_parameters()}
    assert names == set(load_hf_state_dict(moe_model)) - {"lm_head.weight"}  # tied
    block = runner.model.model.layers[0].mlp
    new = torch.full_like(block.gate_up[3, :64], 0.5)
    moe_server.engine.apply_weights({"model.layers.0.mlp.experts.3.gate_proj.weight": new}, weight_version="v2",
                                    method="test")
    assert torch.equal(block.gate_up[3, :64], new)  # the stacked buffer the forward reads


def test_sorted_by_expert_path_equals_the_loop(moe_server):
    block = moe_server.engine.runner.model.model.layers[1].mlp
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((37, 128), generator=gen)
    weights, chosen = torch.rand((37, TOPK), generator=gen), torch.stack(
        [torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(37)])
    with torch.no_grad():
        looped = block._looped_experts(x, chosen, weights)
        block_sorted = block._sorted_experts(x, chosen, weights)
    # same products, summed in another order per token: fp32 rounding only
    assert (looped - block_sorted).abs().max().item() < 1e-5


def test_rollouts_ask_only_moe_models_for_routing(moe_model, tiny_model):
    from agentrl.engine.protocol import routes_experts

    assert routes_experts(moe_model) and not routes_experts(tiny_model)
