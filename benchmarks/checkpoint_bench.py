"""Checkpoint save time: the shard files written by threads of the trainer's process (what
``agentrl.trainer.checkpoint`` does) against Megatron's own writer, which forks a process per shard file.

    python3 benchmarks/checkpoint_bench.py [--hidden 1024] [--layers 8] [--repeats 3]

A Qwen2-shaped model (fp32, Adam after one step, so the optimizer state is saved too) on the CPU, one rank.
Prints a table (seconds per save, GB written, GB/s) and writes benchmarks/results/checkpoint_bench.json.
The machine's load average is recorded: on 2 shared cores it moves these numbers more than any change.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
warnings.filterwarnings("ignore")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/checkpoint_bench.json"))
    args = ap.parse_args()

    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from trainer_bench import synthetic_batch
    from transformers import Qwen2Config

    from agentrl.trainer import checkpoint
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 512), max_position_embeddings=512,
                      tie_word_embeddings=True)
    trainer = MegatronTrainer(None, TrainerConfig(lr=1e-4, lr_warmup_steps=0), hf_config=cfg)
    trainer.train_step(synthetic_batch(8, 64, args.vocab))
    params = sum(p.numel() for p in trainer.gpt.parameters())
    writers = {"threads": checkpoint.threaded_save_strategy, "processes": get_default_save_sharded_strategy}
    root = Path(args.dir or tempfile.mkdtemp(prefix="agentrl-ckpt-bench-"))
    load_start = os.getloadavg()[0]
    rows = []
    try:
        for name, strategy in writers.items():
            checkpoint.threaded_save_strategy = strategy  # what save_checkpoint calls for its strategy
            seconds, size = [], 0
            for i in range(args.repeats + 1):  # the first save (one-time set-up) is not counted
                t0 = time.perf_counter()
                path = trainer.save_checkpoint(root / f"{name}-{i}", {"repeat": i})
                if i:
                    seconds.append(time.perf_counter() - t0)
                size = dir_bytes(path)
                shutil.rmtree(path)
            s = statistics.median(seconds)
            rows.append(dict(writer=name, seconds=s, seconds_all=seconds, gb=size / 1e9, gb_per_s=size / 1e9 / s))
    finally:
        checkpoint.threaded_save_strategy = writers["threads"]
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"cpus={os.cpu_count()}  load avg {load_start:.1f} -> {os.getloadavg()[0]:.1f}  params {params / 1e6:.0f} M")
    print(f"{'writer':>10} {'s/save':>8} {'GB':>6} {'GB/s':>6}")
    for r in rows:
        print(f"{r['writer']:>10} {r['seconds']:8.2f} {r['gb']:6.2f} {r['gb_per_s']:6.2f}")
    Path(args.out).write_text(json.dumps(dict(cpus=os.cpu_count(), loadavg_start=load_start,
                                              loadavg_end=os.getloadavg()[0], params=params, hidden=args.hidden,
                                              layers=args.layers, vocab=args.vocab, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
