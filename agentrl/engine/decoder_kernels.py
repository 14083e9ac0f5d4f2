"""Triton kernels of the engine's own decoder forward (``fused_decoder.py``), CUDA only (imports Triton:
imported lazily, by CUDA paths alone).

Each replaces several of the kernels transformers' eager modules launch per layer, with the same arithmetic:

* :func:`add_rms_norm`: the residual add (rounded to the model dtype, as eager's ``residual + x``) and the
  RMSNorm after it (fp32 normalisation, cast back, times the weight in the model dtype): one kernel, two outputs.
* :func:`rope_scatter`: rotary embedding of q and k straight from the fused q/k/v projection (``cos``/``sin``
  read from tables that transformers' own rotary module computed once for every position), k and v written into a KV buffer at each token's (row, column): the rotary module, ``apply_rotary_pos_emb``
  and the cache's two ``index_copy_`` in one kernel.
* :func:`silu_mul`: ``silu(gate) * up`` from the fused gate/up projection.
* :func:`sample`: the decode step's draw: logsumexp and argmax over the vocabulary split across programs, then
  a second kernel that merges the splits, draws by inverse CDF with one Philox uniform per row (it reads only the
  split the draw lands in again), writes token and log-prob, and advances the step's inputs (token fed back,
  positions, column, seed) so a captured step needs no other bookkeeping kernel.

On Hopper and later every kernel here (and ``decode_attention``'s) is launched with programmatic dependent launch
(:func:`pdl_launch`): the GPU starts setting it up while the kernel before it still runs, and its first statement
waits for that kernel's writes (``gdc_wait``), so nothing it reads or writes is touched early; it then lets the
next such kernel start setting up in turn. A decode step at 128 rows of a 0.5B model is ~240 kernels of 1-15 us
each; with PDL it took 1.29-1.30 ms instead of 1.37-1.38 (``benchmarks/results/gpu_engine_2026-12-04c/NOTES.md``).
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

try:  # the griddepcontrol wrappers (in Triton 3.6; releases without them launch plainly)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

PDL = True  # programmatic dependent launch where the GPU has it (a switch for benchmarks' A/B)


@triton.jit
def pdl_enter():
    """A PDL-launched kernel's first statement: wait until the kernel before it finished (its writes visible),
    then let the next kernel be set up."""
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def add_rms_norm_kernel(X, R, W, Out, ResOut, sx, sr, so, sro, N, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_enter()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < N
    x = tl.load(X + row * sx + cols, mask=inside, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * sr + cols, mask=inside, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * sro + cols, x, mask=inside)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    normed = (h * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=inside, other=0.0)
    tl.store(Out + row * so + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(Out.dtype.element_ty),
             mask=inside)

@triton.jit
def rope_scatter_kernel(QKV, sqkv, Pos, Cos, Sin, QOut, sqo, KOut, sko,
                        KC, VC, skb, skh, skt, svb, svh, svt, Row, Col,
                        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                        DECODE: tl.constexpr, WRITE_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = D // 2
    d = tl.arange(0, D)
    heads = tl.arange(0, BLOCK_H)
    pos = tl.load(Pos + t).to(tl.int64)
    dtype = QKV.dtype.element_ty
    cos = tl.load(Cos + pos * D + d).to(tl.float32)
    sin = tl.load(Sin + pos * D + d).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    partner = (d + half) % D
    base = QKV + t * sqkv
    if DECODE:  # token t is row t, written at the batch's column
        row = t
        col = tl.load(Col).to(tl.int64)
    else:
        row = tl.load(Row + t).to(tl.int64)
        col = tl.load(Col + t).to(tl.int64)
    # q heads, then k heads (adjacent in the fused projection): rotated
    qk = heads < HQ + HKV
    x = tl.load(base + heads[:, None] * D + d[None, :], mask=qk[:, None], other=0.0).to(tl.float32)
    xr = tl.load(base + heads[:, None] * D + partner[None, :], mask=qk[:, None], other=0.0).to(tl.float32)
    y = (x * cos[None, :] + sign[None, :] * xr * sin[None, :]).to(dtype)
    is_q = heads < HQ
    tl.store(QOut + t * sqo + heads[:, None] * D + d[None, :], y, mask=is_q[:, None])
    kh = heads - HQ
    is_k = (heads >= HQ) & qk
    if WRITE_K:
        tl.store(KOut + t * sko + kh[:, None] * D + d[None, :], y, mask=is_k[:, None])
    tl.store(KC + row * skb + kh[:, None] * skh + col * skt + d[None, :], y, mask=is_k[:, None])
    # v heads: copied
    vh = heads
    is_v = vh < HKV
    v = tl.load(base + (HQ + HKV) * D + vh[:, None] * D + d[None, :], mask=is_v[:, None], other=0.0)
    tl.store(VC + row * svb + vh[:, None] * svh + col * svt + d[None, :], v, mask=is_v[:, None])

@triton.jit
def silu_mul_kernel(GU, sgu, Out, so, inner, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_enter()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < inner
    g = tl.load(GU + row * sgu + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(GU + row * sgu + inner + cols, mask=inside, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Out.dtype.element_ty).to(tl.float32)  # eager rounds silu's output
    tl.store(Out + row * so + cols, (act * u).to(Out.dtype.element_ty), mask=inside)

@triton.jit
def sample_partial_kernel(Logits, sl, Temps, PartF, PartI, V, per_split, QUARTER: tl.constexpr, PDL: tl.constexpr):
    """One (row, split): every lane keeps its own running logsumexp and argmax over the columns it visits (no
    cross-lane reduction inside the loop); the lanes are reduced once at the end. One exp per entry, no
    random numbers: the draw reads only the one split it lands in (``sample_combine_kernel``)."""
    if PDL:
        pdl_enter()
    b = tl.program_id(0)
    s = tl.program_id(1)
    ns = tl.num_programs(1)
    inv_temp = 1.0 / tl.load(Temps + b)
    start = s * per_split
    q = tl.arange(0, QUARTER)
    m = tl.full([QUARTER], -float("inf"), tl.float32)
    total = tl.zeros([QUARTER], tl.float32)
    best = tl.full([QUARTER], -float("inf"), tl.float32)
    best_i = tl.zeros([QUARTER], tl.int32)
    row = Logits + b.to(tl.int64) * sl
    for c0 in range(start, start + per_split, 4 * QUARTER):
        for j in tl.static_range(4):  # four loads in flight per iteration
            cols = c0 + j * QUARTER + q
            x = tl.load(row + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_temp
            # logsumexp, one exp per entry: rescale the lane's sum when the entry is its new maximum
            up = x > m
            e = tl.exp(tl.where(up, m - x, x - m))
            e = tl.where(x == -float("inf"), 0.0, e)  # past the vocabulary
            total = tl.where(up, total * e + 1.0, total + e)
            m = tl.maximum(m, x)
            # strict: each lane keeps its earliest column among equal values (as torch.argmax)
            take = x > best
            best = tl.where(take, x, best)
            best_i = tl.where(take, cols, best_i)
    big = 2147483647
    m_all = tl.max(m, 0)
    m_safe = tl.where(m_all == -float("inf"), 0.0, m_all)
    total_all = tl.sum(total * tl.exp(m - m_safe), 0)
    best_all = tl.max(best, 0)
    best_at = tl.min(tl.where(best == best_all, best_i, big), 0)
    k = b * ns + s
    tl.store(PartF + k * 3 + 0, m_all)
    tl.store(PartF + k * 3 + 1, total_all)
    tl.store(PartF + k * 3 + 2, best_all)
    tl.store(PartI + k, best_at)


@triton.jit
def sample_combine_kernel(PartF, PartI, S, Logits, sl, Temps, V, per_split, Greedy, Out, so, Ids, Pos, Column, Seed,
                          ADVANCE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: the logsumexp and argmax from the splits' partials, then an inverse-CDF draw with one uniform:
    the split whose cumulative weight passes ``u * total``, and inside it (one pass over its columns) the first
    column whose cumulative weight does. Rounding between the two sums can leave the target past the split's
    last column by ~1e-7 of the total: the draw then takes the split's last column of nonzero weight."""
    if PDL:
        pdl_enter()
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    valid = offs < S
    k = b * S + offs
    ms = tl.load(PartF + k * 3 + 0, mask=valid, other=-float("inf"))
    ls = tl.load(PartF + k * 3 + 1, mask=valid, other=0.0)
    m = tl.max(ms, 0)
    ws = tl.where(valid, ls * tl.exp(ms - m), 0.0)  # each split's weight, relative to the row's maximum
    total = tl.sum(ws, 0)
    lse = m + tl.log(total)
    big = 2147483647
    bs = tl.load(PartF + k * 3 + 2, mask=valid, other=-float("inf"))
    best = tl.max(bs, 0)
    best_i = tl.min(tl.where(bs == best, tl.load(PartI + k, mask=valid, other=big), big), 0)
    # the split the draw lands in: the number of splits whose cumulative weight is <= the target (capped at the
    # last split with weight), and the target's remainder inside it
    target = tl.rand(tl.load(Seed), b) * total
    landed = tl.minimum(tl.sum(((tl.cumsum(ws, 0) <= target) & valid).to(tl.int32), 0),
                        tl.max(tl.where(ws > 0, offs, -1), 0))
    rest = target - tl.sum(tl.where(offs < landed, ws, 0.0), 0)
    inv_temp = 1.0 / tl.load(Temps + b)
    row = Logits + b.to(tl.int64) * sl
    start = landed * per_split
    end = tl.minimum(start + per_split, V)
    q = tl.arange(0, BLOCK)
    drawn = big
    last = -1
    carry = 0.0
    for c0 in range(0, per_split, BLOCK):
        cols = start + c0 + q
        x = tl.load(row + cols, mask=cols < end, other=-float("inf")).to(tl.float32) * inv_temp
        w = tl.where(x == -float("inf"), 0.0, tl.exp(x - m))
        running = tl.cumsum(w, 0) + carry
        drawn = tl.minimum(drawn, tl.min(tl.where((running > rest) & (w > 0), cols, big), 0))
        last = tl.maximum(last, tl.max(tl.where(w > 0, cols, -1), 0))
        carry += tl.sum(w, 0)
    drawn = tl.maximum(tl.where(drawn == big, last, drawn), 0)  # 0: a row with no finite weight (NaN logits)
    greedy = tl.load(Greedy + b) != 0
    chosen = tl.where(greedy, best_i, drawn)
    chosen_x = tl.load(row + chosen).to(tl.float32) * inv_temp
    tl.store(Out + b, chosen.to(tl.float64))
    tl.store(Out + so + b, (chosen_x - lse).to(tl.float64))
    if ADVANCE:  # the step's inputs for the next replay: its token, one position on, the next column
        tl.store(Ids + b, chosen.to(tl.int64))
        tl.store(Pos + b, tl.load(Pos + b) + 1)
        if b == 0:
            tl.store(Column, tl.load(Column) + 1)
            tl.store(Seed, tl.load(Seed) + 1)


