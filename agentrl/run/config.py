"""``RunConfig``: the whole configuration of ``agentrl train``, one typed model, loaded from YAML with every
field overridable as ``--section.field value`` (``--rollout.num_engines 1 --steps 10 --trainer.lr 3e-5``).

Each setting is declared once, in the section that owns it: ``rollout`` is the rollout layer's
:class:`RolloutSettings`, ``trainer`` the trainer's :class:`TrainerConfig`, ``warmup`` the warm-up's
:class:`WarmupConfig`. :func:`load_config` validates everything, plug-in paths included, before Ray or
any engine starts; an unknown key names its section and the nearest valid key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from agentrl.models.tiny import TINY_SHAPE
from agentrl.plugins import load_function, resolve
from agentrl.rollout.settings import RolloutSettings
from agentrl.run.data import DataSection, FunctionTasks, TaskSource, is_data_path, load_dataset_tasks
from agentrl.run.distill import DistillSettings
from agentrl.run.external_agents import ExternalAgentSettings
from agentrl.run.placement import RaySettings
from agentrl.run.warmup import WarmupConfig
from agentrl.settings import FunctionPath, Settings
from agentrl.trainer.trainer_config import TrainerConfig
from agentrl.weights.transport import TransportOptions


class ModelSection(Settings):
    moved_keys: ClassVar[dict[str, str]] = {
        "dtype": "the policy's dtype is set once, as trainer.dtype; the engines serve in it too (a sync copies its bits)"}

    path: str | None = Field(None, description="local HF model dir; None builds the tiny test model")
    seed: int = Field(0, description="init seed of the tiny model")
    max_position_embeddings: int = Field(TINY_SHAPE["max_position_embeddings"], ge=16, description="context length of the tiny model")
    num_hidden_layers: int = Field(TINY_SHAPE["num_hidden_layers"], ge=1, description="layers of the tiny model")
    hidden_size: int = Field(TINY_SHAPE["hidden_size"], ge=8, description="hidden size of the tiny model (a multiple of num_attention_heads)")
    intermediate_size: int = Field(TINY_SHAPE["intermediate_size"], ge=8, description="MLP width of the tiny model")
    num_attention_heads: int = Field(TINY_SHAPE["num_attention_heads"], ge=1, description="attention heads of the tiny model")
    num_key_value_heads: int = Field(TINY_SHAPE["num_key_value_heads"], ge=1, description="key/value heads of the tiny model (divides num_attention_heads)")
    tokenizer: FunctionPath | None = Field(
        None, description="tokenizer of the tiny model: a module:function fn(out_dir) that writes a tokenizer "
        "directory (tokenizer.json, tokenizer_config.json, chat template) into out_dir; the vocabulary is "
        "its len(tokenizer); None: the bundled tiny tokenizer; not allowed with path")

    @model_validator(mode="after")
    def _shape_is_buildable(self) -> ModelSection:
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(f"model.hidden_size {self.hidden_size} must be num_attention_heads "
                             f"({self.num_attention_heads}) times an even head size (rotary embeddings)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model.num_key_value_heads {self.num_key_value_heads} must divide "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.tokenizer and self.path:
            raise ValueError("model.tokenizer builds the tiny model's tokenizer; a model.path brings its own")
        return self

    def tiny_shape(self) -> dict[str, int]:
        """The fields of the tiny model's shape (``agentrl.models.tiny.TINY_SHAPE``); unused with ``path``."""
        return {name: getattr(self, name) for name in TINY_SHAPE if name in type(self).model_fields}


class EvalSection(Settings):
    every: int = Field(5, ge=1, description="GRPO steps between held-out evaluations (and checkpoints)")
    num_tasks: int = Field(200, ge=1, description="held-out tasks, one greedy episode each")
    best_metric: str = Field("eval_accuracy", description="higher is better: its best checkpoint is kept and exported to hf/best")
    k: int = Field(1, ge=1, description="sampled episodes per held-out task besides the greedy one: eval/sampled/pass@1, 2, 4, "
                                        "..., k and mean@k (1: greedy only, eval/greedy/pass@1)")
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False,
                                      description="temperature of the sampled episodes; null: rollout.temperature")
    family_key: str = Field("family", description="task field naming its family: every eval value is also given per family")
    pass_threshold: float = Field(1.0, allow_inf_nan=False, description="an episode passes when its reward reaches this")

    def passk(self, rollout_temperature: float) -> dict[str, Any]:
        """The keyword arguments of :func:`agentrl.rollout.passk.evaluate_passk` for this section."""
        return {"k": self.k, "temperature": rollout_temperature if self.temperature is None else self.temperature,
                "family_key": self.family_key, "threshold": self.pass_threshold}


