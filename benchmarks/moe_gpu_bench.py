"""Qwen3-MoE: embedded-engine generation against HF ``generate``, one trainer step, and the train/rollout
log-prob gap with and without routing replay, on a random-init Qwen3-MoE shape.

Parts (``--parts``; each a row of the JSON):

* ``generate``: ``--concurrency`` requests of ``--prompt-len`` random tokens, ``--new-tokens`` each (T=1,
  ignore_eos) through the in-process engine (its scheduler, no HTTP; the MoE block's grouped expert matmul
  on CUDA), after an untimed 4-token run at that concurrency; then HF ``model.generate`` on the same prompts
  as one batch (dynamic cache, sampling, exactly as many tokens). Output tokens/s and peak GPU memory.
* ``train``: ``MegatronTrainer.train_step`` on ``--train-seqs`` sequences of ``--train-len`` tokens (random
  init, megatron-core's MoE layer): step seconds (the second of two steps), tokens/s and peak memory.
* ``gap``: ``--gap-samples`` engine samples with their routed experts, then the trainer's log-probs of the
  same tokens with ``routing_replay`` off and on: max / mean |trainer - engine| and the share of (token,
  layer) routings where the trainer's free choice differs from the engine's.

    python3 benchmarks/moe_gpu_bench.py --device cuda --shape qwen3-moe-scaled --dtype bfloat16 \\
        --concurrency 128 --out benchmarks/results/moe_gpu_bench.json
    python3 benchmarks/moe_gpu_bench.py --device cpu --shape tiny --concurrency 4 --prompt-len 16 \\
        --new-tokens 8 --train-seqs 4 --train-len 32     # smoke run

Prints one JSON line per part and writes them all to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from engine_gpu_bench import engine_run, hf_generate_run, prompts_for  # noqa: E402

# Qwen3-30B-A3B's routing (128 experts, top-8, renormalised) and attention heads, fewer layers and narrower
# experts so that the engine, HF's model and a training step fit one 80 GB card: 1.9B parameters.
SHAPES = {
    "qwen3-moe-scaled": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                             head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=256,
                             intermediate_size=6144, vocab_size=151936, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=512,
                 vocab_size=1024, tie_word_embeddings=True),
}


def hf_config(shape: str, context: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(max_position_embeddings=context, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], bos_token_id=None, eos_token_id=2, pad_token_id=0, **SHAPES[shape])


def build_model_dir(shape: str, dtype: str, root: Path, context: int, device: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.models.tiny import copy_tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(shape, context), dtype=getattr(torch, dtype))
    out = copy_tokenizer(root / shape)
    model.save_pretrained(out, safe_serialization=True)
    return out


def peak_gib(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def _reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def make_engine(args, model_dir: Path):
    from agentrl.engine.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(str(model_dir), dtype=args.dtype, device=args.device,
                                 max_batch_size=max(args.concurrency), prefix_cache_tokens=0))
    engine.start()
    return engine


def part_generate(args, model_dir: Path, sync) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    rows = []
    vocab = SHAPES[args.shape]["vocab_size"]
    _reset_peak(args.device)
    engine = make_engine(args, model_dir)
    try:
        for c in args.concurrency:
            engine_run(engine, prompts_for(c, args.prompt_len, vocab, seed=10_000 + c), 4, sync)
            r = engine_run(engine, prompts_for(c, args.prompt_len, vocab, seed=c), args.new_tokens, sync)
            runner = engine.runner
            rows.append({"part": "generate", "runner": "engine", "concurrency": c, **r,
                         "peak_gib": peak_gib(args.device), "moe_layers": runner.moe_layers,
                         "cuda_graphs": runner.cuda_graphs and not runner._graph_failed,
                         "grouped_mm": _grouped_state()})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.shutdown()
        del engine
    _reset_peak(args.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    for c in args.concurrency:
        r = hf_generate_run(model, prompts_for(c, args.prompt_len, vocab, seed=c), args.new_tokens, args.device, sync,
                            mode="eager")
        rows.append({"part": "generate", "runner": "hf_generate", "concurrency": c, **r, "peak_gib": peak_gib(args.device)})
        print(json.dumps(rows[-1]), flush=True)
    engine_rows = {r["concurrency"]: r for r in rows if r["runner"] == "engine"}
    for r in rows:
        if r["runner"] == "hf_generate":
            r["engine_speedup"] = engine_rows[r["concurrency"]]["output_tokens_per_s"] / r["output_tokens_per_s"]
    del model
    return rows


def _grouped_state():
    from agentrl.engine.moe import SparseMoeBlock

    return SparseMoeBlock.grouped_mm_ok


def part_train(args, sync) -> dict:
    import random

    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    _reset_peak(args.device)
    cfg = hf_config(args.shape, args.train_len + 8)
    trainer = MegatronTrainer(None, TrainerConfig(dtype=args.dtype, lr=1e-5, max_tokens_per_microbatch=args.train_mb_tokens,
                                                  moe={"aux_loss_coeff": 1e-3}), hf_config=cfg)
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    batch = [{"tokens": [rng.randrange(3, vocab) for _ in range(args.train_len)], "response_start": 8,
              "loss_mask": [1] * (args.train_len - 8), "rollout_logprobs": [-10.0] * (args.train_len - 8),
              "reward": float(i % 2), "group_id": i // 4} for i in range(args.train_seqs)]
    times, metrics = [], {}
    for _ in range(2):
        sync()
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch)
        sync()
        times.append(time.perf_counter() - t0)
    tokens = args.train_seqs * args.train_len
    row = {"part": "train", "step_seconds": times[-1], "first_step_seconds": times[0], "tokens": tokens,
           "tokens_per_s": tokens / times[-1], "peak_gib": peak_gib(args.device),
           "moe_metrics": {k: v for k, v in metrics.items() if k.startswith("moe/")}}
    print(json.dumps(row), flush=True)
    del trainer
    return row


def sample_with_routing(engine, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Engine samples (T=1) as trainer samples carrying the engine's routed experts."""
    import threading

    from agentrl.engine.protocol import SamplingParams
    from agentrl.engine.scheduler import Sequence

    done, seqs = threading.Event(), []

    class Loop:
        def call_soon_threadsafe(self, fn) -> None:
            fn()

    def notify() -> None:
        if all(s.finish_reason is not None for s in seqs):
            done.set()

    for p in prompts:
        seq = Sequence(prompt_ids=list(p), params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                                 ignore_eos=True), routed_experts=[],
                       stream=True, loop=Loop())
        seq.notify = notify
        seqs.append(seq)
    for seq in seqs:
        engine.scheduler.submit(seq)
    if not done.wait(timeout=900):
        raise TimeoutError("sampling did not finish")
    return [{"tokens": s.prompt_ids + s.output_ids, "response_start": len(s.prompt_ids),
             "loss_mask": [1] * len(s.output_ids), "rollout_logprobs": list(s.output_logprobs),
             "routed_experts": [list(r) for r in s.routed_experts], "reward": 0.0, "group_id": i}
            for i, s in enumerate(seqs)]


