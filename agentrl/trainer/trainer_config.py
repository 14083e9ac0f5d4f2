"""``TrainerConfig``: every setting of :class:`~agentrl.trainer.actor.MegatronTrainer`, typed and validated
at construction (an unknown key or a wrong type is an error naming it). The sampling temperature is not
here: it belongs to the rollout and is handed to the trainer with the data it describes."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

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
    recompute: bool = Field(False, description="full activation recomputation (memory for compute)")
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

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.use_distributed_optimizer and self.optimizer != "adam":
            raise ValueError("Megatron's distributed optimizer supports only optimizer='adam'")
        if self.packing == "packed" and self.attention == "local":
            raise ValueError("packing='packed' needs attention 'sdpa' or 'te'; 'local' attention runs padded only")
        return self

    @property
    def needs_ref(self) -> bool:
        return self.loss.kl_coef > 0