@functools.cache
def _pdl_capable(index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(index)[0] >= 9 and os.environ.get("TRITON_INTERPRET") != "1"


def pdl_launch(device) -> dict:
    """The launch arguments of a kernel with a ``PDL`` constexpr on ``device``: programmatic dependent launch on
    CUDA devices of compute capability 9 (Hopper) and later while :data:`PDL` is on, else a plain launch."""
    import torch

    on = PDL and gdc_wait is not None and device.type == "cuda" and _pdl_capable(
        device.index if device.index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def add_rms_norm(x, residual, weight, eps: float):
    """``(rms_norm(residual + x) * weight, residual + x)`` over the last dim of 2-D ``x``; ``residual`` None:
    ``(rms_norm(x) * weight, x)``."""
    import torch

    m, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    block = _pow2(n)
    add_rms_norm_kernel[(m,)](x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0),
                                     res_out.stride(0), n, eps, HAS_RES=residual is not None, BLOCK=block,
                                     num_warps=4 if block <= 2048 else 8, **pdl_launch(x.device))
    return out, res_out


def rope_scatter(qkv, positions, cos, sin, heads: int, kv_heads: int, dim: int,
                 k_cache, v_cache, column=None, rows=None, columns=None, k_out=None):
    """Rotate q and k of the fused projection ``qkv`` ``[M, (heads + 2 kv_heads) * dim]`` at ``positions``
    ``[M]`` (``cos``/``sin``: ``[positions, dim]`` tables in the model dtype, rows as transformers' rotary
    module gives them); write k and v into ``k_cache``/``v_cache`` ``[rows, kv_heads, T, dim]``: token ``t`` at row ``t`` and
    column ``column[0]`` (decode), or at ``rows[t]``, ``columns[t]``. Returns the rotated q ``[M, heads * dim]``;
    the rotated k also goes to ``k_out`` ``[M, kv_heads * dim]`` when given."""
    import torch

    m = qkv.shape[0]
    q_out = torch.empty((m, heads * dim), dtype=qkv.dtype, device=qkv.device)
    decode = column is not None
    rope_scatter_kernel[(m,)](
        qkv, qkv.stride(0), positions, cos, sin, q_out, q_out.stride(0),
        k_out if k_out is not None else q_out, k_out.stride(0) if k_out is not None else 0,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        rows if not decode else positions, column if decode else columns,
        HQ=heads, HKV=kv_heads, D=dim, BLOCK_H=_pow2(heads + kv_heads), DECODE=decode, WRITE_K=k_out is not None,
        num_warps=4, **pdl_launch(qkv.device))
    return q_out


def silu_mul(gate_up):
    """``silu(gate) * up`` for ``gate_up`` ``[M, 2 I]`` (gate first): ``[M, I]``."""
    import torch

    m, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty((m, i), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    silu_mul_kernel[(m, -(-i // block))](gate_up, gate_up.stride(0), out, out.stride(0), i, BLOCK=block,
                                               num_warps=4, **pdl_launch(gate_up.device))
    return out


QUARTER = 512  # columns per quarter tile of the sampler's first pass (a tile is 4 quarters, loaded together)
SCAN_BLOCK = 1024  # columns per iteration of the draw's pass over the split it lands in


# The sampler's launch: about ``programs`` programs over all rows, ``num_warps`` each. With logits read from HBM at
# 128 rows, 4,224 x 4 warps takes 29.9 us, within 1 us of the fastest of 15 launches (8,448 x 2: 28.9 us), 55.5 us
# at 528 (gpu_engine_2026-12-04b/tune_sample_call1.json).
SAMPLE_LAUNCH = {"programs": 4224, "num_warps": 4}


def sample_splits(rows: int, vocab: int, programs: int | None = None) -> int:
    """Vocabulary splits of :func:`sample` for ``rows`` rows: about ``programs`` programs, whole tiles each."""
    tiles = -(-vocab // (4 * QUARTER))
    return max(1, min(tiles, -(-(programs or SAMPLE_LAUNCH["programs"]) // rows)))


def sample(logits, temps, greedy, seed, out, ids=None, positions=None, column=None, splits: int | None = None,
           num_warps: int | None = None):
    """Draw one token per row of ``logits`` ``[B, V]`` from ``softmax(logits / temps)`` (inverse CDF with one
    Philox uniform per row keyed by ``seed``, a one-element int64 device tensor, as ``sampling.sample_next``;
    greedy rows: the argmax) and write ``out[0]`` the token, ``out[1]`` its log-prob at the row's temperature
    (``out`` ``[2, >= B]`` float64). With ``ids``/``positions``/``column``: also feed the token back, advance
    positions and the column and step the seed (the captured decode step's bookkeeping)."""
    import torch

    b, v = logits.shape
    if b * v >= 2**31:
        raise ValueError(f"sample: {b} rows x {v} entries overflow the int32 column offsets")
    splits = splits or sample_splits(b, v)
    per_split = -(-v // (splits * 4 * QUARTER)) * 4 * QUARTER
    splits = -(-v // per_split)
    part_f = torch.empty((b, splits, 3), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((b, splits), dtype=torch.int32, device=logits.device)
    pdl = pdl_launch(logits.device)
    sample_partial_kernel[(b, splits)](logits, logits.stride(0), temps, part_f, part_i, v, per_split,
                                       QUARTER=QUARTER, num_warps=num_warps or SAMPLE_LAUNCH["num_warps"], **pdl)
    advance = ids is not None
    sample_combine_kernel[(b,)](part_f, part_i, splits, logits, logits.stride(0), temps, v, per_split, greedy, out,
                                out.stride(0), ids if advance else out, positions if advance else out,
                                column if advance else out, seed, ADVANCE=advance, BLOCK_S=max(2, _pow2(splits)),
                                BLOCK=SCAN_BLOCK, num_warps=4, **pdl)
