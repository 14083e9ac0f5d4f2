"""The one-pass Triton kernels, as the log-prob chunks use them on CUDA, give what the fp32 torch chunks
give (GPU speed: benchmarks/trainer_bench.py --fp32-logprobs is the torch side of that A/B)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


def _run(hidden, weight, targets, temperature, kernels: bool, monkeypatch):
    from agentrl.trainer import fused_logprobs
    from agentrl.trainer.chunked_logprobs import linear_logprobs_and_entropy

    monkeypatch.setattr(fused_logprobs, "ENABLED", kernels)
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    upstream = torch.randn(hidden.shape[0], device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    lp, ent = linear_logprobs_and_entropy(h, w, targets, temperature, chunk_tokens=16)
    (lp * upstream).sum().backward()
    return lp, ent, h.grad, w.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab", [5000, 4096 * 2 + 17])  # ends mid-block; whole blocks and more
def test_kernel_chunks_equal_the_fp32_chunks(vocab, temperature, monkeypatch):
    from agentrl.trainer import fused_logprobs

    assert fused_logprobs.available(torch.device("cuda"), 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h = 70, 64
    hidden = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(vocab, h, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    lp, ent, gh, gw = _run(hidden, weight, targets, temperature, True, monkeypatch)
    ref_lp, ref_ent, ref_gh, ref_gw = _run(hidden, weight, targets, temperature, False, monkeypatch)
    assert lp.dtype == ent.dtype == torch.float32 and not ent.requires_grad
    # the same bf16 logits summed in fp32 in two orders: a few fp32 ulps of values of order log(vocab)
    assert torch.allclose(lp, ref_lp, rtol=0, atol=2e-5)
    assert torch.allclose(ent, ref_ent, rtol=0, atol=2e-5)
    # the logits' gradient is rounded to bf16 on both sides before the matmuls: within a bf16 rounding
    for got, want in ((gh, ref_gh), (gw, ref_gw)):
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-3)
