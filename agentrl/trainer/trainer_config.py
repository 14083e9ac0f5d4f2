"""``TrainerConfig``: every setting of :class:`~agentrl.trainer.actor.MegatronTrainer`, typed and validated
at construction (an unknown key or a wrong type is an error naming it). The sampling temperature is not
here: it belongs to the rollout and is handed to the trainer with the data it describes."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from agentrl.settings import FunctionPath, Settings
from agentrl.trainer.lora import LoraConfig
from agentrl.trainer.losses import LossConfig
from agentrl.trainer.moe import MoEConfig


class TrainerConfig(Settings):
    """Parallelism, numerics, optimizer, schedule, batching and the GRPO plug-ins of one trainer."""

    moved_keys: ClassVar[dict[str, str]] = {
        "temperature": "the sampling temperature is set once, as rollout.temperature, and the trainer uses it",
        "sample_filter": "which groups to train is the run's group_filter (the data buffer's)",
    }

    # parallelism / numerics
    tp_size: int = Field(1, ge=1, description="tensor-parallel size")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="the policy's parameter and compute dtype, "
                                                  "in the trainer and in the engines (a weight sync copies its bits)")
    attention: Literal["auto", "sdpa", "local", "te"] = Field("auto", description="core attention backend")
    seed: int = Field(1234, description="Megatron RNG seed")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="activation recomputation, memory for compute: selective recomputes recompute_modules "
                            "in every layer; full recomputes whole layers (one more forward). true/false mean full/none")
    # megatron-core's other modules need TransformerEngine (layernorm, moe_act) or MLA (mla_up_proj)
    recompute_modules: list[Literal["core_attn", "mlp", "moe", "shared_experts"]] = Field(
        default_factory=lambda: ["core_attn"], description="what recompute='selective' recomputes in each layer "
                                                           "(megatron-core's recompute_modules; core_attn is its default)")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="low-rank adapters (rank > 0: only they train)")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="mixture-of-experts: routing replay, router losses, EP")
    # optimizer + schedule (Megatron's Adam with decoupled weight decay, or plain SGD)
    optimizer: Literal["adam", "sgd"] = Field("adam", description="Megatron optimizer")
    lr: float = Field(1e-6, gt=0, description="peak learning rate")
    min_lr: float = Field(0.0, ge=0, description="learning rate at the end of the decay")
    lr_warmup_steps: int = Field(0, ge=0, description="linear LR ramp from 0 over this many optimizer steps")
    lr_decay_steps: int | None = Field(None, ge=1, description="decay length; None: constant after warm-up")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field("constant", description="LR decay shape")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    adam_beta1: float = Field(0.9, description="Adam beta1")
    adam_beta2: float = Field(0.999, description="Adam beta2")
    adam_eps: float = Field(1e-8, description="Adam epsilon")
    clip_grad: float = Field(1.0, description="global gradient-norm clip")
    use_distributed_optimizer: bool = Field(False, description="shard optimizer state over data-parallel ranks")
    optimizer_cpu_offload: bool = Field(False, description="Adam's state and update on the CPU "
                                        "(megatron-core's HybridDeviceOptimizer); needs use_distributed_optimizer and bfloat16")
    optimizer_offload_fraction: float = Field(1.0, ge=0, le=1, description="share of the parameters whose "
                                              "optimizer runs on the CPU with optimizer_cpu_offload")
    overlap_cpu_optimizer_d2h_h2d: bool = Field(False, description="with optimizer_cpu_offload: copy gradients "
                                                "and parameters on side streams, one CPU optimizer per parameter")
    # batching
    max_tokens_per_microbatch: int = Field(8192, ge=1, description="model tokens per forward/backward "
                                           "(padded: rows x longest; packed: real tokens)")
    packing: Literal["auto", "packed", "padded"] = Field(
        "auto", description="packed: sequences end to end with per-sequence attention, no padding (sdpa, te); "
                            "padded: right-padded rows; auto: packed unless attention is local")
    steps_per_batch: int = Field(1, ge=1, description="optimizer steps per train_step (PPO mini-batches)")
    pad_id: int = Field(0, description="token id used for padding")
    # RL
    loss: LossConfig = Field(default_factory=LossConfig, description="the policy loss and its variants")
    advantage_fn: FunctionPath = Field("agentrl.trainer.losses:grpo_advantages",
                              description="(rewards, group_ids) -> advantages")
    credit_fn: FunctionPath | None = Field(None, description="(samples, advantages) -> samples, loss masks only narrowed")
    reward_key: str = Field("score", description="the scalar read when Sample.reward is a dict")
    kl_in_reward: bool = Field(False, description="subtract loss.kl_coef x KL from rewards, not add it to the loss")
    ref_model_dir: str | None = Field(None, description="reference policy for KL; None: the initial model")
    old_logprobs: Literal["train", "rollout"] = Field("train", description="behaviour policy: a fresh forward or the sampler's")

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_bool(cls, value: object) -> object:
        """The older ``recompute: true/false`` (full recomputation or none)."""
        return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.use_distributed_optimizer and self.optimizer != "adam":
            raise ValueError("Megatron's distributed optimizer supports only optimizer='adam'")
        if self.optimizer_cpu_offload and not (self.use_distributed_optimizer and self.dtype == "bfloat16"):
            raise ValueError("optimizer_cpu_offload needs use_distributed_optimizer: true and dtype: bfloat16 "
                             "(megatron-core's hybrid CPU optimizer runs inside its distributed optimizer, on the "
                             "fp32 copies of bf16 parameters)")
        if self.packing == "packed" and self.attention == "local":
            raise ValueError("packing='packed' needs attention 'sdpa' or 'te'; 'local' attention runs padded only")
        return self

    @property
    def needs_ref(self) -> bool:
        return self.loss.kl_coef > 0