class RunConfig(Settings):
    """Everything ``agentrl train`` needs. The defaults run a user's own environment: no expert (so no
    warm-up), no task keyword arguments."""

    moved_keys: ClassVar[dict[str, str]] = {"temperature": "set it as rollout.temperature",
                                            "loop": "renamed: set it as schedule (sync, async or fully_async)"}

    env: str = Field("agentrl.envs.arithmetic:ArithmeticToolEnv", description="module:Class of the Environment")
    tasks: str = Field("agentrl.envs.arithmetic:make_tasks",
                       description="module:function (n, *, seed, split, **task_kwargs) -> tasks (split: train or heldout), "
                                   "or a JSONL / Parquet / CSV file, a folder of them, or a saved HF dataset (see data)")
    task_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments of a task function")
    data: DataSection = Field(default_factory=DataSection, description="how rows of task data become tasks")
    expert: FunctionPath | None = Field(None, description="module:function task -> expert messages; set: supervised warm-up first")
    output_dir: str = Field("runs/agentrl", description="metrics.jsonl, reward_curve.png, checkpoints/, logs/")
    cache_dir: str = Field(".cache/agentrl", description="built and warmed-up models, reused across runs")
    steps: int = Field(40, ge=0, description="GRPO steps")
    max_minutes: float = Field(10.0, gt=0, description="GRPO wall-time budget; the run stops after the step that passes it")
    schedule: Literal["sync", "async", "fully_async"] = Field(
        "sync", description="schedule: sync, async (one step off-policy) or fully_async (episodes always in flight)")
    max_staleness: int = Field(2, ge=0, description="fully_async: no trained token more than this many weight versions behind")
    stale_groups: Literal["drop", "regenerate"] = Field(
        "drop", description="fully_async: a group over max_staleness is dropped, or its task generated again")
    partial_rollout: Literal["continue", "abort", "resume"] = Field(
        "continue", description="fully_async, at a weight update: turns being generated finish on the old weights "
                                "(continue), are aborted and sent again on the new ones (abort), or pause and go on "
                                "from their last sampled token on the new ones (resume); episodes go on either way")
    dynamic_sampling: bool = Field(False, description="fully_async: keep taking groups until prompts_per_step pass group_filter")
    max_oversample: float = Field(2.0, ge=1.0, description="dynamic_sampling: at most this x prompts_per_step groups per batch")
    sync_mode: str = Field("delta", description="weight sync payload: full, delta (or the presets disk, tensor, broadcast), or module:Class")
    sync_options: SerializeAsAny[TransportOptions] = Field(
        default_factory=dict, validate_default=True, description='the transport and the options of it and of the payload, as one JSON '
        'object, e.g. {"transport": "broadcast", "backend": "nccl"}; the sync_options.* sections below list them')
    seed: int = Field(0, description="seed of tasks, warm-up and sampling order")
    group_filter: FunctionPath = Field("agentrl.rollout.buffer:has_reward_variance",
                              description="module:function group -> keep? (default: drop zero-variance groups)")
    colocate: bool = Field(False, description="release engine memory while training (needs schedule sync)")
    trainer_ranks: int = Field(1, ge=1, description="Megatron ranks (Ray actors)")
    log_samples: int = Field(4, ge=0, description="whole rollouts per step written to samples/step-N.jsonl")
    report_to: list[str] = Field(default_factory=list,
                                 description="trackers besides TensorBoard: wandb, mlflow, trackio (offline, in the output dir) or module:Class")
    model: ModelSection = Field(default_factory=ModelSection, description="the policy model")
    warmup: WarmupConfig = Field(default_factory=WarmupConfig, description="supervised warm-up (when expert is set)")
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="engines and sampling")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the Megatron trainer")
    eval: EvalSection = Field(default_factory=EvalSection, description="held-out evaluation")
    external_agent: ExternalAgentSettings | None = Field(
        None, description="agent processes (any OpenAI-client program) play the episodes through the gateway")
    ray: RaySettings = Field(default_factory=RaySettings, description="the Ray cluster and what each rank and engine reserves (docs/cluster.md)")
    distill: DistillSettings | None = Field(
        None, description="on-policy distillation: a teacher model scores the student's sampled tokens (per-token reverse KL); "
                          "unless group_filter is set, every group is then trained (each carries the teacher's signal)")

    @field_validator("tasks")
    @classmethod
    def _tasks_load(cls, value: str) -> str:
        if not is_data_path(value):  # data is read (and every row checked) when the run starts, before Ray
            load_function(value)
        return value

    @field_validator("report_to")
    @classmethod
    def _trackers_resolve(cls, names: list[str]) -> list[str]:
        from agentrl.run.tracking import BUILTIN

        for name in names:
            resolve(name, BUILTIN, what="tracker")
        return names

    @field_validator("env")
    @classmethod
    def _env_loads(cls, path: str) -> str:
        env_class(path)
        return path

    @field_validator("sync_mode")
    @classmethod
    def _sync_mode_loads(cls, mode: str) -> str:
        from agentrl.weights.sync import payload_class

        payload_class(mode)
        return mode

    @field_validator("sync_options", mode="before")
    @classmethod
    def _sync_options_fit_the_transport(cls, options: Any, info: ValidationInfo) -> Any:
        """Typed for the payload and the transport they name, so a bad key or name fails at load."""
        from agentrl.weights.sync import sync_options

        if "sync_mode" not in info.data:  # sync_mode itself was refused: that error says it
            return TransportOptions()
        if not isinstance(options, dict | TransportOptions):
            raise ValueError(f"sync_options must be a JSON object, got {type(options).__name__}")
        return sync_options(info.data["sync_mode"], options)

    @model_validator(mode="after")
    def _schedule_fits(self) -> RunConfig:
        if self.colocate and self.schedule != "sync":
            raise ValueError("colocate releases the engines during training; it needs schedule='sync'")
        if self.external_agent is not None and self.rollout.episode_function is not None:
            raise ValueError("external_agent plays the episodes itself; it cannot be combined with "
                             "rollout.episode_function")
        if self.external_agent is not None and self.schedule == "fully_async":
            raise ValueError("external_agent plays the episodes of schedule 'sync' or 'async'")
        if self.dynamic_sampling and self.schedule != "fully_async":
            raise ValueError("dynamic_sampling refills batches from the episode pool; it needs schedule='fully_async'")
        return self

    @model_validator(mode="after")
    def _lora_syncs_adapters(self) -> RunConfig:
        """With trainer.lora on, the default delta payload becomes ``adapter`` (same transport): the engines
        get the adapters, not the weights. ``full`` (dense merged weights) is kept when asked for."""
        from agentrl.weights.adapter_sync import ADAPTER_MODE, adapter_options, sends_adapters

        if self.trainer.lora.enabled and self.sync_mode == "delta":
            self.sync_mode, self.sync_options = ADAPTER_MODE, adapter_options(self.sync_options)
        elif sends_adapters(self.sync_mode) and not self.trainer.lora.enabled:
            raise ValueError(f"sync_mode {self.sync_mode!r} sends LoRA adapters; set trainer.lora.rank > 0")
        return self

    @model_validator(mode="after")
    def _distill_keeps_every_group(self) -> RunConfig:
        """A group without reward variance still carries the teacher's signal: distilling, the default filter keeps all."""
        if self.distill is not None and "group_filter" not in self.model_fields_set:
            self.group_filter = "agentrl.rollout.buffer:keep_all"
        return self

    @model_validator(mode="after")
    def _env_speaks_a_known_format(self) -> RunConfig:
        """The environment's own tool_format / prompt_mode, where rollout does not override them."""
        from agentrl.envs.environment import TOOL_FORMAT_AUTO, check_prompt_mode
        from agentrl.envs.formats import get_tool_call_format
        from agentrl.envs.mcp import MCPEnvironment

        env = env_class(self.env)
        if self.rollout.mcp is not None and not issubclass(env, MCPEnvironment):
            raise ValueError(f"rollout.mcp names an MCP server, but env {self.env} is no MCPEnvironment")
        if self.rollout.prompt_mode is None:
            check_prompt_mode(env.prompt_mode, f"{self.env}.prompt_mode")
        if self.rollout.tool_format is None and env.tool_format != TOOL_FORMAT_AUTO:
            try:
                get_tool_call_format(env.tool_format)
            except (ImportError, TypeError, ValueError) as err:
                raise ValueError(f"{self.env}.tool_format: {err} (or set rollout.tool_format)") from None
        return self

    @property
    def runs_warmup(self) -> bool:
        return self.expert is not None

    def task_source(self) -> TaskSource:
        """The run's tasks; data is read and every row validated here (call before Ray starts)."""
        if not is_data_path(self.tasks):
            return FunctionTasks(load_function(self.tasks), seed=self.seed, task_kwargs=self.task_kwargs)
        env = env_class(self.env)
        return load_dataset_tasks(self.tasks, self.data, seed=self.seed, task_model=env.task_model,
                                  task_fields=env.task_fields)


def env_class(path: str) -> type:
    """The :class:`~agentrl.envs.Environment` subclass at ``path``; a ``PluginError`` naming what it looked for."""
    from agentrl.envs import Environment

    return resolve(path, {}, what="env", base=Environment)


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
    """Read YAML at ``path`` (optional), apply ``--section.field VALUE`` overrides, validate. A file that is
    not YAML, or not a mapping of keys to values, is a ``ValueError`` of one line naming it."""
    return RunConfig.model_validate(_merge(read_yaml_config(path), parse_overrides(list(overrides))))


def read_yaml_config(path: str | Path | None) -> dict[str, Any]:
    """The mapping a YAML config file holds (``{}`` for none or an empty file)."""
    import yaml

    if not path:
        return {}
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ValueError(f"{path}: not valid YAML{line}: {getattr(err, 'problem', None) or err}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a config is a mapping of keys to values (steps: 40, rollout: {{...}}), "
                         f"but this file holds a {type(raw).__name__}")
    return raw
