"""The fused decoder (fused_decoder.py, decoder_kernels.py): joined q/k/v and gate/up weights take every weight
update in place (CPU); on CUDA its kernels, decode step and prefill against transformers' eager modules."""

from __future__ import annotations

import random

import pytest
import torch

from agentrl.engine.model_runner import ModelRunner

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused decoder's kernels are Triton, for CUDA")


def _params(model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_joined_as(model, params: dict[str, torch.Tensor]) -> None:
    """Every layer's q/k/v and gate/up weights lie side by side and hold ``params``'s values."""
    from agentrl.engine.fused_decoder import _joined

    for i, layer in enumerate(model.model.layers):
        for owner, names in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            for attr in ("weight", "bias"):
                parts = [getattr(getattr(getattr(layer, owner), n), attr) for n in names]
                if parts[0] is None:
                    continue
                joined = _joined([p.data for p in parts])
                assert joined is not None, (i, owner, attr)
                want = torch.cat([params[f"model.layers.{i}.{owner}.{n}.{attr}"] for n in names])
                assert torch.equal(joined, want), (i, owner, attr)


def test_joined_projections_take_every_weight_update_in_place(tiny_model, tiny_model_b):
    """The model's own q/k/v (gate/up) parameters become views into one buffer per layer: the forward is
    bitwise unchanged, and tensor updates, copy plans (flat buckets), deltas and a memory release/resume (which
    swaps ``.data``: the runner joins them again) all leave the joined buffers holding the new weights."""
    from agentrl.engine.engine import Engine, EngineConfig
    from agentrl.engine.fused_decoder import FusedDecoder, join_projections
    from agentrl.engine.weight_loading import CopyPlan, weights_checksum
    from agentrl.weights.delta import encode_delta

    params_a, params_b = _params(tiny_model), _params(tiny_model_b)
    engine = Engine(EngineConfig(str(tiny_model), device="cpu", prefix_cache_tokens=0))
    runner = engine.runner
    ids = torch.tensor([[1, 30, 31, 32, 33, 34]])
    with torch.inference_mode():
        before = runner.model(input_ids=ids).logits
    runner.fused_decoder = FusedDecoder(runner.model, 64)  # joins (its Triton forward is not run on CPU)
    _assert_joined_as(runner.model, params_a)
    assert join_projections(runner.model) == 0  # already joined: nothing moves
    with torch.inference_mode():
        assert torch.equal(runner.model(input_ids=ids).logits, before)
    engine.start()
    try:
        engine.apply_weights(params_b, weight_version="b", method="tensor")  # disk, tensor, IPC, broadcast
        _assert_joined_as(runner.model, params_b)
        CopyPlan(runner.model.state_dict(keep_vars=True), params_a)()  # flat buckets
        _assert_joined_as(runner.model, params_a)
        payload, _ = encode_delta([(n, params_a[n], params_b[n]) for n in params_a], base_version="b",
                                  new_version="d")
        engine.apply_delta(payload, weight_version="d")
        _assert_joined_as(runner.model, params_b)
        engine.release_memory(["weights"])
        engine.resume_memory(["weights"])
        _assert_joined_as(runner.model, params_b)
        for p in runner.model.parameters():  # what resuming does on CUDA: each parameter in new memory
            p.data = p.data.clone()
        runner.weights_moved()  # ... and then this, which joins them again
        _assert_joined_as(runner.model, params_b)
        assert weights_checksum(runner.named_parameters())["total"] == weights_checksum(params_b.items())["total"]
    finally:
        engine.shutdown()


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_the_eager_ops(dtype):
    """Residual add + RMSNorm, rotary embedding + KV scatter, SiLU gate: the residual sum and the copied values
    bitwise, the rest to rounding (fp32: 1e-5 relative; bf16: one rounding step, 1e-2)."""
    from agentrl.engine.decoder_kernels import add_rms_norm, rope_scatter, silu_mul

    g = torch.Generator("cuda").manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    x, r = (torch.randn((37, 896), device="cuda", dtype=dtype, generator=g) for _ in range(2))
    w = torch.randn(896, device="cuda", dtype=dtype, generator=g)
    out, res = add_rms_norm(x, r, w, 1e-6)
    s = r + x
    h = s.float()
    assert torch.equal(res, s)
    assert rel(out, w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)) < tol
    heads, kv_heads, dim = 14, 2, 64
    qkv = torch.randn((5, (heads + 2 * kv_heads) * dim), device="cuda", dtype=dtype, generator=g)
    positions = torch.tensor([0, 3, 77, 500, 1000], device="cuda")
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float) / dim))
    freqs = torch.arange(1024, device="cuda").float()[:, None] * inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    kc = torch.full((8, kv_heads, 16, dim), float("nan"), device="cuda", dtype=dtype)
    vc = kc.clone()
    q = rope_scatter(qkv, positions, cos, sin, heads, kv_heads, dim, kc, vc, column=torch.tensor([9], device="cuda"))

    def rotate(t):  # transformers' apply_rotary_pos_emb, [tokens, heads, dim]
        c, s_ = cos[positions][:, None], sin[positions][:, None]
        return t * c + torch.cat((-t[..., dim // 2 :], t[..., : dim // 2]), -1) * s_

    split = qkv.view(5, heads + 2 * kv_heads, dim)
    assert rel(q.view(5, heads, dim), rotate(split[:, :heads])) < tol
    assert rel(kc[:5, :, 9], rotate(split[:, heads : heads + kv_heads])) < tol
    assert torch.equal(vc[:5, :, 9], split[:, heads + kv_heads :])
    assert kc[:, :, :9].isnan().all() and kc[5:].isnan().all()  # nothing else written
    gu = torch.randn((7, 2 * 4864), device="cuda", dtype=dtype, generator=g)
    assert rel(silu_mul(gu), torch.nn.functional.silu(gu[:, :4864]) * gu[:, 4864:]) < tol


@cuda
@pytest.mark.parametrize("vocab,splits", [(3000, None), (9000, 5)])
def test_sampler_draws_from_the_softmax_at_the_rows_temperature_and_advances_the_step(vocab, splits):
    """The in-kernel inverse-CDF draw: token frequencies follow softmax(logits / T) (4,096 draws per row: within
    5 standard errors), also when the vocabulary is split across programs and the draw must land in the right
    split; greedy rows take the argmax (the first of equal maxima), log-probs are log_softmax's; the step's
    token is fed back, positions, column and seed advance."""
    from agentrl.engine.decoder_kernels import sample

    g = torch.Generator("cuda").manual_seed(0)
    base = torch.randn(vocab, device="cuda", generator=g) * 2
    base[1234] = base[2345] = base.max() + 1  # a tie: the argmax is the first
    rows, temps = 4096, torch.tensor([0.5, 1.0, 2.0, 1.0], device="cuda")
    logits = base.to(torch.bfloat16).repeat(4 * rows, 1)
    t = temps.repeat_interleave(rows)
    greedy = torch.zeros(4 * rows, dtype=torch.bool, device="cuda")
    greedy[3 * rows :] = True
    out = torch.zeros((2, 4 * rows), dtype=torch.float64, device="cuda")
    ids = torch.zeros((4 * rows, 1), dtype=torch.long, device="cuda")
    positions = torch.arange(4 * rows, device="cuda").unsqueeze(1)
    column, seed = torch.tensor([5], device="cuda"), torch.tensor([11], device="cuda")
    sample(logits, t, greedy, seed, out, ids, positions, column, splits=splits)
    chosen = out[0].long()
    want = torch.log_softmax(logits.float() / t.unsqueeze(1), -1)
    assert torch.allclose(out[1].float(), want.gather(1, chosen.unsqueeze(1)).squeeze(1), atol=1e-5)
    assert (chosen[3 * rows :] == 1234).all()
    assert torch.equal(ids.squeeze(1), chosen) and torch.equal(positions.squeeze(1), torch.arange(4 * rows, device="cuda") + 1)
    assert column.item() == 6 and seed.item() == 12
    for i in range(3):
        p = torch.softmax(base.to(torch.bfloat16).float() / temps[i], -1)
        freq = torch.bincount(chosen[i * rows : (i + 1) * rows], minlength=vocab).float() / rows
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / rows).sqrt() + 1e-3).all(), i


@cuda
def test_decode_attention_reads_each_rows_span_alone():
    """With positions instead of a mask, a row attends to ``column - position .. column`` and reads nothing
    else (NaN elsewhere), at one split and several."""
    from agentrl.engine.decode_attention import decode_attention

    g = torch.Generator("cuda").manual_seed(1)
    rows, columns, column = 5, 700, 600
    q = torch.randn((rows, 2, 7, 64), device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn((rows, 2, columns, 64), device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    positions = torch.tensor([0, 1, 63, 300, 600], device="cuda")
    for t in (k, v):
        t[:, :, column + 1 :] = float("nan")
        for b in range(rows):
            t[b, :, : column - int(positions[b])] = float("nan")
    for splits in (None, 1, 4):
        out = decode_attention(q, k, v, None, 0.125, torch.tensor([column], device="cuda"), positions=positions,
                               splits=splits)
        for b in range(rows):
            lo = column - int(positions[b])
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1].float(), k[b : b + 1, :, lo : column + 1].float(), v[b : b + 1, :, lo : column + 1].float(),
                scale=0.125)
            assert ((out[b : b + 1].float() - ref).norm() / ref.norm()).item() < 2e-2, (splits, b)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_the_rotary_embedding_inside_matches_rope_scatter_then_attention(dtype):
    """``decode_attention(..., rope=...)`` (q and this step's k rotated in the kernel, k/v written at the column
    by split 0 and attended to from registers) gives what ``rope_scatter`` followed by the span attention gives,
    and writes the same k/v, at one split and several (fp32: 1e-5; bf16: 2e-2, relative)."""
    from agentrl.engine.decode_attention import decode_attention
    from agentrl.engine.decoder_kernels import rope_scatter

    g = torch.Generator("cuda").manual_seed(2)
    rows, heads, kv_heads, dim, columns, column = 6, 14, 2, 64, 300, 250
    qkv = torch.randn((rows, (heads + 2 * kv_heads) * dim), device="cuda", dtype=dtype, generator=g)
    cos, sin = (torch.randn((512, dim), device="cuda", dtype=dtype, generator=g) for _ in range(2))
    positions = torch.tensor([0, 1, 5, 64, 200, 250], device="cuda")
    limit = torch.tensor([column], device="cuda")
    k0, v0 = (torch.randn((rows, kv_heads, columns, dim), device="cuda", dtype=dtype, generator=g) for _ in range(2))
    k_ref, v_ref = k0.clone(), v0.clone()
    q = rope_scatter(qkv, positions, cos, sin, heads, kv_heads, dim, k_ref, v_ref, column=limit)
    ref = decode_attention(q.view(rows, kv_heads, heads // kv_heads, dim), k_ref, v_ref, None, 0.125, limit,
                           positions=positions, splits=1).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    qd, kd = heads * dim, kv_heads * dim
    for splits in (1, 3):
        k, v = k0.clone(), v0.clone()
        out = decode_attention(qkv[:, :qd].view(rows, kv_heads, heads // kv_heads, dim), k, v, None, 0.125, limit,
                               positions=positions, splits=splits, rope=(cos, sin, qd, qd + kd)).float()
        assert ((out - ref).norm() / ref.norm()).item() < tol, splits
        assert torch.equal(v, v_ref), splits  # copied; k rotated by the same expression (FMA contraction may differ)
        assert torch.allclose(k.float(), k_ref.float(), rtol=tol, atol=tol), splits


@cuda
def test_captured_decode_step_with_programmatic_dependent_launch_matches_plain_launches(tiny_model, monkeypatch):
    """On Hopper and later the decode step captured in a CUDA graph with every Triton kernel launched by PDL gives
    bitwise the logits and K/V writes of the same step launched plainly and eagerly: PDL moves when a kernel
    starts, not what it computes, so a difference is a kernel that read before its predecessor's writes landed."""
    from agentrl.engine import decoder_kernels

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9")
    from transformers import AutoModelForCausalLM

    from agentrl.engine.fused_decoder import FusedDecoder

    assert decoder_kernels.pdl_launch(torch.device("cpu")) == {"PDL": False}
    # the decoder on transformers' own modules (no runner: its compiled ops would count towards dynamo's
    # recompile limit, shared by the whole test process)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).to("cuda").eval()
    dec = FusedDecoder(model, context=128)
    g = torch.Generator("cuda").manual_seed(6)
    rows, columns = 48, 96
    layers = len(dec.model.model.layers)
    keys = [torch.randn((rows, dec.kv_heads, columns, dec.dim), device="cuda", dtype=dec.dtype, generator=g)
            for _ in range(layers)]
    values = [torch.randn_like(k) for k in keys]
    ids = torch.randint(3, 1000, (rows, 1), device="cuda", generator=g)
    positions = torch.randint(0, 80, (rows, 1), device="cuda", generator=g)
    column = torch.tensor([80], device="cuda")
    with torch.inference_mode():
        monkeypatch.setattr(decoder_kernels, "PDL", False)
        assert decoder_kernels.pdl_launch(ids.device) == {"PDL": False}
        want = dec.decode_logits(ids, positions, column, keys, values).clone()
        want_kv = [t[:, :, 80].clone() for t in keys + values]
        monkeypatch.setattr(decoder_kernels, "PDL", True)
        assert decoder_kernels.pdl_launch(ids.device) == {"PDL": True, "launch_pdl": True}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile the PDL kernels outside the capture
            dec.decode_logits(ids, positions, column, keys, values)
        torch.cuda.current_stream().wait_stream(side)
        for t in keys + values:
            t[:, :, 80] = float("nan")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dec.decode_logits(ids, positions, column, keys, values)
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
            assert all(torch.equal(t[:, :, 80], w) for t, w in zip(keys + values, want_kv, strict=True))


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_prefill_and_decode_match_transformers(tiny_model, dtype):
    """Through the runner: the fused prefill (bf16: flash attention over packed rows; fp32 keeps transformers')
    and the captured fused decode step give the log-probs of the plain runner (transformers' modules) to rounding
    (fp32 1e-4, bf16 5e-2 absolute on log-probs of a random tiny model), for rows of different lengths."""
    from agentrl.engine.protocol import SamplingParams

    fused = ModelRunner(str(tiny_model), dtype=dtype, device="cuda")
    plain = ModelRunner(str(tiny_model), dtype=dtype, device="cuda", fused_ops=False)
    assert fused.fused_decoder is not None and fused.fused_prefill == (dtype == "bfloat16")
    tol = 1e-4 if dtype == "float32" else 5e-2
    rng = random.Random(4)
    prompts = [[1] + [rng.randrange(3, 1000) for _ in range(n)] for n in (9, 40, 3, 17)]
    got, kvs = fused.prefill([(p, None) for p in prompts])
    ref, ref_kvs = plain.prefill([(p, None) for p in prompts])
    assert torch.allclose(torch.log_softmax(got.float(), -1), torch.log_softmax(ref.float(), -1), atol=tol)
    for row, ref_row in zip(kvs, ref_kvs, strict=True):
        for (k, v), (rk, rv) in zip(row, ref_row, strict=True):
            assert k.shape == rk.shape and torch.allclose(k.float(), rk.float(), atol=tol, rtol=tol)
            assert torch.allclose(v.float(), rv.float(), atol=tol, rtol=tol)
    a, b = plain.empty_batch().extend(ref_kvs), fused.empty_batch().extend(kvs)
    tokens = [rng.randrange(3, 1000) for _ in prompts]
    params = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.8, 1.2)]
    for _ in range(6):
        logits, a = plain.decode(a, tokens)
        drawn, logprobs = fused.decode_sample(b, tokens, params, [None] * len(prompts))
        for i, p in enumerate(params):
            want = torch.log_softmax(logits[i].float() / (1.0 if p.greedy else p.temperature), -1)
            assert abs(logprobs[i] - want[drawn[i]].item()) < tol
        tokens = drawn
