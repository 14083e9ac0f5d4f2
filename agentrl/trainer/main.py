"""``agentrl train``: GRPO end to end — rollout through engines behind smg, Megatron steps, weight sync.

Sync vs async training differs only in *where the loop waits* for the next rollout batch (as in slime):
``sync`` asks for batch t+1 after the weights of step t reached the engines; ``async`` (one step off)
asks for it before training on batch t, and waits for it to finish before syncing, so every batch is
sampled by exactly one weight version and is at most one step stale.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.envs import load_function
from agentrl.rollout.buffer import DataBuffer
from agentrl.trainer.run_config import RunConfig, load_config
from agentrl.trainer.run_setup import MetricsLog, base_model_dir, plot_curves, warm_model_dir


def train(cfg: RunConfig, *, resume: bool = False) -> Path:
    """Run ``cfg``; returns the output directory (metrics.jsonl, reward_curve.png, checkpoints/)."""
    import ray
    from tqdm import tqdm

    from agentrl.trainer.ray_actors import RolloutWorker, remote, start_trainer_group

    if cfg.colocate and cfg.loop == "async":
        raise ValueError("colocate releases the engines during training; it needs loop='sync'")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    checkpoints = out / "checkpoints"
    resume = resume and (checkpoints / "latest").exists()
    log = MetricsLog(out / "metrics.jsonl", append=resume)
    make_tasks = load_function(cfg.tasks)
    heldout = make_tasks(cfg.eval.num_tasks, seed=cfg.seed, split="heldout", **cfg.task_kwargs)
    settings = {**cfg.rollout.model_dump(exclude={"prompts_per_step", "samples_per_prompt"}), "dtype": cfg.model.dtype}

    ray.init(num_cpus=max(4, cfg.trainer_ranks + 1), include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    base = base_model_dir(cfg)
    rollout = remote(RolloutWorker, num_cpus=0).remote(str(base), cfg.env, settings)
    try:
        model_dir = warm_model_dir(cfg, base, rollout, heldout, None if resume else log)
        trainers = start_trainer_group(model_dir, cfg.trainer, cfg.trainer_ranks)
        urls = ray.get(rollout.engine_urls.remote())
        buffer = DataBuffer(load_function(cfg.group_filter))
        start = 0
        if resume:
            ckpt = checkpoints / (checkpoints / "latest").read_text().strip()
            extra = ray.get([t.load_checkpoint.remote(str(ckpt)) for t in trainers])[0]
            start = extra["step"]
            buffer.load_state_dict(extra["buffer"])

        def sync(version: int) -> dict[str, Any]:
            return ray.get([t.sync_weights.remote(cfg.sync_mode, urls, str(version), cfg.sync_options) for t in trainers])[0]

        def submit(step: int) -> Any:
            tasks = make_tasks(cfg.rollout.prompts_per_step, seed=cfg.seed * 1_000_003 + step, split="train",
                               **cfg.task_kwargs)
            return rollout.rollout.remote(tasks, cfg.rollout.samples_per_prompt)

        sync(start)  # engines serve exactly the trainer's weights before the first sample
        if not resume:
            log.write({"step": 0, "model_dir": str(model_dir), **ray.get(rollout.evaluate.remote(heldout))})
            # a crash in the first step resumes from here, not from a new warm-up and evaluation
            state = {"step": 0, "buffer": buffer.state_dict()}
            ray.get([t.save_checkpoint.remote(str(checkpoints / "step-0"), state) for t in trainers])
            mark_latest(checkpoints, "step-0")
        deadline = time.monotonic() + cfg.max_minutes * 60
        pending = submit(start) if start < cfg.steps else None
        for step in tqdm(range(start, cfg.steps), desc="GRPO", initial=start, total=cfg.steps):
            batch = ray.get(pending)
            pending = submit(step + 1) if cfg.loop == "async" and step + 1 < cfg.steps else None
            buffer.add_groups(batch.groups)
            samples = buffer.take()
            if cfg.colocate:
                ray.get(rollout.release_memory.remote())
            t0 = time.perf_counter()
            train_metrics = ray.get([t.train.remote(samples) for t in trainers])[0]
            train_seconds = time.perf_counter() - t0
            if cfg.colocate:
                ray.get(rollout.resume_memory.remote())
            if pending is not None:
                ray.wait([pending])  # the in-flight batch finishes on the weights it started with
            report = sync(step + 1)
            row = {"step": step + 1, **batch.metrics, **{f"train/{k}": v for k, v in train_metrics.items()},
                   "train/seconds": train_seconds, "train/groups_dropped": buffer.groups_dropped,
                   "sync/seconds": report["seconds"], "sync/bytes_sent": report["bytes_sent"],
                   "sync/full_bytes": report["full_bytes"]}
            out_of_time = time.monotonic() > deadline
            last = step + 1 == cfg.steps or out_of_time
            if (step + 1) % cfg.eval.every == 0 or last:
                row.update(ray.get(rollout.evaluate.remote(heldout)))
                state = {"step": step + 1, "buffer": buffer.state_dict()}
                ray.get([t.save_checkpoint.remote(str(checkpoints / f"step-{step + 1}"), state) for t in trainers])
                mark_latest(checkpoints, f"step-{step + 1}")
            log.write(row)
            if last:
                break
            if pending is None:
                pending = submit(step + 1)
    finally:
        ray.get(rollout.shutdown.remote())
        ray.shutdown()
    plot_curves(out / "metrics.jsonl", out / "reward_curve.png")
    return out


def train_from_samples(cfg: RunConfig, samples_path: str | Path) -> Path:
    """Train-only debugging: GRPO steps on saved Samples (``agentrl rollout --output``), no engines.

    Groups are taken ``rollout.prompts_per_step`` at a time, for at most ``steps`` steps.
    """
    import ray

    from agentrl.rollout.buffer import load_samples_jsonl
    from agentrl.trainer.ray_actors import start_trainer_group

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out / "metrics.jsonl")
    groups: dict[str, list] = {}
    for sample in load_samples_jsonl(samples_path):
        groups.setdefault(str(sample.group_id), []).append(sample)
    buffer = DataBuffer(load_function(cfg.group_filter))
    buffer.add_groups(groups.values())
    ray.init(num_cpus=max(4, cfg.trainer_ranks + 1), include_dashboard=False)
    try:
        trainers = start_trainer_group(base_model_dir(cfg), cfg.trainer, cfg.trainer_ranks)
        step = 0
        while len(buffer) and step < cfg.steps:
            batch = buffer.take(cfg.rollout.prompts_per_step)
            metrics = ray.get([t.train.remote(batch) for t in trainers])[0]
            step += 1
            log.write({"step": step, "train/groups_dropped": buffer.groups_dropped,
                       **{f"train/{k}": v for k, v in metrics.items()}})
    finally:
        ray.shutdown()
    return out


def mark_latest(checkpoints: Path, name: str, keep: int = 2) -> None:
    """Point ``checkpoints/latest`` at ``name`` atomically (a crash mid-save leaves the old pointer), then
    delete all but the newest ``keep`` checkpoints."""
    import shutil

    tmp = checkpoints / "latest.tmp"
    tmp.write_text(name)
    tmp.replace(checkpoints / "latest")
    steps = sorted((p for p in checkpoints.glob("step-*") if p.is_dir()), key=lambda p: int(p.name[5:]))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentrl train", description=__doc__,
        epilog="Any config field can be overridden as --section.field VALUE (e.g. --rollout.num_engines 1).")
    parser.add_argument("--output-dir", help="where metrics.jsonl, reward_curve.png and checkpoints go")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint OUTPUT_DIR/checkpoints/latest names")
    parser.add_argument("--train-only", metavar="SAMPLES_JSONL",
                        help="debug mode: train on saved Samples (from `agentrl rollout`), no engines")
    argv = list(sys.argv[1:] if argv is None else argv)
    # The optional YAML path comes first; everything after the known flags is a config override.
    config = argv.pop(0) if argv and not argv[0].startswith("-") else None
    parser.usage = "agentrl train [CONFIG.yaml] [--output-dir DIR] [--resume] [--section.field VALUE ...]"
    args, rest = parser.parse_known_args(argv)
    if args.output_dir:
        rest += ["--output_dir", args.output_dir]
    cfg = load_config(config, rest)
    if args.train_only:
        out = train_from_samples(cfg, args.train_only)
        print(json.dumps({"output_dir": str(out), "steps": sum(1 for _ in (out / "metrics.jsonl").open())}))
        return 0
    out = train(cfg, resume=args.resume)
    last_eval = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                 if "step" in r and "eval_accuracy" in r]  # warm-up rows carry warmup_step instead
    print(json.dumps({"output_dir": str(out), "first_eval": last_eval[0]["eval_accuracy"],
                      "last_eval": last_eval[-1]["eval_accuracy"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
