"""Configuration of a training run (``agentrl train``): one pydantic model, loaded from YAML, every field
overridable on the command line as ``--section.field value`` (e.g. ``--rollout.num_engines 1 --steps 10``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    path: str | None = Field(None, description="local HF model dir; None builds the tiny model")
    seed: int = 0
    max_position_embeddings: int = 512
    dtype: Literal["float32", "bfloat16"] = "float32"


class WarmupSection(_Section):
    enabled: bool = True
    lr: float = 3e-3
    batch_size: int = 32
    max_steps: int = 3000
    eval_every: int = 100
    target_accuracy: float = 0.3
    num_conversations: int = 4000


class RolloutSection(_Section):
    num_engines: int = 2
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 48
    concurrency: int = 64
    policy: Literal["realign", "fork", "truncate"] = "realign"
    rollout_function: str | None = Field(None, description="dotted path replacing the agent loop")


class TrainSection(_Section):
    lr: float = 1e-4
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    normalization: Literal["token_mean", "seq_mean", "token_sum"] = "token_mean"
    micro_batch_tokens: int = 8192
    group_filter: str = "agentrl.rollout.buffer:has_reward_variance"


class EvalSection(_Section):
    every: int = 5
    num_tasks: int = 200


class RunConfig(_Section):
    env: str = "agentrl.envs.arithmetic:ArithmeticToolEnv"
    output_dir: str = "runs/arithmetic"
    cache_dir: str = ".cache/agentrl"
    steps: int = 40
    max_minutes: float = 10.0
    loop: Literal["sync", "async"] = "sync"
    sync_mode: Literal["disk", "tensor", "broadcast", "delta"] = "delta"
    seed: int = 0
    model: ModelSection = ModelSection()
    warmup: WarmupSection = WarmupSection()
    rollout: RolloutSection = RolloutSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()


def _flatten(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            fields.update(_flatten(annotation, f"{prefix}{name}."))
        else:
            fields[f"{prefix}{name}"] = info
    return fields


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def add_config_arguments(parser: argparse.ArgumentParser, model: type[BaseModel] = RunConfig) -> None:
    """Add one ``--dotted.name`` option per config field (values parse as JSON, else stay strings)."""
    for dotted, info in _flatten(model).items():
        parser.add_argument(f"--{dotted}", dest=f"cfg:{dotted}", default=None, metavar="V", help=info.description)


def load_config(path: str | Path | None, args: argparse.Namespace | None = None) -> RunConfig:
    """Read YAML at ``path`` (optional), apply command-line overrides, validate."""
    import yaml

    raw: dict = {}
    if path:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    for key, value in vars(args or argparse.Namespace()).items():
        if key.startswith("cfg:") and value is not None:
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                parsed = value
            _set_dotted(raw, key[4:], parsed)
    return RunConfig.model_validate(raw)
