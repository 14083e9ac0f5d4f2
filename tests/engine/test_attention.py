"""The engine's decode attention on grouped-query models: the same result as transformers' repeat_kv path
without expanding KV heads; everything else is transformers' SDPA untouched."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentrl.engine.attention import NAME, decode_sdpa_attention_forward  # noqa: E402

TOL = 1e-6  # fp32: the same dot products and softmax, summed in another order


class Module:
    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups
        self.training = False


def reference(query, key, value, mask, groups, scale):
    from transformers.integrations.sdpa_attention import repeat_kv

    out = torch.nn.functional.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups),
                                                           attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("mask_kind", ["float", "bool", None])
def test_one_token_decode_matches_the_expanded_heads(mask_kind):
    g = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, columns, dim = 3, 2, 7, 40, 16
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, columns, dim, generator=g) for _ in range(2))
    allowed = torch.ones(batch, 1, 1, columns, dtype=torch.bool)
    allowed[0, ..., :25] = False  # a left-padded row
    allowed[2, ..., 30:] = False
    mask = {"float": torch.where(allowed, 0.0, torch.finfo(torch.float32).min), "bool": allowed, None: None}[mask_kind]
    out, weights = decode_sdpa_attention_forward(Module(groups), query, key, value, mask, scaling=0.25)
    assert weights is None and out.shape == (batch, 1, kv_heads * groups, dim)
    assert (out - reference(query, key, value, mask, groups, 0.25)).abs().max().item() < TOL


def test_prefill_and_per_head_masks_go_to_transformers_sdpa(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(a[1].shape) or ("hf", None))
    query, key = torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8)
    assert decode_sdpa_attention_forward(Module(2), query, key, key, None)[0] == "hf"  # 5 query tokens
    one = torch.zeros(1, 4, 1, 8)
    assert decode_sdpa_attention_forward(Module(2), one, key, key, torch.zeros(1, 4, 1, 5))[0] == "hf"  # per-head mask
    assert decode_sdpa_attention_forward(Module(1), one, torch.zeros(1, 4, 5, 8), torch.zeros(1, 4, 5, 8), None)[0] == "hf"
    assert len(calls) == 3


def test_the_engine_decodes_without_expanding_kv_heads(tiny_model, monkeypatch):
    """The tiny model has 4 query heads over 2 KV heads: its static decode step must never call repeat_kv."""
    import transformers.integrations.sdpa_attention as sdpa

    from agentrl.engine.model_runner import ModelRunner

    runner = ModelRunner(str(tiny_model), dtype="float32", device="cpu", static_kv=True)
    assert runner.model.config._attn_implementation == NAME
    _, kvs = runner.prefill([([1, 5, 9, 13], None), ([1, 7], None)])
    batch = runner.empty_batch().extend(kvs)
    expanded, key_heads = [], []
    real_repeat, real_sdpa = sdpa.repeat_kv, torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(sdpa, "repeat_kv", lambda t, n: expanded.append(n) or real_repeat(t, n))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: key_heads.append(k.shape[1]) or real_sdpa(q, k, v, **kw))
    logits, _ = runner.decode(batch, [3, 4])
    assert expanded == [] and torch.isfinite(logits).all()
    assert key_heads == [2] * runner.model.config.num_hidden_layers  # every layer attended over the 2 KV heads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode_attention.py is a Triton kernel for CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("rows", "columns", "masked"), [(1, 1024, True), (5, 77, True), (130, 256, False)])
def test_triton_decode_attention_matches_sdpa(dtype, rows, columns, masked):
    """The split-K decode kernel against SDPA on upcast inputs: fp32 multiplies in IEEE fp32 (1e-5 relative);
    bf16 rounds the probabilities to bf16 before P·V as the fused SDPA kernels do (2e-2 relative)."""
    from agentrl.engine.decode_attention import decode_attention, supported

    dt = getattr(torch, dtype)
    g = torch.Generator("cuda").manual_seed(rows)
    q = torch.randn((rows, 2, 7, 64), device="cuda", dtype=dt, generator=g)
    k, v = (torch.randn((rows, 2, columns, 64), device="cuda", dtype=dt, generator=g) for _ in range(2))
    mask = None
    if masked:  # left-padded rows of different lengths, as the static decode batch
        lengths = torch.randint(1, columns + 1, (rows,), device="cuda", generator=g)
        cols = torch.arange(columns, device="cuda")
        mask = torch.where(cols >= columns - lengths[:, None], 0.0, torch.finfo(dt).min).to(dt)
    assert supported(q, k, v, mask)
    out = decode_attention(q, k, v, mask, 0.125).float()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=None if mask is None else mask.float()[:, None, None, :], scale=0.125)
    assert ((out - ref).norm() / ref.norm()).item() < (1e-5 if dtype == "float32" else 2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode_attention.py is a Triton kernel for CUDA")
def test_triton_decode_attention_skips_columns_past_the_limit():
    """With ``limit`` (the static batch's write column, where every row's mask ends) the kernel reads nothing
    after it: the same result as attending over every column, even with non-finite values past it."""
    from agentrl.engine.decode_attention import decode_attention

    g = torch.Generator("cuda").manual_seed(7)
    rows, columns, last = 3, 1024, 600
    q = torch.randn((rows, 2, 7, 64), device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn((rows, 2, columns, 64), device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cols = torch.arange(columns, device="cuda")
    starts = torch.tensor([0, 300, last], device="cuda")
    allowed = (cols >= starts[:, None]) & (cols <= last)
    mask = torch.where(allowed, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
    full = decode_attention(q, k, v, mask, 0.125)
    k[:, :, last + 1 :], v[:, :, last + 1 :] = float("nan"), float("nan")  # never read with the limit
    limited = decode_attention(q, k, v, mask, 0.125, torch.tensor([last], device="cuda"))
    assert torch.isfinite(limited).all()
    assert (limited.float() - full.float()).abs().max().item() < 1e-2  # bf16 output; split boundaries move
