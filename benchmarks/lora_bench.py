"""LoRA benchmark: memory per component and speed of a LoRA train step, and what one adapter sync costs.

GPU (one 80 GB card; random-init shapes, bf16)::

    python3 benchmarks/lora_bench.py --device cuda --shape qwen2-7b --dtype bfloat16 --rank 16 \\
        --seq-len 8192 --seqs-per-microbatch 1 --steps 3 --out $OUT/lora_train_7b.json
    python3 benchmarks/lora_bench.py --device cuda --shape qwen2-0.5b --dtype bfloat16 --rank 16 \\
        --sync-only --out $OUT/lora_sync_05b.json

CPU smoke (tiny shape)::

    python3 benchmarks/lora_bench.py --shape tiny --rank 8 --seq-len 64 --steps 2

``train``: peak memory after building (frozen base weights and adapters), after the first step (plus the
optimizer's fp32 main copies and Adam moments of the adapters alone), and during a step (the rest:
activations, log-prob chunks, gradients), with step time and tokens/s. ``sync``: the bytes the ``adapter``
payload writes per sync (safetensors, as the disk transport sends them) against the dense model's bytes,
and the engine side's merge (``base + B @ A`` for every adapted weight, :mod:`agentrl.engine.lora`): its
time per sync and the base copy it keeps. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
GIB = 2**30


def hf_config(shape: str, seq_len: int):
    from transformers import Qwen2Config

    return Qwen2Config(max_position_embeddings=max(seq_len, 512), rope_theta=1e6, **SHAPES[shape])


def synthetic_batch(n_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """Full-length sequences, a quarter prompt, rewards alternating 0/1 in groups of 2 (every advantage != 0)."""
    rng = random.Random(seed)
    prompt = seq_len // 4
    return [dict(tokens=[rng.randrange(3, vocab) for _ in range(seq_len)], response_start=prompt,
                 loss_mask=[1] * (seq_len - prompt), rollout_logprobs=[-1.0] * (seq_len - prompt),
                 reward=float(i % 2), group_id=i // 2) for i in range(n_seqs)]


def allocated_gib(device: str) -> float:
    import torch

    return torch.cuda.memory_allocated() / GIB if device == "cuda" else float("nan")


def peak_gib(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan")


def build_trainer(args, cfg):
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    extra = {"recompute": args.recompute} if args.recompute else {}
    return MegatronTrainer(None, TrainerConfig(
        dtype=args.dtype, attention="sdpa", lr=1e-4, max_tokens_per_microbatch=args.seq_len * args.seqs_per_microbatch,
        lora={"rank": args.rank, "alpha": 2.0 * args.rank}, loss={"kl_coef": 0.0}, **extra,
    ), hf_config=cfg)


def param_gib(trainer, trainable: bool) -> float:
    return sum(p.numel() * p.element_size() for p in trainer.gpt.parameters() if p.requires_grad == trainable) / GIB


def bench_train(args) -> dict:
    import torch

    cfg = hf_config(args.shape, args.seq_len)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(args, cfg)
    row = {"shape": args.shape, "dtype": args.dtype, "rank": args.rank, "seq_len": args.seq_len,
           "tokens_per_microbatch": args.seq_len * args.seqs_per_microbatch, "recompute": args.recompute or "none",
           "base_weights_gib": param_gib(trainer, False), "adapter_weights_gib": param_gib(trainer, True),
           "allocated_after_build_gib": allocated_gib(args.device)}
    n_seqs = args.seqs_per_microbatch * args.microbatches
    times = []
    for step in range(args.steps):
        batch = synthetic_batch(n_seqs, args.seq_len, cfg.vocab_size, seed=step)
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step == 0:  # the optimizer's state exists from the first step on
            row["allocated_after_step_gib"] = allocated_gib(args.device)
    row["optimizer_state_gib"] = row["allocated_after_step_gib"] - row["allocated_after_build_gib"]
    row["peak_gib"] = peak_gib(args.device)
    row["step_peak_over_steady_gib"] = row["peak_gib"] - row["allocated_after_step_gib"]
    best = min(times[1:] or times)
    row.update(step_s=best, tokens_per_s=n_seqs * args.seq_len / best, loss=metrics.get("loss"),
               fits_80gb=row["peak_gib"] < 80 * 1e9 / GIB if args.device == "cuda" else None)
    return row


def bench_sync(args) -> dict:
    import torch

    from agentrl.engine.lora import AdapterMerger
    from agentrl.trainer.lora import dense_bytes
    from agentrl.weights.adapter_sync import adapter_named_tensors
    from agentrl.weights.transports.disk import save_safetensors

    cfg = hf_config(args.shape, args.seq_len)
    trainer = build_trainer(args, cfg)
    with torch.no_grad():  # nonzero B, as after training (B starts at 0)
        for p in trainer.gpt.parameters():
            if p.requires_grad:
                p.normal_(0, 0.01)
    named = list(adapter_named_tensors(trainer.export_adapter_tensors(), trainer.config.lora.scale))
    with tempfile.TemporaryDirectory() as tmp:
        sent = save_safetensors(named, Path(tmp) / "v1")
    dense = dense_bytes(cfg, trainer.dtype)
    weights = dict(trainer.export_hf_named_tensors())  # the engine's dense weights (HF names)
    merger = AdapterMerger()
    adapters = dict(named)
    times = []
    for _ in range(3):
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        merged = merger.merge(weights, adapters, "v")
        merger.merged_version = "v"
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    base_copy = sum(t.numel() * t.element_size() for t in merger.base.values())
    return {"shape": args.shape, "dtype": args.dtype, "rank": args.rank, "bytes_sent": sent, "full_bytes": dense,
            "ratio": sent / dense, "adapter_tensors": len(named), "merged_weights": len(merged),
            "merge_s": min(times[1:]), "first_merge_s": times[0], "engine_base_copy_gib": base_copy / GIB}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seqs-per-microbatch", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recompute", default=None, help="trainer.recompute (default: the trainer's)")
    parser.add_argument("--sync-only", action="store_true", help="only the sync measurement")
    parser.add_argument("--train-only", action="store_true", help="only the train measurement")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device")
    else:
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    result: dict = {"argv": sys.argv[1:] if argv is None else argv}
    if not args.sync_only:
        try:
            result["train"] = bench_train(args)
        except RuntimeError as err:  # torch.cuda.OutOfMemoryError is one: the answer is then "does not fit"
            result["train"] = {"shape": args.shape, "error": str(err).splitlines()[0][:300],
                               "peak_gib": peak_gib(args.device), "fits_80gb": False}
    if not args.train_only:
        result["sync"] = bench_sync(args)
    for part, row in result.items():
        if isinstance(row, dict):
            print(f"{part:>6}: " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
