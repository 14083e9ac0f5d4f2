"""One-token decode attention over the KV heads as stored (split-K "flash decoding"), a Triton kernel for CUDA.

Shapes as ``attention.decode_sdpa_attention_forward`` hands them: ``q`` ``[B, H_kv, G, D]`` (the ``G`` query
heads that share a KV head as its query positions), ``k``/``v`` ``[B, H_kv, T, D]``, an additive mask
``[B, T]`` shared by every head (or none). The ``T`` columns are cut into ``S`` splits so that a small
batch still fills the chip (at one row over 1,024 columns cuDNN's SDPA ran one 17 us kernel per layer on an
H200); each program keeps an online softmax over its split, a second kernel merges the splits (none when one
split suffices). Columns past the last one any row may see (``limit``, read on the device) are not read at all;
given each row's span instead of a mask (``positions``), a row reads its own columns alone (no left padding). fp32 inputs
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

    from agentrl.engine.decoder_kernels import pdl_enter

    @triton.jit
    def partial_kernel(Q, K, V, M, Limit, Pos, Acc, Mx, Sm, Out, Cos, Sin,
                       sqb, sqh, sqg, skb, skh, skt, svb, svh, svt, smb, spb, sob, soh, sog, off_k, off_v,
                       G, T, per_split, scale,
                       HAS_MASK: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_SPAN: tl.constexpr, DIRECT: tl.constexpr,
                       ROPE: tl.constexpr, IEEE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                       D: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            pdl_enter()
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        nh = tl.num_programs(1)
        ns = tl.num_programs(2)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(Q + b * sqb + h * sqh + offs_g[:, None] * sqg + offs_d[None, :], mask=offs_g[:, None] < G, other=0.0)
        if ROPE:  # q, and this step's k, rotated here from the fused projection (rope_scatter's arithmetic)
            half: tl.constexpr = D // 2
            partner = (offs_d + half) % D
            sign = tl.where(offs_d < half, -1.0, 1.0)
            pos = tl.load(Pos + b * spb).to(tl.int64)
            cos = tl.load(Cos + pos * D + offs_d).to(tl.float32)
            sin = tl.load(Sin + pos * D + offs_d).to(tl.float32)
            qp = tl.load(Q + b * sqb + h * sqh + offs_g[:, None] * sqg + partner[None, :], mask=offs_g[:, None] < G,
                         other=0.0)
            q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * qp.to(tl.float32) * sin[None, :]).to(q.dtype)
            k_row = Q + b * sqb + off_k + h * D
            k_new = (tl.load(k_row + offs_d).to(tl.float32) * cos
                     + sign * tl.load(k_row + partner).to(tl.float32) * sin).to(q.dtype)
            v_new = tl.load(Q + b * sqb + off_v + h * D + offs_d)
        m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        if HAS_SPAN:  # row b attends to columns column - positions[b] .. column: its span, split evenly
            last = tl.load(Limit).to(tl.int32)
            first = last - tl.load(Pos + b * spb).to(tl.int32)
            stop = last if ROPE else last + 1  # with ROPE the new column is not read: split 0 adds it below
            per = tl.cdiv(tl.cdiv(stop - first, BLOCK_N), ns) * BLOCK_N
            start = first + s * per
            end = tl.minimum(start + per, stop)
        else:
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
        if ROPE:  # noqa: SIM102 - a constexpr branch: the inner one is a run-time branch
            if s == 0:  # this step's k and v: written to the cache, and attended to from registers
                tl.store(K + b * skb + h * skh + last * skt + offs_d, k_new)
                tl.store(V + b * svb + h * svh + last * svt + offs_d, v_new)
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.exp(m_i - m_new)
                p_new = tl.exp(s_new - m_new)
                l_i = l_i * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
                m_i = m_new
        if DIRECT:  # one split: the output itself
            out = acc / l_i[:, None]
            tl.store(Out + b * sob + h * soh + offs_g[:, None] * sog + offs_d[None, :], out.to(Out.dtype.element_ty),
                     mask=offs_g[:, None] < G)
        else:
            row = (b * nh + h) * ns + s
            tl.store(Acc + (row * BLOCK_G + offs_g[:, None]) * D + offs_d[None, :], acc)
            tl.store(Mx + row * BLOCK_G + offs_g, m_i)
            tl.store(Sm + row * BLOCK_G + offs_g, l_i)

    @triton.jit
    def combine_kernel(Acc, Mx, Sm, Out, sob, soh, sog, S,
                       BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
        """One query row (b, h, g): its splits merged at once (no loop over them)."""
        if PDL:
            pdl_enter()
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.program_id(2)
        nh = tl.num_programs(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, D)
        valid = offs_s < S
        rows = (b * nh + h) * S + offs_s
        m_s = tl.load(Mx + rows * BLOCK_G + g, mask=valid, other=-float("inf"))
        l_s = tl.load(Sm + rows * BLOCK_G + g, mask=valid, other=0.0)
        a_s = tl.load(Acc + (rows[:, None] * BLOCK_G + g) * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        m = tl.max(m_s, 0)
        w = tl.exp(m_s - tl.where(m == -float("inf"), 0.0, m))  # a split with no column weighs 0
        out = tl.sum(a_s * w[:, None], 0) / tl.sum(l_s * w, 0)
        tl.store(Out + b * sob + h * soh + g * sog + offs_d, out.to(Out.dtype.element_ty))

    return partial_kernel, combine_kernel


BLOCK_N = 128
# The launch when the caller names none: ``programs`` the grid it aims at (about one program per
# multiprocessor), ``block_n``/``num_warps``/``num_stages`` as in :func:`decode_attention`. Tile 128 with three
# loads in flight was the fastest of 72 launches at 128 rows with K/V read from HBM as in the engine's step
# (14.8 us against 15.2 for tile 64; benchmarks/results/gpu_engine_2026-12-04/). fp32 tiles are twice the bytes:
# tile 64 keeps three stages of them inside a multiprocessor's shared memory.
PROGRAMS = 132
LAUNCH = {"programs": PROGRAMS, "block_n": BLOCK_N, "num_warps": 4, "num_stages": 3}
FP32_BLOCK_N = 64


def supported(q, k, v, mask) -> bool:
    """Whether :func:`decode_attention` takes these (else the caller uses SDPA)."""
    import torch

    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and k.dtype == q.dtype
            and v.dtype == q.dtype and d in (32, 64, 128) and q.shape[2] <= 16 and k.stride(-1) == 1
            and v.stride(-1) == 1 and q.stride(-1) == 1
            and (mask is None or (mask.is_floating_point() and mask.shape[-1] == k.shape[2] and mask.stride(-1) == 1)))


def decode_attention(q, k, v, mask, scale: float | None = None, limit=None, positions=None, splits: int | None = None,
                     block_n: int | None = None, num_warps: int | None = None, rope=None,
                     num_stages: int | None = None):
    """``softmax(q k^T * scale + mask) v`` per (row, KV head): ``q`` ``[B, H_kv, G, D]``, ``k``/``v``
    ``[B, H_kv, T, D]``, ``mask`` ``[B, T]`` additive or None; ``limit``: a one-element integer device tensor,
    the last column any row may attend to (columns after it are skipped, not read: the static decode
    batch's ``column``). With ``positions`` (``[B]`` or ``[B, 1]`` integers, and ``limit``, no mask): row ``b``
    attends to columns ``limit - positions[b] .. limit`` alone, its own tokens and the new one (nothing left
    of them is read). ``splits``: programs per (row, KV head) (default: about one per multiprocessor);
    ``block_n``/``num_warps``/``num_stages``: the tile of columns, the warps per program and the loads in flight
    (Triton's software pipelining); each None: :data:`LAUNCH`'s (fp32: tile :data:`FP32_BLOCK_N`). ``rope`` (with ``positions``):
    ``(cos, sin, k_offset, v_offset)``: ``q`` is the query part of a fused q/k/v projection row (as a view),
    rotated here with the ``[positions, D]`` tables at each row's position, and this step's k and v are read
    from that row at the given element offsets, rotated (k), written into ``k``/``v`` at column ``limit`` and
    attended to from registers (``decoder_kernels.rope_scatter`` and this in one kernel).
    Returns ``[B, H_kv, G, D]`` in ``q``'s dtype."""
    import torch

    from agentrl.engine.decoder_kernels import pdl_launch

    partial_kernel, combine_kernel = _kernels()
    pdl = pdl_launch(q.device)
    block_n = block_n or (FP32_BLOCK_N if q.dtype == torch.float32 else LAUNCH["block_n"])
    num_warps = num_warps or LAUNCH["num_warps"]
    num_stages = num_stages or LAUNCH["num_stages"]
    b, hk, g, d = q.shape
    t = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    tiles = -(-t // block_n)
    span = positions is not None
    if span and (limit is None or mask is not None):
        raise ValueError("decode_attention: positions need limit and no mask")
    if rope is not None and not span:
        raise ValueError("decode_attention: rope needs positions")
    cos, sin, off_k, off_v = rope if rope is not None else (q, q, 0, 0)
    if splits is None:  # about one program per multiprocessor (132 on an H200); one split needs no merge kernel
        splits = max(1, min(tiles, -(-LAUNCH["programs"] // (b * hk))))
    per_split = -(-tiles // splits) * block_n
    if not span:
        splits = -(-t // per_split)
    block_g = 16
    direct = splits == 1
    out = torch.empty((b, hk, g, d), dtype=q.dtype, device=q.device)
    if direct:
        acc = mx = sm = out
    else:
        acc = torch.empty((b, hk, splits, block_g, d), dtype=torch.float32, device=q.device)
        mx = torch.empty((b, hk, splits, block_g), dtype=torch.float32, device=q.device)
        sm = torch.empty_like(mx)
    m = mask if mask is not None else q
    partial_kernel[(b, hk, splits)](
        q, k, v, m, limit if limit is not None else q, positions if span else q, acc, mx, sm, out, cos, sin,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), m.stride(0) if mask is not None else 0,
        positions.stride(0) if span else 0, out.stride(0), out.stride(1), out.stride(2), off_k, off_v,
        g, t, per_split, scale,
        HAS_MASK=mask is not None, HAS_LIMIT=limit is not None, HAS_SPAN=span, DIRECT=direct, ROPE=rope is not None,
        IEEE=q.dtype == torch.float32, BLOCK_G=block_g, BLOCK_N=block_n, D=d, num_warps=num_warps,
        num_stages=num_stages, **pdl)
    if not direct:
        combine_kernel[(b, hk, g)](acc, mx, sm, out, out.stride(0), out.stride(1), out.stride(2), splits,
                                   BLOCK_S=1 << (splits - 1).bit_length(), BLOCK_G=block_g, D=d, num_warps=1, **pdl)
    return out
