"""HF <-> Megatron conversion: bit-exact round trips (all families, TP shards, both norm namings),
Megatron logits equal HF logits at TP=1 (TP=2 runs under torchrun in tests/trainer/test_distributed.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from agentrl.weights import convert as C

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


def _hf_model(family: str, tmp_path):
    """A small random-init HF model of ``family`` written to ``tmp_path`` (returns (dir, config))."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if family == "qwen2":
        from agentrl.models.tiny import make_tiny_model

        d = make_tiny_model(tmp_path / "qwen2", seed=0)
        return d, C.load_hf_config(d)
    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    if family == "qwen3":
        # head_dim != hidden/heads exercises kv_channels; q/k norms get non-trivial weights below.
        cfg = Qwen3Config(head_dim=24, **common)
    elif family == "llama":
        cfg = LlamaConfig(rope_theta=50000.0, **common)
    else:
        raise AssertionError(family)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # ones would hide a norm mapped to the wrong place
    d = tmp_path / family
    model.save_pretrained(d, safe_serialization=True)
    return d, C.load_hf_config(d)


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def hf_dir(request, tmp_path_factory):
    return _hf_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_round_trip_is_bit_exact(hf_dir, spec, tp_size):
    d, cfg = hf_dir
    hf = C.load_hf_state_dict(d)
    shape = C.ModelShape.from_hf_config(cfg)
    shards = [C.hf_to_megatron(hf, shape, tp_rank=r, tp_size=tp_size, spec=spec) for r in range(tp_size)]
    back = C.megatron_to_hf(shards if tp_size > 1 else shards[0], shape, spec=spec)
    expected = {k for k in hf if not (shape.tie_word_embeddings and k == "lm_head.weight")}
    assert set(back) == expected
    for k in expected:
        assert torch.equal(back[k], hf[k]), k
    if tp_size == 2:
        # Column-parallel rows split in half, row-parallel columns split in half, norms replicated.
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        assert shards[0][qkv].shape[0] * 2 == (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.head_dim
        assert not torch.equal(shards[0][qkv], shards[1][qkv])
        fc2 = "decoder.layers.0.mlp.linear_fc2.weight"
        assert shards[0][fc2].shape[1] * 2 == shape.ffn_hidden_size


def test_shape_flags_per_family(hf_dir):
    _, cfg = hf_dir
    shape = C.ModelShape.from_hf_config(cfg)
    assert shape.qkv_bias == (cfg.model_type == "qwen2")
    assert shape.qk_layernorm == (cfg.model_type == "qwen3")
    assert shape.tie_word_embeddings == (cfg.model_type == "qwen2")


def test_grouped_qkv_layout_matches_design():
    shape = C.ModelShape(1, 8, 16, num_attention_heads=4, num_query_groups=2, head_dim=2, vocab_size=4,
                         tie_word_embeddings=True, qkv_bias=False, qk_layernorm=False)
    q = torch.arange(8 * 8).reshape(8, 8).float()
    k = 100 + torch.arange(4 * 8).reshape(4, 8).float()
    v = 200 + torch.arange(4 * 8).reshape(4, 8).float()
    qkv = C._group_qkv(q, k, v, shape)
    # group 0: q heads 0,1 (rows 0..3), k head 0 (rows 0..1), v head 0; then group 1.
    want = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])
    assert torch.equal(qkv, want)


def test_megatron_logits_match_hf_tp1(hf_dir):
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.model import build_gpt_model, causal_mask, load_hf_weights
    from agentrl.trainer.parallel import init_model_parallel

    d, cfg = hf_dir
    init_model_parallel(1)
    hf_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 29), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        ref = hf_model(ids).logits
    for attention in ("sdpa", "local"):
        model = build_gpt_model(cfg, attention=attention)
        load_hf_weights(model, C.load_hf_state_dict(d), cfg, tp_rank=0, tp_size=1, attention=attention)
        model.eval()
        with torch.no_grad():
            out = model(ids, pos, causal_mask(ids.shape[1]))
        assert (out - ref).abs().max().item() < 1e-5, attention


def test_named_tensor_iterator_and_export_dir_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    d, cfg = _hf_model("qwen2", tmp_path)
    hf = C.load_hf_state_dict(d)
    shape = C.ModelShape.from_hf_config(cfg)
    mg = C.hf_to_megatron(hf, shape)
    names = [n for n, _ in C.megatron_to_hf_named_tensors(mg, shape)]
    assert len(names) == len(set(names)) == len(hf)
    out = C.save_hf_checkpoint(C.megatron_to_hf_named_tensors(mg, shape), d, tmp_path / "export")
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    again = C.load_hf_state_dict(out)
    assert all(torch.equal(again[k], hf[k]) for k in hf)
    AutoModelForCausalLM.from_pretrained(out)  # a loadable HF checkpoint


def test_bad_inputs_raise_clear_errors(tmp_path):
    d, cfg = _hf_model("qwen2", tmp_path)
    hf = C.load_hf_state_dict(d)
    shape = C.ModelShape.from_hf_config(cfg)
    broken = dict(hf)
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        C.hf_to_megatron(broken, shape)
    with pytest.raises(ValueError, match="not divisible"):
        C.hf_to_megatron(hf, shape, tp_size=3)
    with pytest.raises(ValueError, match="spec"):
        C.hf_to_megatron(hf, shape, spec="apex")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unsupported model_type"):
        C.ModelShape.from_hf_config({"model_type": "gpt2", "num_attention_heads": 2, "hidden_size": 8})
    with pytest.raises(FileNotFoundError, match="safetensors"):
        C.load_hf_state_dict(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        C.load_hf_state_dict(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        C.load_hf_config(tmp_path / "nope")
