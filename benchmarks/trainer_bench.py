"""Megatron trainer throughput: tokens/s, MFU and peak memory of ``MegatronTrainer.train_step``.

CPU (runs anywhere, tiny shape)::

    python3 benchmarks/trainer_bench.py --shape tiny --steps 5 --threads 1

GPU (one H200; random-init Qwen2 shapes in bf16, 8k tokens per micro-batch, local vs SDPA attention)::

    python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --dtype bfloat16 \\
        --seq-len 2048 --seqs-per-microbatch 4 --attention sdpa local

A train step = one no-grad forward (behaviour log-probs) + forward/backward + Adam, as in GRPO.
MFU counts the model FLOPs of all three passes (4 x forward) against ``--peak-tflops`` (H200 dense bf16:
989). Prints a table and writes ``benchmarks/results/trainer_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
import warnings
from pathlib import Path

SHAPES = {
    # the tiny test model (agentrl.models.tiny)
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def hf_config(shape: str, seq_len: int):
    from transformers import Qwen2Config

    return Qwen2Config(max_position_embeddings=max(seq_len, 512), rope_theta=1e6, **SHAPES[shape])


def forward_flops_per_token(cfg, seq_len: int) -> float:
    """Matmul FLOPs of one forward per token: linears, causal attention (s/2 average keys), LM head."""
    h, L, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = h // heads
    qkv = h * (heads + 2 * kv) * d
    proj = heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    attn = 2 * 2 * heads * d * (seq_len / 2)  # QK^T and AV
    return L * (2 * (qkv + proj + mlp) + attn) + 2 * h * v


def synthetic_batch(n_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prompt = seq_len // 4
    return [
        dict(tokens=[rng.randrange(3, vocab) for _ in range(seq_len)], response_start=prompt,
             loss_mask=[1] * (seq_len - prompt), rollout_logprobs=[-1.0] * (seq_len - prompt),
             reward=float(i % 2), group_id=i // 4)
        for i in range(n_seqs)
    ]


def peak_memory_gib(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)


def run_one(args, attention: str) -> dict:
    import torch

    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    cfg = hf_config(args.shape, args.seq_len)
    n_mb = args.microbatches
    tokens_per_mb = args.seq_len * args.seqs_per_microbatch
    trainer = MegatronTrainer(None, TrainerConfig(
        dtype=args.dtype, attention=attention, lr=1e-6, max_tokens_per_microbatch=tokens_per_mb,
        recompute=args.recompute, use_distributed_optimizer=False, tp_size=args.tp_size,
    ), hf_config=cfg)
    batch = synthetic_batch(args.seqs_per_microbatch * n_mb, args.seq_len, cfg.vocab_size)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train_step(batch)  # warm-up (allocator, kernels)
    times = []
    for _ in range(args.steps):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_step(batch)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    tokens = len(batch) * args.seq_len  # the global batch: every rank receives it, DP ranks split it
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    flops = 4 * forward_flops_per_token(cfg, args.seq_len) * tokens / world  # per GPU, for MFU
    result = dict(
        shape=args.shape, device=args.device, dtype=args.dtype, attention=attention, seq_len=args.seq_len,
        world_size=world, tp_size=args.tp_size,
        tokens_per_microbatch=tokens_per_mb, microbatches=n_mb, recompute=args.recompute,
        params_m=sum(p.numel() for p in trainer.gpt.parameters()) / 1e6,
        step_s=step_s, tokens_per_s=tokens / step_s, achieved_tflops=flops / step_s / 1e12,
        mfu=(flops / step_s / 1e12 / args.peak_tflops) if args.peak_tflops else None,
        peak_mem_gib=peak_memory_gib(args.device),
    )
    del trainer
    import gc

    gc.collect()  # drop the optimizer / DDP buffers before the next attention variant allocates its own
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 128 on cpu, 2048 on cuda")
    parser.add_argument("--seqs-per-microbatch", type=int, default=None, help="default: 4")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--attention", nargs="+", default=["sdpa", "local"], choices=["sdpa", "local", "te"])
    parser.add_argument("--recompute", action="store_true", help="full activation recomputation")
    parser.add_argument("--peak-tflops", type=float, default=None, help="for MFU; default 989 on cuda (H200)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a shared 2-core box, 1 avoids oversubscription: 16x faster)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor parallel size; run under torchrun (data parallel gets the other ranks)")
    parser.add_argument("--out", default="benchmarks/results/trainer_bench.json")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.seq_len = args.seq_len or (2048 if args.device == "cuda" else 128)
    args.seqs_per_microbatch = args.seqs_per_microbatch or 4
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = 989.0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("trainer_bench: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
    warnings.filterwarnings("ignore")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    rows = []
    for attention in args.attention:
        try:
            rows.append(run_one(args, attention))
        except Exception as exc:  # e.g. OOM for the local spec at long sequences: report, keep going
            rows.append(dict(shape=args.shape, attention=attention, error=f"{type(exc).__name__}: {exc}"[:300]))
    import os

    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if all("error" not in r for r in rows) else 1
    header = f"{'shape':<11} {'attn':<6} {'dtype':<9} {'tok/mb':>7} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}"
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<11} {r['attention']:<6} ERROR {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{r['shape']:<11} {r['attention']:<6} {r['dtype']:<9} {r['tokens_per_microbatch']:>7} "
              f"{r['tokens_per_s']:>10.0f} {r['achieved_tflops']:>8.3f} {mfu:>6} {r['peak_mem_gib']:>9.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
