"""The chunked output-layer log-probs equal the plain ones and never create a (tokens, vocab) tensor."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agentrl.trainer.chunked_logprobs import linear_logprobs_and_entropy


def _reference(hidden, weight, targets, temperature):
    z = (hidden @ weight.t()).float() / temperature
    log_p = torch.log_softmax(z, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_p.gather(1, targets[:, None]).squeeze(1), entropy


def _inputs(n=37, h=16, vocab=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(vocab, h, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
def test_values_and_gradients_equal_the_unchunked_reference(chunk):
    hidden, weight, targets = _inputs()
    upstream = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lp, entropy = linear_logprobs_and_entropy(hidden, weight, targets, 0.7, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad((lp * upstream).sum(), (hidden, weight))
    ref_lp, ref_entropy = _reference(hidden, weight, targets, 0.7)
    rh, rw = torch.autograd.grad((ref_lp * upstream).sum(), (hidden, weight))
    # The chunked path computes in fp32 (as the trainer's logits are): equal to fp32 rounding, not bitwise
    # (another summation order in the softmax and in the weight gradient's sum over chunks).
    for got, want in ((lp, ref_lp), (entropy, ref_entropy), (gh, rh), (gw, rw)):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad


def test_no_tensor_of_tokens_times_vocab_is_created():
    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    LargestTensor.largest = max(LargestTensor.largest, t.numel())
            return out

    n, vocab, chunk = 512, 97, 16
    hidden, weight, targets = _inputs(n=n, h=8, vocab=vocab)
    with LargestTensor():
        lp, _ = linear_logprobs_and_entropy(hidden, weight, targets, chunk_tokens=chunk)
        lp.sum().backward()
    # The largest tensor made is one chunk's logits (or the inputs themselves), never n x vocab.
    assert LargestTensor.largest <= max(chunk * vocab, hidden.numel(), weight.numel())
    assert LargestTensor.largest < n * vocab


@pytest.mark.parametrize("bad", [dict(hidden=torch.zeros(3)), dict(targets=torch.zeros(4, dtype=torch.long)),
                                 dict(chunk_tokens=0)])
def test_bad_shapes_are_refused(bad):
    args = dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), targets=torch.zeros(3, dtype=torch.long))
    chunk = bad.pop("chunk_tokens", 8)
    args.update(bad)
    with pytest.raises(ValueError):
        linear_logprobs_and_entropy(args["hidden"], args["weight"], args["targets"], chunk_tokens=chunk)
