"""The chunked output-layer log-probs equal the plain ones (one rank and vocab-parallel over two gloo
processes, with and without an entropy gradient) and never create a (tokens, vocab) tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from agentrl.trainer.chunked_logprobs import linear_logprobs_and_entropy, shifted_logprobs_and_entropy


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


def _grads_of_both(hidden, weight, targets, temperature, **kwargs):
    """Values and d/d(hidden, weight) of ``sum(lp * u) + sum(entropy * w)`` for fixed random ``u``, ``w``."""
    g = torch.Generator().manual_seed(5)
    u, w = torch.randn(2, hidden.shape[0], generator=g, dtype=torch.float64)
    if kwargs:
        lp, entropy = linear_logprobs_and_entropy(hidden, weight, targets, temperature, entropy_grad=True, **kwargs)
    else:
        lp, entropy = _reference(hidden, weight, targets, temperature)
    grads = torch.autograd.grad((lp * u).sum() + (entropy * w).sum(), (hidden, weight))
    return lp, entropy, *grads


@pytest.mark.parametrize("chunk", [4, 1000])
def test_the_entropy_gradient_equals_the_unchunked_reference(chunk):
    hidden, weight, targets = _inputs()
    got = _grads_of_both(hidden, weight, targets, 0.7, chunk_tokens=chunk)
    want = _grads_of_both(hidden, weight, targets, 0.7)
    assert got[1].requires_grad
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def _vocab_parallel_worker(rank: int, store_path: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    hidden, weight, targets = _inputs()  # vocab 101 -> pad to 102 with a row no target hits
    weight = torch.cat([weight.detach(), torch.full((1, weight.shape[1]), -1e3, dtype=weight.dtype)])
    local = weight[rank * 51:(rank + 1) * 51].clone().requires_grad_()
    lp, entropy, gh, gw = _grads_of_both(hidden, local, targets, 0.7, chunk_tokens=8, tp_group=dist.group.WORLD)
    # numpy pickles by value; a torch tensor would travel as a shared-memory fd that vanishes when this process exits
    queue.put((rank, *(t.detach().numpy() for t in (lp, entropy, gh, gw))))
    dist.barrier()
    dist.destroy_process_group()


def test_vocab_parallel_over_two_ranks_equals_one_rank(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_vocab_parallel_worker, args=(r, str(tmp_path / "store"), queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=120) for _ in procs))
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    hidden, weight, targets = _inputs()
    weight = torch.cat([weight.detach(), torch.full((1, weight.shape[1]), -1e3, dtype=weight.dtype)]).requires_grad_()
    lp, entropy, gh, gw = _grads_of_both(hidden, weight, targets, 0.7)
    for rank, (r_lp, r_entropy, r_gh, r_gw) in results.items():
        # every rank ends with the whole of lp, entropy and d/d hidden; d/d weight for its rows
        for a, b in ((r_lp, lp), (r_entropy, entropy), (r_gh, gh), (r_gw, gw[rank * 51:(rank + 1) * 51])):
            torch.testing.assert_close(torch.from_numpy(a).double(), b.detach().double(), rtol=1e-5, atol=1e-5)


def test_shifted_values_start_at_zero_and_follow_the_next_token():
    hidden, weight, _ = _inputs(n=12)
    tokens = torch.randint(0, weight.shape[0], (2, 6), generator=torch.Generator().manual_seed(3))
    lp, entropy = shifted_logprobs_and_entropy(hidden.view(2, 6, -1), weight, tokens)
    ref_lp, ref_entropy = _reference(hidden.view(2, 6, -1)[:, :-1].reshape(10, -1), weight, tokens[:, 1:].reshape(-1), 1.0)
    assert torch.all(lp[:, 0] == 0) and torch.all(entropy[:, 0] == 0)
    torch.testing.assert_close(lp[:, 1:].reshape(-1).double(), ref_lp.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[:, 1:].reshape(-1).double(), ref_entropy.double(), rtol=1e-5, atol=1e-5)