def part_gap(args, model_dir: Path, sync) -> dict:
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    engine = make_engine(args, model_dir)
    try:
        vocab = SHAPES[args.shape]["vocab_size"]
        samples = sample_with_routing(engine, prompts_for(args.gap_samples, args.prompt_len, vocab, seed=5),
                                      args.new_tokens)
    finally:
        engine.shutdown()
        del engine
    trainer = MegatronTrainer(model_dir, TrainerConfig(dtype=args.dtype), temperature=1.0)
    row: dict = {"part": "gap", "samples": len(samples), "tokens": sum(len(s["loss_mask"]) for s in samples)}
    for replay in (False, True):
        trainer.moe.replay = replay
        diffs = [abs(a - b) for s, lps in zip(samples, trainer.compute_logprobs(samples), strict=True)
                 for a, b in zip(s["rollout_logprobs"], lps, strict=True)]
        key = "with_replay" if replay else "without_replay"
        row[key] = {"max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs)}
    # how often the trainer's free routing differs from the engine's: one training forward without replay
    trainer.moe.replay = False
    step = trainer.train_step([{**s, "reward": float(i % 2), "group_id": i // 2} for i, s in enumerate(samples)])
    row["routing_mismatch_free"] = step.get("moe/routing_mismatch")
    print(json.dumps(row), flush=True)
    del trainer
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-moe-scaled")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--parts", nargs="+", choices=["generate", "train", "gap"], default=["generate", "train", "gap"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[128])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--train-seqs", type=int, default=8)
    parser.add_argument("--train-len", type=int, default=1024)
    parser.add_argument("--train-mb-tokens", type=int, default=4096)
    parser.add_argument("--gap-samples", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        context = max(args.prompt_len + args.new_tokens, args.train_len) + 16
        model_dir = build_model_dir(args.shape, "float32" if args.device == "cpu" else args.dtype, Path(tmp),
                                    context, args.device)
        if "generate" in args.parts:
            rows += part_generate(args, model_dir, sync)
        if "gap" in args.parts:
            rows.append(part_gap(args, model_dir, sync))
        if "train" in args.parts:
            rows.append(part_train(args, sync))
    print(f"{'part':9} {'runner':12} {'c':>4} {'tok/s':>10} {'peak GiB':>9}")
    for r in rows:
        rate = r.get("output_tokens_per_s", r.get("tokens_per_s"))
        peak = r.get("peak_gib")
        print(f"{r['part']:9} {r.get('runner', ''):12} {r.get('concurrency', ''):>4} "
              f"{'' if rate is None else f'{rate:10.1f}'} {'' if peak is None else f'{peak:9.2f}'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
