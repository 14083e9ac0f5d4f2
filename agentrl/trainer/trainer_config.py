"""Trainer configuration (a dataclass: no validation framework needed for plain numbers and paths)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agentrl.trainer.losses import LossConfig


@dataclass
class TrainerConfig:
    """Everything :class:`~agentrl.trainer.actor.MegatronTrainer` needs besides the HF model directory."""

    # parallelism / numerics
    tp_size: int = 1
    dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    seed: int = 1234
    recompute: bool = False  # full activation recomputation (memory for compute)
    # optimizer + schedule (Megatron's Adam with decoupled weight decay, or plain SGD)
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None  # None: constant after warm-up
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    # batching
    max_tokens_per_microbatch: int = 8192
    steps_per_batch: int = 1  # optimizer steps per train_step (PPO mini-batches)
    pad_id: int = 0
    # RL
    temperature: float = 1.0  # the sampling temperature: log-probs are of logits / temperature
    loss: LossConfig = field(default_factory=LossConfig)
    advantage_fn: str = "agentrl.trainer.losses.grpo_advantages"  # (rewards, group_ids) -> advantages
    sample_filter: str | None = None  # (rewards, group_ids) -> kept indices, e.g. ...losses.drop_zero_variance_groups
    credit_fn: str | None = None  # (samples, advantages) -> samples with loss masks only narrowed (trainer.credit)
    reward_key: str = "score"  # used when Sample.reward is a dict
    kl_in_reward: bool = False  # subtract loss.kl_coef * KL from rewards instead of adding KL to the loss
    ref_model_dir: str | None = None  # reference policy for KL; default: the initial model directory
    old_logprobs: Literal["train", "rollout"] = "train"  # behaviour policy: a fresh forward, or the sampler's

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        if self.steps_per_batch < 1:
            raise ValueError(f"steps_per_batch must be >= 1, got {self.steps_per_batch}")
        if self.max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {self.max_tokens_per_microbatch}")
        if self.use_distributed_optimizer and self.optimizer != "adam":
            raise ValueError("Megatron's distributed optimizer supports only optimizer='adam'")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def needs_ref(self) -> bool:
        return self.loss.kl_coef > 0
