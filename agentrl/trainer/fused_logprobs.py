"""One-pass log-prob / entropy kernels over rows of logits (CUDA, Triton), for the chunks of
:mod:`agentrl.trainer.chunked_logprobs`.

A chunk's fp32 softmax in torch ops reads and writes its ``[c, V]`` logits about eight times. Here one
Triton program per position streams its row once (online max, sum of exponentials and sum of
``exp(z) * z``), giving the target's log-prob, the entropy and the log-normaliser; the backward streams
the row again and writes the logits' gradient, ``(onehot - softmax) * grad / temperature``, in the
logits' dtype. The same functions computed in fp32 from the same (bf16) values in another order: equal
to fp32 rounding, the gradient within one bf16 rounding (tests/trainer/test_fused_logprobs.py, on CUDA).

Used on CUDA with one tensor-parallel rank when the entropy carries no gradient (``entropy_coef == 0``);
elsewhere the chunks run in fp32 torch ops. Triton is imported only when a kernel is launched.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

BLOCK = 4096  # vocabulary columns per iteration of a row's loop
_NEG = -1.0e30  # a finite "minus infinity" for the running max (exp(_NEG - m) == 0, and 0 * it == 0)
_kernels: Any = None


ENABLED = True  # benchmarks/trainer_bench.py --fp32-logprobs turns it off (the torch chunks: an A/B)


def available(device: torch.device, tp_size: int) -> bool:
    """Whether the kernels serve a trainer on ``device`` with ``tp_size`` tensor-parallel ranks (CUDA, one
    rank: it holds the whole vocabulary; Triton importable)."""
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


def row_stats(rows: torch.Tensor, targets: torch.Tensor,
              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log-prob of the target, entropy, log-normaliser)`` of each row of ``rows`` ``[n, V]`` (any float
    dtype, read once) scaled by ``1 / temperature``; fp32 ``[n]`` each; a target of -1 gives log-prob 0."""
    global _kernels
    if _kernels is None:
        _kernels = _build()
    n, vocab = rows.shape
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    lp = torch.empty(n, dtype=torch.float32, device=rows.device)
    ent, lse = torch.empty_like(lp), torch.empty_like(lp)
    if n:
        _kernels[0][(n,)](rows, rows.stride(0), targets.contiguous(), lp, ent, lse, 1.0 / temperature, V=vocab,
                          NEG=_NEG, BLOCK=BLOCK, num_warps=8)
    return lp, ent, lse


def row_grad(rows: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_lp: torch.Tensor,
             temperature: float = 1.0) -> torch.Tensor:
    """d(sum of ``grad_lp`` x log-prob)/d ``rows``, ``[n, V]`` in ``rows``' dtype, given
    :func:`row_stats`' log-normaliser ``lse`` of the same rows and temperature."""
    global _kernels
    if _kernels is None:
        _kernels = _build()
    n, vocab = rows.shape
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    grad = torch.empty((n, vocab), dtype=rows.dtype, device=rows.device)
    if n:
        _kernels[1][(n,)](rows, rows.stride(0), targets.contiguous(), lse.contiguous(),
                          grad_lp.contiguous().float(), grad, 1.0 / temperature, V=vocab, BLOCK=BLOCK, num_warps=8)
    return grad
