"""Configuration of a training run (``agentrl train``): one pydantic model, loaded from YAML, every field
overridable on the command line as ``--section.field value`` (e.g. ``--rollout.num_engines 1 --steps 10
--trainer.lr 3e-5``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
    check_every: int = Field(10, description="steps between teacher-forced held-out checks")
    eval_every: int = Field(100, description="steps between real evaluations while the check is below target")
    target_accuracy: float = 0.3
    max_minutes: float = 4.0
    num_conversations: int = 4000
    stop_nearest_target: bool = Field(True, description="keep the step before the crossing if it measures nearer")


class RolloutSection(_Section):
    engine: Literal["embedded", "sglang"] = "embedded"
    engine_args: list[str] = Field(default_factory=list, description="extra engine / sglang.launch_server flags")
    num_engines: int = 2
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 48
    concurrency: int = 64
    policy: Literal["realign", "fork", "truncate"] = "realign"
    rollout_function: str | None = Field(None, description="dotted path replacing the agent loop")


class EvalSection(_Section):
    every: int = 5
    num_tasks: int = 200


class RunConfig(_Section):
    env: str = "agentrl.envs.arithmetic:ArithmeticToolEnv"
    # fn(n, *, seed, split, **task_kwargs) -> tasks; split is "train" or "heldout"
    tasks: str = "agentrl.envs.arithmetic:make_tasks"
    task_kwargs: dict[str, Any] = Field(default_factory=lambda: {"multi_turn": True})
    # fn(task) -> the expert's messages for supervised warm-up
    expert: str = "agentrl.envs.arithmetic:expert_messages"
    output_dir: str = "runs/arithmetic"
    cache_dir: str = ".cache/agentrl"
    steps: int = 40
    max_minutes: float = 10.0
    loop: Literal["sync", "async"] = "sync"
    sync_mode: Literal["disk", "tensor", "broadcast", "delta"] = "delta"
    # Keyword arguments of the sender (agentrl.weights.sync.make_sync), e.g. {"transport": "broadcast"}.
    sync_options: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0
    model: ModelSection = ModelSection()
    warmup: WarmupSection = WarmupSection()
    rollout: RolloutSection = RolloutSection()
    # Keyword arguments of agentrl.trainer.trainer_config.TrainerConfig (validated there), e.g. lr, loss.
    trainer: dict[str, Any] = Field(default_factory=lambda: {"lr": 1e-4, "loss": {"kl_coef": 1e-3}})
    group_filter: str = "agentrl.rollout.buffer:has_reward_variance"
    colocate: bool = False
    trainer_ranks: int = 1
    eval: EvalSection = EvalSection()

    @model_validator(mode="after")
    def _trainer_temperature_is_the_sampling_temperature(self) -> RunConfig:
        # Training log-probs are of logits / temperature; any other value than the sampler's makes the
        # importance ratio wrong from the first token.
        sampling = self.rollout.temperature
        chosen = self.trainer.setdefault("temperature", sampling)
        if chosen != sampling:
            raise ValueError(f"trainer.temperature={chosen} differs from rollout.temperature={sampling}; "
                             "set only rollout.temperature")
        return self


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--rollout.num_engines", "1", "--trainer.loss.kl_coef", "0"]`` -> nested dict (JSON values,
    else strings). Unknown names are rejected later by validation, with the field path in the message."""
    tree: dict[str, Any] = {}
    it = iter(args)
    for flag in it:
        if not flag.startswith("--") or len(flag) < 3:
            raise ValueError(f"expected --section.field VALUE, got {flag!r}")
        key, eq, value = flag[2:].partition("=")
        if not eq:
            value = next(it, None)
            if value is None:
                raise ValueError(f"{flag} needs a value")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        _set_dotted(tree, key.replace("-", "_"), parsed)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read YAML at ``path`` (optional), apply ``--section.field VALUE`` overrides, validate."""
    import yaml

    raw: dict = yaml.safe_load(Path(path).read_text()) or {} if path else {}
    raw = _merge(raw, parse_overrides(list(overrides)))
    if "trainer" in raw:  # merge into the defaults rather than replacing them
        raw["trainer"] = _merge(RunConfig.model_fields["trainer"].default_factory(), raw["trainer"])
    return RunConfig.model_validate(raw)
