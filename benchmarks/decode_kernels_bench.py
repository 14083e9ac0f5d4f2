"""The fused decoder's kernels at decode shapes on CUDA (Qwen2-0.5B by default), each against what it replaces:
decode attention over each row's span by splits / tile / warps (the tuning of ``decode_attention``), the
in-kernel sampler (inverse CDF) against the compiled Gumbel-max one (``fused_ops``) with its ``[rows, vocab]`` uniforms,
add + RMSNorm, rotary + KV write, SiLU gate, and the layer's GEMMs joined (q/k/v, gate/up) and apart.
Each timed as 20 calls captured in a CUDA graph (no launch overhead, as in the engine's captured step), median
of ``triton.testing.do_bench`` over replays; prints a table and writes JSON.

    python3 benchmarks/decode_kernels_bench.py --rows 1 32 128 256 --out /tmp/decode_kernels.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from trainer_bench import SHAPES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 32, 128, 256])
    p.add_argument("--span", type=int, default=640, help="tokens each row attends to (prompt 512 + half of 256)")
    p.add_argument("--columns", type=int, default=1024, help="static KV buffer columns")
    p.add_argument("--tune", action="store_true",
                   help="only the tuning sweeps: the attention as the engine calls it (rotary inside) by splits / tile / "
                        "warps / pipeline stages, and the sampler by splits and warps")
    p.add_argument("--tune-kinds", nargs="+", default=["attention", "sample"], choices=["attention", "sample"],
                   help="which launches --tune sweeps")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch
    from triton.testing import do_bench

    from agentrl.engine import decoder_kernels as dk
    from agentrl.engine.decode_attention import decode_attention
    from agentrl.engine.fused_ops import kernels as compiled

    shape = SHAPES[args.shape]
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = hidden // heads
    dt, dev = torch.bfloat16, "cuda"
    g = torch.Generator(dev).manual_seed(0)

    def rnd(*s, dtype=dt):
        return torch.randn(s, device=dev, dtype=dtype, generator=g)

    def us(fn, calls: int = 20) -> float:
        """Microseconds per call inside a CUDA graph of ``calls`` calls (as in the captured decode step: no
        launch overhead), median of 20 replays."""
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return 1e3 * do_bench(graph.replay, warmup=5, rep=40, return_mode="median") / calls

    rows_out = []

    def record(kind: str, rows: int, variant: str, t: float, **extra) -> None:
        rows_out.append({"kind": kind, "rows": rows, "variant": variant, "us": t, **extra})
        print(f"{kind:<10} {rows:>5} {variant:<34} {t:>9.1f} us", flush=True)

    k_all = rnd(max(args.rows), kv_heads, args.columns, dim)
    v_all = rnd(max(args.rows), kv_heads, args.columns, dim)
    column = torch.tensor([args.span], device=dev)
    def bench(b: int) -> None:
        q = rnd(b, kv_heads, heads // kv_heads, dim)
        k, v = k_all[:b], v_all[:b]
        positions = torch.full((b,), args.span, device=dev)
        mask = torch.zeros((b, args.columns), device=dev, dtype=dt)
        mask[:, args.span + 1 :] = torch.finfo(dt).min
        record("attention", b, "mask+limit (before)", us(lambda q=q, k=k, v=v, m=mask: decode_attention(q, k, v, m, 0.125, column)))
        qkv = rnd(b, (heads + 2 * kv_heads) * dim)
        cos, sin = rnd(args.columns, dim), rnd(args.columns, dim)
        qd, kd = heads * dim, kv_heads * dim
        record("attention", b, "rope_scatter + span (default splits)", us(lambda: decode_attention(
            dk.rope_scatter(qkv, positions, cos, sin, heads, kv_heads, dim, k_all, v_all, column=column).view(
                b, kv_heads, heads // kv_heads, dim), k, v, None, 0.125, column, positions=positions)))
        for splits in (None, 1, 2, 4):
            record("attention", b, f"rope inside, splits={splits}", us(lambda s=splits: decode_attention(
                qkv[:, :qd].view(b, kv_heads, heads // kv_heads, dim), k, v, None, 0.125, column, positions=positions,
                splits=s, rope=(cos, sin, qd, qd + kd))), splits=splits)
        for splits in (None, 1, 2, 4, 8):
            for block_n in (32, 64, 128):
                for warps in (4, 8) if block_n == 128 else (4,):
                    t = us(lambda q=q, k=k, v=v, p=positions, s=splits, bn=block_n, w=warps: decode_attention(
                        q, k, v, None, 0.125, column, positions=p, splits=s, block_n=bn, num_warps=w))
                    record("attention", b, f"span splits={splits} block={block_n} warps={warps}", t, splits=splits,
                           block_n=block_n, warps=warps)
        bytes_read = 2 * b * kv_heads * (args.span + 1) * dim * 2
        record("attention", b, "KV bytes / 4.3 TB/s (floor)", bytes_read / 4.3e6)
        logits = rnd(b, vocab)
        temps, greedy = torch.ones(b, device=dev), torch.zeros(b, dtype=torch.bool, device=dev)
        seed = torch.tensor([1], device=dev)
        out = torch.zeros((2, b), dtype=torch.float64, device=dev)
        sampler = compiled()["sample"]
        record("sample", b, "compiled + torch.rand (before)",
               us(lambda lg=logits, t_=temps, gr=greedy: sampler(lg, t_, gr, torch.rand(lg.shape, device=dev))))
        for splits in (None, 132, 264, 1056):
            s_ = None if splits is None else max(1, splits // b) if b > 1 else splits
            record("sample", b, f"triton splits={s_}", us(lambda lg=logits, s=s_: dk.sample(lg, temps, greedy, seed, out, splits=s)))
        x, r = rnd(b, hidden), rnd(b, hidden)
        w = rnd(hidden)
        norm = compiled()["rms_norm"]
        record("norm", b, "add + compiled rms_norm (before)", us(lambda: norm(x + r, w, 1e-6)))
        record("norm", b, "add_rms_norm", us(lambda: dk.add_rms_norm(x, r, w, 1e-6)))
        record("rope", b, "rope_scatter", us(lambda: dk.rope_scatter(qkv, positions, cos, sin, heads, kv_heads, dim,
                                                                      k_all, v_all, column=column)))
        gu = rnd(b, 2 * inter)
        silu = compiled()["silu_mul"]
        record("silu", b, "compiled silu_mul (before)", us(lambda: silu(gu[:, :inter].reshape(-1), gu[:, inter:].reshape(-1))))
        record("silu", b, "silu_mul", us(lambda: dk.silu_mul(gu)))
        h = rnd(b, hidden)
        wq, wk, wv, wo = rnd(heads * dim, hidden), rnd(kv_heads * dim, hidden), rnd(kv_heads * dim, hidden), rnd(hidden, heads * dim)
        bq, bk, bv = rnd(heads * dim), rnd(kv_heads * dim), rnd(kv_heads * dim)
        wqkv, bqkv = torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv])
        wg, wu, wd = rnd(inter, hidden), rnd(inter, hidden), rnd(hidden, inter)
        wgu = torch.cat([wg, wu])
        lin = torch.nn.functional.linear
        act = rnd(b, inter)
        record("gemm", b, "q, k, v apart (before)", us(lambda: (lin(h, wq, bq), lin(h, wk, bk), lin(h, wv, bv))))
        record("gemm", b, "qkv joined", us(lambda: lin(h, wqkv, bqkv)))
        record("gemm", b, "gate, up apart (before)", us(lambda: (lin(h, wg), lin(h, wu))))
        record("gemm", b, "gate_up joined", us(lambda: lin(h, wgu)))
        record("gemm", b, "o", us(lambda: lin(act[:, : heads * dim], wo)))
        record("gemm", b, "down", us(lambda: lin(act, wd)))
        lm = rnd(vocab, hidden)
        record("gemm", b, "lm_head", us(lambda: lin(h, lm)))
    def tune(b: int, copies: int = 4) -> None:
        """As in the engine, each call reads its operands from HBM: the graph's calls cycle through ``copies``
        sets of K/V and logits (each about the H200's 50 MB L2 or more), where calls on one set would find it
        in L2 (the first sweep, 2026-12-03: 12-13 us here against 18.7 us for the same kernel in the engine)."""
        positions = torch.full((b,), args.span, device=dev)
        qkv = rnd(b, (heads + 2 * kv_heads) * dim)
        cos, sin = rnd(args.columns, dim), rnd(args.columns, dim)
        qd, kd = heads * dim, kv_heads * dim
        kv = [(rnd(b, kv_heads, args.columns, dim), rnd(b, kv_heads, args.columns, dim)) for _ in range(copies)]
        turn = itertools.count()
        for splits in (1, 2) if "attention" in args.tune_kinds else ():
            for block_n in (32, 64, 128):
                for warps in (2, 4, 8):
                    for stages in (None, 2, 3, 4):
                        try:
                            t = us(lambda s=splits, bn=block_n, w=warps, st=stages: decode_attention(
                                qkv[:, :qd].view(b, kv_heads, heads // kv_heads, dim), *kv[next(turn) % copies],
                                None, 0.125, column,
                                positions=positions, splits=s, block_n=bn, num_warps=w, num_stages=st,
                                rope=(cos, sin, qd, qd + kd)))
                        except Exception as exc:  # a tile that does not fit (shared memory): skip it
                            print(f"attention {b} splits={splits} block={block_n} warps={warps} stages={stages}: {exc!r:.80}")
                            continue
                        record("attention", b, f"rope splits={splits} block={block_n} warps={warps} stages={stages}", t,
                               splits=splits, block_n=block_n, warps=warps, stages=stages)
        record("attention", b, "KV bytes / 4.3 TB/s (floor)", 2 * b * kv_heads * (args.span + 1) * dim * 2 / 4.3e6)
        if "sample" not in args.tune_kinds:
            return
        record("sample", b, "logits bytes / 4.3 TB/s (floor)", b * vocab * 2 / 4.3e6)
        logits = [rnd(b, vocab) for _ in range(copies)]
        temps, greedy = torch.ones(b, device=dev), torch.zeros(b, dtype=torch.bool, device=dev)
        seed = torch.tensor([1], device=dev)
        out = torch.zeros((2, b), dtype=torch.float64, device=dev)
        for programs in (528, 1056, 2112, 4224, 8448):
            for warps in (2, 4, 8):
                s_ = dk.sample_splits(b, vocab, programs)
                record("sample", b, f"programs={programs} splits={s_} warps={warps}",
                       us(lambda s=s_, w=warps: dk.sample(logits[next(turn) % copies], temps, greedy, seed, out, splits=s,
                                                     num_warps=w)),
                       programs=programs, splits=s_, warps=warps)

    for b in args.rows:
        tune(b) if args.tune else bench(b)
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "span": args.span, "columns": args.columns,
                                              "device": torch.cuda.get_device_name(), "rows": rows_out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
