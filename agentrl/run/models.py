"""The model directories a run starts from, each built once into the cache: the tiny base model (when no
``model.path`` is given) and the supervised warm-up of it (when an ``expert`` is configured)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from agentrl.run.bookkeeping import MetricsLog
from agentrl.run.config import RunConfig
from agentrl.run.data import TaskSource


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def base_model_dir(cfg: RunConfig) -> Path:
    """``cfg.model.path`` if given, else the tiny model for this seed, built once into the cache."""
    if cfg.model.path:
        return Path(cfg.model.path)
    import tempfile

    from agentrl.models.tiny import TINY_SHAPE, TOKENIZER_DIR, make_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = TOKENIZER_DIR
        if cfg.model.tokenizer:  # written afresh each run: the key is what it writes, not its name
            from agentrl.plugins import load_function

            tokenizer_dir = Path(scratch)
            load_function(cfg.model.tokenizer)(tokenizer_dir)
            if not (tokenizer_dir / "tokenizer_config.json").is_file():
                raise ValueError(f"model.tokenizer {cfg.model.tokenizer!r} wrote no tokenizer_config.json "
                                 f"(wrote {sorted(f.name for f in tokenizer_dir.iterdir())})")
        tokenizer_files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(tokenizer_dir.iterdir())}
        shape = cfg.model.tiny_shape()
        # The default shape keeps its old key, so caches built before the shape was configurable stay valid.
        key_parts = (cfg.model.seed, shape["max_position_embeddings"], tokenizer_files)
        if any(shape[name] != TINY_SHAPE[name] for name in shape):
            key_parts += (shape,)
        out = Path(cfg.cache_dir) / f"tiny-{_key(*key_parts)}"
        if not (out / "model.safetensors").exists():
            make_tiny_model(out, seed=cfg.model.seed, tokenizer_dir=tokenizer_dir, **shape)
    return out


def _warm_dir(cfg: RunConfig, base: Path) -> Path:
    template_kwargs = cfg.rollout.chat_template_kwargs
    # Appended only when set, so the keys of existing caches (no kwargs) stay what they were.
    key_parts = (str(base), cfg.env, cfg.tasks, cfg.task_kwargs, cfg.data.model_dump(), cfg.expert,
                 cfg.warmup.model_dump(), cfg.seed, *([template_kwargs] if template_kwargs else []))
    return Path(cfg.cache_dir) / f"warm-{_key(*key_parts)}"


def starting_model_dir(cfg: RunConfig, base: Path) -> Path | None:
    """The model :func:`warm_model_dir` will return, when known before any warm-up runs: ``base`` without
    a warm-up, the cached warm model once built; None while a warm-up is still to run."""
    if not cfg.runs_warmup:
        return base
    out = _warm_dir(cfg, base)
    return out if (out / "warmup.json").exists() else None


def warm_model_dir(cfg: RunConfig, base: Path, rollout: Any, tasks: TaskSource, heldout: list[Any],
                   log: MetricsLog | None) -> Path:
    """Supervised warm-up of ``base`` on expert chats, evaluated through the rollout engines; cached.

    Warm-up rows go to ``log`` (also when cached, marked so); pass None on resume, where they are there."""
    import ray
    from tqdm import tqdm

    from agentrl.plugins import load_function
    from agentrl.run.warmup import supervised_warmup

    if not cfg.runs_warmup:
        return base
    w = cfg.warmup
    template_kwargs = cfg.rollout.chat_template_kwargs
    out = _warm_dir(cfg, base)
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

    train = tasks.warmup(w.num_conversations, seed=cfg.seed + 1)
    # No ETA: the warm-up stops on measured accuracy, usually long before the step cap.
    bar = tqdm(total=w.max_steps, desc="warm-up",
               bar_format="{desc}: step {n_fmt} (cap {total_fmt}) [{elapsed}, {rate_fmt}{postfix}]")

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

    result = supervised_warmup(base, out, expert_chats(train), evaluate, w, progress=progress,
                               heldout=expert_chats(heldout), seed=cfg.seed, chat_template_kwargs=template_kwargs)
    bar.close()
    done.write_text(json.dumps({"steps": result.steps, "accuracy": result.accuracy, "history": result.history}))
    return out
