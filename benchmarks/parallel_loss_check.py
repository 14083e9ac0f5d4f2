"""Loss parity of Megatron parallel layouts on GPUs: the same HF checkpoint, the same batch, K GRPO steps.

Build a random checkpoint once, then run each layout under ``torch.distributed.run`` (NCCL) and compare
the JSON files: step loss, entropy and grad norm of TP=2 and DP=2 should equal TP=1 within bf16 tolerance::

    python3 benchmarks/parallel_loss_check.py build --shape qwen2-1.5b --model-dir /tmp/m
    python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/parallel_loss_check.py run \\
        --model-dir /tmp/m --tp-size 1 --out tp1.json
    python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/parallel_loss_check.py run \\
        --model-dir /tmp/m --tp-size 2 --out tp2.json        # --tp-size 1 with 2 processes: DP=2
    python3 benchmarks/parallel_loss_check.py compare tp1.json tp2.json dp2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from trainer_bench import SHAPES, synthetic_batch  # noqa: E402


def build(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from agentrl.models.tiny import copy_tokenizer

    torch.manual_seed(args.seed)
    config = Qwen2Config(max_position_embeddings=4096, rope_theta=1e6, **SHAPES[args.shape])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(copy_tokenizer(args.model_dir), safe_serialization=True)


def run(args) -> None:
    import torch
    import torch.distributed as dist

    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    trainer = MegatronTrainer(args.model_dir, TrainerConfig(
        tp_size=args.tp_size, dtype="bfloat16", attention="sdpa", lr=args.lr,
        max_tokens_per_microbatch=args.seq_len * args.seqs_per_microbatch))
    vocab = trainer.shape.vocab_size
    steps = []
    for k in range(args.steps):
        batch = synthetic_batch(args.seqs, args.seq_len, vocab, seed=k)
        metrics = trainer.train_step(batch)
        steps.append({key: metrics[key] for key in ("loss", "grad_norm", "kl", "entropy") if key in metrics})
    if dist.get_rank() == 0:
        result = {"world_size": dist.get_world_size(), "tp_size": args.tp_size,
                  "dp_size": dist.get_world_size() // args.tp_size, "steps": steps,
                  "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result))


def compare(args) -> int:
    runs = [json.loads(Path(p).read_text()) for p in args.files]
    base = runs[0]
    table = []
    worst = {"loss_abs": 0.0, "entropy_rel": 0.0, "grad_norm_rel": 0.0}
    for r in runs[1:]:
        for k, (a, b) in enumerate(zip(base["steps"], r["steps"], strict=True)):
            # On-policy GRPO loss is a mean of advantages (near 0): compare it absolutely, the rest relatively.
            diff = {"loss_abs": abs(a["loss"] - b["loss"]),
                    "entropy_rel": abs(a["entropy"] - b["entropy"]) / abs(a["entropy"]),
                    "grad_norm_rel": abs(a["grad_norm"] - b["grad_norm"]) / abs(a["grad_norm"])}
            worst = {key: max(worst[key], diff[key]) for key in worst}
            table.append({"layout": f"TP={r['tp_size']} DP={r['dp_size']}", "step": k + 1,
                          **{f"{key}_tp1": a[key] for key in ("loss", "entropy", "grad_norm")},
                          **{key: b[key] for key in ("loss", "entropy", "grad_norm")}, **diff})
    for row in table:
        print(json.dumps(row))
    verdict = {**{f"max_{k}": v for k, v in worst.items()},
               "within_bf16_tolerance": max(worst.values()) < args.tolerance, "tolerance": args.tolerance}
    print(json.dumps(verdict))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": table, **verdict, "runs": runs}, indent=2))
    return 0 if verdict["within_bf16_tolerance"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-1.5b")
    b.add_argument("--model-dir", required=True)
    b.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("--model-dir", required=True)
    r.add_argument("--tp-size", type=int, default=1)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--seqs", type=int, default=16)
    r.add_argument("--seq-len", type=int, default=1024)
    r.add_argument("--seqs-per-microbatch", type=int, default=4)
    r.add_argument("--lr", type=float, default=1e-5)
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("files", nargs="+", help="the TP=1 run first")
    c.add_argument("--tolerance", type=float, default=2e-2, help="max difference (loss absolute, entropy and grad norm relative)")
    c.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.cmd == "build":
        build(args)
    elif args.cmd == "run":
        run(args)
    else:
        return compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
