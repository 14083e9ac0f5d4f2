"""What a run needs around the loop: the (cached) tiny base model, the (cached) supervised warm-up,
the metrics log and the reward-curve plot."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from agentrl.trainer.run_config import RunConfig


class MetricsLog:
    """Append-only JSONL of metric rows, each stamped with wall time since the log was opened."""

    def __init__(self, path: Path, append: bool = False) -> None:
        self.path = path
        self.started = time.monotonic()
        if not append:
            path.write_text("")

    def write(self, row: dict[str, Any]) -> None:
        row = {**row, "elapsed_s": round(time.monotonic() - self.started, 2)}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                 if k in ("step", "warmup_step", "warmup_check_accuracy", "eval_accuracy", "rollout/reward_mean", "train/kl", "sync/seconds")}
        print(json.dumps(shown), flush=True)


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def base_model_dir(cfg: RunConfig) -> Path:
    """``cfg.model.path`` if given, else the tiny model for this seed, built once into the cache."""
    if cfg.model.path:
        return Path(cfg.model.path)
    from agentrl.models.tiny import TOKENIZER_DIR, make_tiny_model

    tokenizer_files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(TOKENIZER_DIR.iterdir())}
    out = Path(cfg.cache_dir) / f"tiny-{_key(cfg.model.seed, cfg.model.max_position_embeddings, tokenizer_files)}"
    if not (out / "model.safetensors").exists():
        make_tiny_model(out, seed=cfg.model.seed, max_position_embeddings=cfg.model.max_position_embeddings)
    return out


def warm_model_dir(cfg: RunConfig, base: Path, rollout: Any, heldout: list[Any], log: MetricsLog | None) -> Path:
    """Supervised warm-up of ``base`` on expert chats, evaluated through the rollout engines; cached.

    Warm-up rows go to ``log`` (also when cached, marked so); pass None on resume, where they are there."""
    import ray
    from tqdm import tqdm

    from agentrl.envs import load_function
    from agentrl.trainer.warmup import WarmupConfig, supervised_warmup

    if not cfg.warmup.enabled:
        return base
    w = cfg.warmup
    out = Path(cfg.cache_dir) / f"warm-{_key(str(base), cfg.env, cfg.tasks, cfg.task_kwargs, cfg.expert, w.model_dump(), cfg.seed)}"
    done = out / "warmup.json"
    if done.exists():
        for record in json.loads(done.read_text())["history"] if log else []:
            log.write({**record, "cached": True})
        ray.get(rollout.load_from_disk.remote(str(out), "warmup"))
        return out
    env_cls = load_function(cfg.env)
    expert = load_function(cfg.expert)

    def expert_chats(tasks: list[Any]) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
        return [(expert(task), env_cls.tool_schemas()) for task in tasks]

    tasks = load_function(cfg.tasks)(w.num_conversations, seed=cfg.seed + 1, split="train", **cfg.task_kwargs)
    bar = tqdm(total=w.max_steps, desc="warm-up")

    def evaluate(path: Path) -> float:
        ray.get(rollout.load_from_disk.remote(str(path), f"warmup-{bar.n}"))
        return ray.get(rollout.evaluate.remote(heldout))["eval_accuracy"]

    def progress(record: dict[str, float]) -> None:
        bar.update(int(record["warmup_step"]) - bar.n)
        shown = {k.removeprefix("warmup_").removesuffix("_accuracy"): round(v, 3)
                 for k, v in record.items() if k != "warmup_step"}
        bar.set_postfix(shown)
        if log:
            log.write(record)

    config = WarmupConfig(lr=w.lr, batch_size=w.batch_size, max_steps=w.max_steps, check_every=w.check_every,
                          eval_every=w.eval_every, target_accuracy=w.target_accuracy, max_minutes=w.max_minutes,
                          stop_nearest_target=w.stop_nearest_target, seed=cfg.seed)
    result = supervised_warmup(base, out, expert_chats(tasks), evaluate, config, progress=progress,
                               heldout=expert_chats(heldout))
    bar.close()
    done.write_text(json.dumps({"steps": result.steps, "accuracy": result.accuracy, "history": result.history}))
    return out


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    """Reward per step and held-out accuracy per evaluation, from the metrics JSONL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [(r["step"], r["rollout/reward_mean"]) for r in rows if "rollout/reward_mean" in r]
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "step" in r and "eval_accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        ax.plot(*zip(*steps, strict=True), label="train reward (mean)", alpha=0.6)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
