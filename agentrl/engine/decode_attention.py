"""One-token decode attention over the KV heads as stored (split-K "flash decoding"), a Triton kernel for CUDA.

Shapes as ``attention.decode_sdpa_attention_forward`` hands them: ``q`` ``[B, H_kv, G, D]`` (the ``G`` query
heads that share a KV head as its query positions), ``k``/``v`` ``[B, H_kv, T, D]``, an additive mask
``[B, T]`` shared by every head (or none). The ``T`` columns are cut into ``S`` splits so that a small
batch still fills the chip (at one row over 1,024 columns cuDNN's SDPA ran one 17 us kernel per layer on an
H200); each program keeps an online softmax over its split, a second kernel merges the splits. Columns past the
last one any row may see (``limit``, read on the device) are not read at all. fp32 inputs
multiply in IEEE fp32 (no tf32), so fp32 results match SDPA's to rounding; bf16/fp16 inputs use the
tensor cores with fp32 accumulation, as the fused SDPA kernels do.
"""

from __future__ import annotations

import functools
import math


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(Q, K, V, M, Limit, Acc, Mx, Sm,
                       sqb, sqh, sqg, skb, skh, skt, svb, svh, svt, smb,
                       G, T, per_split, scale,
                       HAS_MASK: tl.constexpr, HAS_LIMIT: tl.constexpr, IEEE: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_N: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        nh = tl.num_programs(1)
        ns = tl.num_programs(2)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(Q + b * sqb + h * sqh + offs_g[:, None] * sqg + offs_d[None, :], mask=offs_g[:, None] < G, other=0.0)
        m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        start = s * per_split
        end = tl.minimum(start + per_split, T)
        if HAS_LIMIT:  # no row attends past this column (read on the device: graph replays move it)
            end = tl.minimum(end, tl.load(Limit).to(tl.int32) + 1)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + offs_n
            valid = cols < end
            k = tl.load(K + b * skb + h * skh + cols[:, None] * skt + offs_d[None, :], mask=valid[:, None], other=0.0)
            if IEEE:  # noqa: SIM108 - a constexpr branch of a Triton kernel
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * scale
            if HAS_MASK:
                bias = tl.load(M + b * smb + cols, mask=valid, other=0.0).to(tl.float32)
                scores = scores + bias[None, :]
            scores = tl.where(valid[None, :], scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + h * svh + cols[:, None] * svt + offs_d[None, :], mask=valid[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row = (b * nh + h) * ns + s
        tl.store(Acc + (row * BLOCK_G + offs_g[:, None]) * D + offs_d[None, :], acc)
        tl.store(Mx + row * BLOCK_G + offs_g, m_i)
        tl.store(Sm + row * BLOCK_G + offs_g, l_i)

    @triton.jit
    def combine_kernel(Acc, Mx, Sm, Out, sob, soh, sog, G, S,
                       BLOCK_G: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        nh = tl.num_programs(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        m_all = tl.full([BLOCK_G], -float("inf"), tl.float32)
        l_all = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for s in range(0, S):
            row = (b * nh + h) * S + s
            m_s = tl.load(Mx + row * BLOCK_G + offs_g)
            l_s = tl.load(Sm + row * BLOCK_G + offs_g)
            a_s = tl.load(Acc + (row * BLOCK_G + offs_g[:, None]) * D + offs_d[None, :])
            m_new = tl.maximum(m_all, m_s)
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            w_old = tl.exp(m_all - m_safe)
            w_s = tl.exp(m_s - m_safe)
            l_all = l_all * w_old + l_s * w_s
            acc = acc * w_old[:, None] + a_s * w_s[:, None]
            m_all = m_new
        out = acc / l_all[:, None]
        tl.store(Out + b * sob + h * soh + offs_g[:, None] * sog + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=offs_g[:, None] < G)

    return partial_kernel, combine_kernel


BLOCK_N = 64


def supported(q, k, v, mask) -> bool:
    """Whether :func:`decode_attention` takes these (else the caller uses SDPA)."""
    import torch

    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and k.dtype == q.dtype
            and v.dtype == q.dtype and d in (32, 64, 128) and q.shape[2] <= 16 and k.stride(-1) == 1
            and v.stride(-1) == 1 and q.stride(-1) == 1
            and (mask is None or (mask.is_floating_point() and mask.shape[-1] == k.shape[2] and mask.stride(-1) == 1)))


def decode_attention(q, k, v, mask, scale: float | None = None, limit=None):
    """``softmax(q k^T * scale + mask) v`` per (row, KV head): ``q`` ``[B, H_kv, G, D]``, ``k``/``v``
    ``[B, H_kv, T, D]``, ``mask`` ``[B, T]`` additive or None; ``limit``: a one-element integer device tensor,
    the last column any row may attend to (columns after it are skipped, not read: the static decode
    batch's ``column``). Returns ``[B, H_kv, G, D]`` in ``q``'s dtype."""
    import torch

    partial_kernel, combine_kernel = _kernels()
    b, hk, g, d = q.shape
    t = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    tiles = -(-t // BLOCK_N)
    splits = max(1, min(tiles, -(-264 // (b * hk))))  # ~2 programs per multiprocessor (132 on an H200)
    per_split = -(-tiles // splits) * BLOCK_N
    splits = -(-t // per_split)
    block_g = 16
    acc = torch.empty((b, hk, splits, block_g, d), dtype=torch.float32, device=q.device)
    mx = torch.empty((b, hk, splits, block_g), dtype=torch.float32, device=q.device)
    sm = torch.empty_like(mx)
    out = torch.empty((b, hk, g, d), dtype=q.dtype, device=q.device)
    m = mask if mask is not None else q
    partial_kernel[(b, hk, splits)](
        q, k, v, m, limit if limit is not None else q, acc, mx, sm,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), m.stride(0) if mask is not None else 0,
        g, t, per_split, scale,
        HAS_MASK=mask is not None, HAS_LIMIT=limit is not None, IEEE=q.dtype == torch.float32, BLOCK_G=block_g, BLOCK_N=BLOCK_N, D=d,
        num_warps=4)
    combine_kernel[(b, hk)](acc, mx, sm, out, out.stride(0), out.stride(1), out.stride(2), g, splits,
                            BLOCK_G=block_g, D=d, num_warps=4)
    return out
