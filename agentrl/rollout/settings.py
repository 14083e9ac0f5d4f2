"""``RolloutSettings``: how episodes are generated (engines, sampling, drift policy, batch shape), the
``rollout`` section of a run's config and the settings of :class:`~agentrl.rollout.manager.RolloutManager`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from agentrl.rollout.remote_reward import RemoteRewardSettings
from agentrl.settings import FunctionPath, Settings


class RolloutSettings(Settings):
    """Engines behind the router, the sampling of every training episode, and the size of a step's batch."""

    engine: Literal["embedded", "sglang"] = Field(
        "embedded", description="embedded (agentrl.engine, CPU or CUDA) or sglang (real SGLang servers, CUDA)")
    engine_args: list[str] = Field(default_factory=list,
                                   description="extra engine / sglang.launch_server flags, e.g. --tp-size 2")
    num_engines: int = Field(2, ge=1, description="engine processes behind the smg router")
    prompts_per_step: int = Field(8, ge=1, description="tasks per GRPO step")
    samples_per_prompt: int = Field(8, ge=1, description="episodes per task (the GRPO group size)")
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False, description="sampling temperature; the trainer's log-probs use it too")
    max_new_tokens: int = Field(48, ge=1, description="cap on generated tokens per turn")
    concurrency: int = Field(64, ge=1, description="episodes in flight at once")
    reward_weights: dict[str, float] = Field(default_factory=dict,
                                             description="weights of named reward components (unlisted: 1)")
    remote_reward: RemoteRewardSettings | None = Field(None, description="an HTTP endpoint scoring each episode")
    restart_dead_engines: bool = Field(False, description="restart an engine that died (it is always removed from the router)")
    policy: str = Field("realign", description="drift policy: realign, fork, truncate, or module:Class")
    rollout_function: FunctionPath | None = Field(None, description="module:function replacing the agent loop (same signature)")

    @field_validator("policy")
    @classmethod
    def _policy_resolves(cls, value: str) -> str:
        from agentrl.trajectory.policies import make_policy

        make_policy(value)
        return value
