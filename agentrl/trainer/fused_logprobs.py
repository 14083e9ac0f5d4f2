"""Token log-probs and entropy straight from bf16 logits, in one pass over the vocabulary (CUDA, Triton).

:func:`~agentrl.trainer.logprobs.token_logprobs` and :func:`~agentrl.trainer.logprobs.vocab_parallel_entropy`
work on fp32 logits: at 8k tokens and a 152k vocabulary each pass over them moves 5 GB, and the two
functions, their backward and the fp32 upcast make about 15 such passes per micro-batch. Here one
Triton program per position streams its row of logits once (online max, sum of exponentials and sum
of ``exp(z) * z``), giving the target's log-prob, the entropy and the log-normaliser; the backward
streams the row again and writes the logits' gradient, ``(onehot - softmax) * grad / temperature``, in
the logits' dtype. Same functions, computed in fp32 from the same bf16 values, in another order: equal
to fp32 rounding, the gradient within one bf16 rounding (tests/trainer/test_fused_logprobs.py, on CUDA;
tests/trainer/test_packing.py runs the trainer through it there).

Used by :class:`~agentrl.trainer.actor.MegatronTrainer` on CUDA with one tensor-parallel rank when the
entropy carries no gradient (``entropy_coef == 0``); elsewhere the fp32 path runs. Triton is imported
only when a kernel is launched.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

BLOCK = 4096  # vocabulary columns per iteration of a row's loop
_NEG = -1.0e30  # a finite "minus infinity" for the running max (exp(_NEG - m) == 0, and 0 * it == 0)
_kernels: Any = None


ENABLED = True  # benchmarks/trainer_bench.py --fp32-logprobs turns it off (the before of an A/B)


def available(device: torch.device, tp_size: int) -> bool:
    """Whether :func:`logprobs_and_entropy` serves a trainer on ``device`` with ``tp_size`` tensor-parallel
    ranks (CUDA, one rank: each holds the whole vocabulary; Triton importable)."""
    return ENABLED and device.type == "cuda" and tp_size == 1 and importlib.util.find_spec("triton") is not None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def forward(logits, stride, targets, lp_out, ent_out, lse_out, inv_t, V: tl.constexpr, NEG: tl.constexpr,
                BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        m = tl.full([], NEG, tl.float32)
        s = tl.full([], 0.0, tl.float32)  # sum of exp(x - m)
        t = tl.full([], 0.0, tl.float32)  # sum of exp(x - m) * (x - m)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < V
            x = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            x = tl.where(valid, x, NEG)
            m_new = tl.maximum(m, tl.max(x, 0))
            z = x - m_new
            e = tl.where(valid, tl.exp(z), 0.0)
            shift = m - m_new  # <= 0
            scale = tl.exp(shift)
            t = scale * (t + shift * s) + tl.sum(tl.where(valid, e * z, 0.0), 0)
            s = scale * s + tl.sum(e, 0)
            m = m_new
        log_s = tl.log(s)
        target = tl.load(targets + row)
        has = target >= 0
        x_t = tl.load(base + tl.where(has, target, 0)).to(tl.float32) * inv_t
        tl.store(lp_out + row, tl.where(has, x_t - m - log_s, 0.0))
        tl.store(ent_out + row, log_s - t / s)
        tl.store(lse_out + row, m + log_s)

    @triton.jit
    def backward(logits, stride, targets, lse, grad_lp, grad_out, inv_t, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        out = grad_out + row * V
        target = tl.load(targets + row)
        g = tl.where(target >= 0, tl.load(grad_lp + row), 0.0) * inv_t
        norm = tl.load(lse + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < V
            x = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            p = tl.exp(x - norm)
            grad = (tl.where(cols == target, 1.0, 0.0) - p) * g
            tl.store(out + cols, grad.to(grad_out.dtype.element_ty), mask=valid)

    return forward, backward


class _LogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, targets: torch.Tensor, temperature: float):
        global _kernels
        if _kernels is None:
            _kernels = _build()
        n, vocab = rows.shape
        lp = torch.empty(n, dtype=torch.float32, device=rows.device)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        if n:
            _kernels[0][(n,)](rows, rows.stride(0), targets, lp, ent, lse, 1.0 / temperature, V=vocab, NEG=_NEG,
                              BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(rows, targets, lse)
        ctx.inv_t = 1.0 / temperature
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp: torch.Tensor, grad_ent: torch.Tensor | None):
        rows, targets, lse = ctx.saved_tensors
        n, vocab = rows.shape
        grad = torch.empty((n, vocab), dtype=rows.dtype, device=rows.device)
        if n:
            _kernels[1][(n,)](rows, rows.stride(0), targets, lse, grad_lp.contiguous().float(), grad, ctx.inv_t, V=vocab,
                              BLOCK=BLOCK, num_warps=8)
        return grad, None, None


def logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``([b, L] log-probs, [b, L] entropy)`` shifted like :func:`~agentrl.trainer.logprobs.token_logprobs`
    (column ``t`` from ``logits[:, t - 1]``; column 0 is 0) from ``[b, L, V]`` logits of any float dtype
    (one TP rank: the whole vocabulary). The log-probs are differentiable (the gradient comes back in
    the logits' dtype); the entropy is not."""
    b, length, vocab = logits.shape
    rows = logits.reshape(b * length, vocab)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    # row (i, j) predicts tokens[i, j + 1]; a sequence's last row predicts nothing (-1)
    targets = torch.cat([tokens[:, 1:], tokens.new_full((b, 1), -1)], 1).reshape(-1).to(torch.int64)
    lp, ent = _LogprobsEntropy.apply(rows, targets.contiguous(), float(temperature))
    zero = lp.new_zeros(b, 1)
    return (torch.cat([zero, lp.view(b, length)[:, :-1]], 1),
            torch.cat([zero, ent.view(b, length)[:, :-1]], 1))
