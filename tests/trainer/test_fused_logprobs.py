"""The one-pass log-prob/entropy kernel gives what the fp32 path gives (GPU speed: benchmarks/trainer_bench.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(2, 33, 5000), (1, 70, 4096 * 2 + 17)])  # vocab: ends mid-block, whole blocks+
def test_fused_logprobs_and_entropy_equal_the_fp32_path(shape, temperature):
    from agentrl.trainer.fused_logprobs import logprobs_and_entropy
    from agentrl.trainer.logprobs import token_logprobs, vocab_parallel_entropy
    from agentrl.trainer.parallel import init_model_parallel

    init_model_parallel(1, seed=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, length, vocab = shape
    logits = (torch.randn(shape, device="cuda", generator=g) * 4).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, vocab, (b, length), device="cuda", generator=g)
    weights = torch.randn(b, length, device="cuda", generator=g)
    lp, ent = logprobs_and_entropy(logits, tokens, temperature)
    (lp * weights).sum().backward()
    grad = logits.grad
    ref_logits = logits.detach().float().requires_grad_()  # the trainer's fp32 path: the bf16 values upcast
    ref_lp = token_logprobs(ref_logits, tokens, temperature)
    with torch.no_grad():
        ref_ent = vocab_parallel_entropy(ref_logits, temperature)
    (ref_lp * weights).sum().backward()
    assert lp.shape == ent.shape == (b, length) and lp.dtype == ent.dtype == torch.float32
    assert torch.all(lp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    # fp32 sums over the vocabulary in two orders: a few fp32 ulps of values of order log(vocab)
    assert torch.allclose(lp, ref_lp, rtol=0, atol=2e-5)
    assert torch.allclose(ent, ref_ent, rtol=0, atol=2e-5)
    # the gradient is stored in bf16 (as the fp32 path's is, on its way into the LM head): within one bf16
    # rounding of the fp32 reference, plus the fp32 differences above
    ref_grad = ref_logits.grad
    assert grad.dtype == torch.bfloat16
    assert torch.all((grad.float() - ref_grad).abs() <= ref_grad.abs() * 2**-8 + 1e-6)
    assert not ent.requires_grad
