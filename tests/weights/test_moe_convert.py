"""Qwen3-MoE HF <-> Megatron conversion: bit-exact round trip (both norm namings), expert-parallel shards,
Megatron's MoE logits equal HF's, and clear refusals."""

from __future__ import annotations

import warnings

import pytest
import torch

from agentrl.weights import convert as C

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    d = make_tiny_model(tmp_path_factory.mktemp("moe") / "m", seed=0, arch="qwen3_moe")
    return d, C.load_hf_config(d)


def test_shape_reads_the_expert_fields(moe_dir):
    _, cfg = moe_dir
    shape = C.ModelShape.from_hf_config(cfg)
    assert (shape.num_experts, shape.moe_topk, shape.moe_ffn_hidden_size) == (8, 2, 64)
    assert shape.qk_layernorm and not shape.qkv_bias and shape.moe_norm_topk_prob
    # the on-disk config names the expert count num_local_experts: a plain dict must read it too
    import json

    raw = json.loads((moe_dir[0] / "config.json").read_text())
    assert C.ModelShape.from_hf_config(raw) == shape


@pytest.mark.parametrize("spec", ["local", "te"])
def test_round_trip_is_bit_exact(moe_dir, spec):
    d, cfg = moe_dir
    hf = C.load_hf_state_dict(d)
    shape = C.ModelShape.from_hf_config(cfg)
    mg = C.hf_to_megatron(hf, shape, spec=spec)
    assert "decoder.layers.1.mlp.router.weight" in mg
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mg  # an MoE layer keeps its own norm in both specs
    back = C.megatron_to_hf(mg, shape, spec=spec)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_expert_parallel_shards_hold_disjoint_experts(moe_dir):
    d, cfg = moe_dir
    hf = C.load_hf_state_dict(d)
    shape = C.ModelShape.from_hf_config(cfg)
    shards = [C.hf_to_megatron(hf, shape, ep_rank=r, ep_size=2) for r in range(2)]
    fc1 = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert fc1.format(3) in shards[0] and fc1.format(4) not in shards[0]  # 4 local experts per rank
    gate5 = hf["model.layers.0.mlp.experts.5.gate_proj.weight"]
    assert torch.equal(shards[1][fc1.format(1)][: gate5.shape[0]], gate5)  # global expert 5 = rank 1's local 1
    assert torch.equal(shards[0]["decoder.layers.0.mlp.router.weight"], shards[1]["decoder.layers.0.mlp.router.weight"])


def test_megatron_moe_logits_match_hf(moe_dir):
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.model import build_gpt_model, load_hf_weights
    from agentrl.trainer.parallel import init_model_parallel

    d, cfg = moe_dir
    init_model_parallel(1)
    hf_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    model = build_gpt_model(cfg, attention="sdpa")
    load_hf_weights(model, C.load_hf_state_dict(d), cfg, tp_rank=0, tp_size=1, attention="sdpa")
    model.eval()
    with torch.no_grad():
        ref = hf_model(ids).logits
        out = model(ids, pos, None)
    # fp32, same routing; only the summation order of the experts' outputs differs
    assert (out - ref).abs().max().item() < 1e-5


def test_bad_inputs_raise_clear_errors(moe_dir):
    d, cfg = moe_dir
    hf = C.load_hf_state_dict(d)
    shape = C.ModelShape.from_hf_config(cfg)
    with pytest.raises(ValueError, match="tensor-parallel size 1"):
        C.hf_to_megatron(hf, shape, tp_size=2)
    with pytest.raises(ValueError, match="must divide num_experts"):
        C.hf_to_megatron(hf, shape, ep_size=3)
    del hf["model.layers.1.mlp.experts.7.down_proj.weight"]
    with pytest.raises(KeyError, match="lacks 1 tensors"):
        C.hf_to_megatron(hf, shape)
    mixed = {**cfg.to_dict(), "mlp_only_layers": [0]}
    with pytest.raises(ValueError, match="dense layers"):
        C.ModelShape.from_hf_config(mixed)
