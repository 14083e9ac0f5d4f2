"""``agentrl train --train-only SAMPLES.jsonl``: GRPO steps on saved Samples (``agentrl rollout
--output``) through the same trainer actors, no engines: for debugging the trainer on fixed data."""

from __future__ import annotations

from pathlib import Path

from agentrl.plugins import load_function
from agentrl.rollout.buffer import DataBuffer, load_samples_jsonl
from agentrl.run.bookkeeping import MetricsLog, train_row
from agentrl.run.config import RunConfig


def train_from_samples(cfg: RunConfig, samples_path: str | Path) -> Path:
    """Groups are taken ``rollout.prompts_per_step`` at a time, for at most ``steps`` steps."""
    import ray

    from agentrl.run.actors import start_trainer_group
    from agentrl.run.models import base_model_dir

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out / "metrics.jsonl")
    groups: dict[str, list] = {}
    for sample in load_samples_jsonl(samples_path):
        groups.setdefault(str(sample.group_id), []).append(sample)
    buffer = DataBuffer(load_function(cfg.group_filter))
    kept, n = buffer.kept(groups.values()), cfg.rollout.prompts_per_step
    from agentrl.run import placement

    placement.connect(cfg.ray, env_vars={"TOKENIZERS_PARALLELISM": "false"}, default_cpus=max(4, cfg.trainer_ranks + 1))
    try:
        trainers = start_trainer_group(base_model_dir(cfg), cfg.trainer.model_dump(), cfg.rollout.temperature,
                                       cfg.trainer_ranks)
        for step, start in enumerate(range(0, min(len(kept), cfg.steps * n), n), start=1):
            batch = ray.put([s for group in kept[start:start + n] for s in group])
            metrics = ray.get([t.train.remote(batch) for t in trainers])[0]
            log.write({"step": step, "train/groups_dropped": buffer.groups_dropped,
                       **train_row(metrics)})
    finally:
        ray.shutdown()
    return out
