"""``RolloutSettings``: how episodes are generated (engines, sampling, drift policy, batch shape), the
``rollout`` section of a run's config and the settings of :class:`~agentrl.rollout.manager.RolloutManager` and the episode pool."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from agentrl.engine.scheduler import MAX_BATCH_SIZE
from agentrl.envs.mcp import MCPServerSettings
from agentrl.rollout.judge import JudgeSettings
from agentrl.rollout.remote_reward import RemoteRewardSettings
from agentrl.settings import FunctionPath, Settings

# The embedded engine's default --max-batch-size. Fewer episodes in flight than the engines batch leave rows
# idle: the main job (2 engines, 128 episodes a step) at 64 in flight spent 15-25% more engine CPU per rollout
# and per 200-task evaluation than at 128 (benchmarks/results/main_job_step_profile.md).
EPISODES_PER_ENGINE = MAX_BATCH_SIZE


class RolloutSettings(Settings):
    """Engines behind the router, the sampling of every training episode, and the size of a step's batch."""

    moved_keys: ClassVar[dict[str, str]] = {
        "rollout_function": "the whole-batch rollout_function became the per-episode episode_function "
                            "(README: Migrating a whole-batch rollout_function)"}

    engine: Literal["embedded", "sglang"] = Field(
        "embedded", description="embedded (agentrl.engine, CPU or CUDA) or sglang (real SGLang servers, CUDA)")
    engine_args: list[str] = Field(default_factory=list,
                                   description="extra engine / sglang.launch_server flags, e.g. --tp-size 2")
    num_engines: int = Field(2, ge=1, description="engine processes behind the smg router")
    engine_urls: list[str] = Field(default_factory=list,
                                   description="servers already running (agentrl serve or SGLang) to use instead of starting num_engines")
    prompts_per_step: int = Field(8, ge=1, description="tasks per GRPO step")
    samples_per_prompt: int = Field(8, ge=1, description="episodes per task (the GRPO group size)")
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False, description="sampling temperature; the trainer's log-probs use it too")
    max_new_tokens: int = Field(48, ge=1, description="cap on generated tokens per turn")
    concurrency: int | None = Field(None, ge=1, description="episodes in flight at once; null: "
                                    f"{EPISODES_PER_ENGINE} per engine (what an embedded engine batches)")
    reward_weights: dict[str, float] = Field(default_factory=dict,
                                             description="weights of named reward components (unlisted: 1)")
    remote_reward: RemoteRewardSettings | None = Field(None, description="an HTTP endpoint scoring each episode")
    judge: JudgeSettings | None = Field(None, description="a generative reward model on engines of the run scoring each episode")
    mcp: MCPServerSettings | None = Field(None, description="the MCP server of an MCPEnvironment env (overrides the class's own)")
    restart_dead_engines: bool = Field(False, description="restart an engine that died (it is always removed from the router)")
    policy: str = Field("realign", description="drift policy: realign, fork, truncate, or module:Class")
    episode_function: FunctionPath | None = Field(
        None, description="module:function replacing agentrl.envs.loop:run_episode for every episode (same signature)")
    tool_format: str | None = Field(None, description="tool-call syntax replies are parsed in: a built-in name (hermes, qwen3, llama3_json, ...), "
                                                      "module:attr, or auto (from the chat template); null: the environment's tool_format (default auto)")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict,
                                                 description='keyword arguments of the chat template in every prompt, train and eval, e.g. {"enable_thinking": false}')
    prompt_mode: Literal["rerender", "append"] | None = Field(
        None, description="rerender the whole chat each turn, or append the new messages to the held tokens (whole multi-turn "
                          "samples when the template re-renders history differently; see docs/trajectory.md); null: the environment's")

    @model_validator(mode="after")
    def _default_concurrency(self) -> RolloutSettings:
        if self.concurrency is None:
            engines = len(self.engine_urls) if self.engine_urls else self.num_engines
            self.concurrency = EPISODES_PER_ENGINE * engines
        return self

    @field_validator("tool_format")
    @classmethod
    def _tool_format_resolves(cls, value: str | None) -> str | None:
        from agentrl.envs.environment import TOOL_FORMAT_AUTO
        from agentrl.envs.formats import get_tool_call_format

        if value is not None and value != TOOL_FORMAT_AUTO:
            try:
                get_tool_call_format(value)
            except (ImportError, TypeError) as err:  # pydantic reports ValueErrors with the key's path
                raise ValueError(str(err)) from None
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_free(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        from agentrl.envs.render import RESERVED_TEMPLATE_KWARGS

        clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if clash:
            raise ValueError(f"{clash} are set by the renderer itself, not by chat_template_kwargs")
        return kwargs

    @field_validator("engine_urls")
    @classmethod
    def _urls_are_http(cls, urls: list[str]) -> list[str]:
        from urllib.parse import urlsplit

        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                raise ValueError(f"engine_urls: {url!r} is not an http://host:port url")
        if len(set(u.rstrip("/") for u in urls)) != len(urls):
            raise ValueError(f"engine_urls lists a server twice: {urls}")
        return [u.rstrip("/") for u in urls]

    @field_validator("policy")
    @classmethod
    def _policy_resolves(cls, value: str) -> str:
        from agentrl.trajectory.policies import make_policy

        make_policy(value)
        return value
