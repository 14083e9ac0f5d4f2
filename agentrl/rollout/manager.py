"""The rollout side of a run: embedded engines behind the smg router, the agent loop, GRPO groups out.

One object owns every process it starts (engines, router) and stops them on :meth:`shutdown`. Training
episodes run in an :class:`~agentrl.rollout.episode_pool.EpisodePool` (:meth:`RolloutManager.pool`); each
episode is :func:`agentrl.envs.loop.run_episode` unless ``rollout.episode_function`` (same signature)
replaces it, so users change how episodes run without forking agentrl.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.engine.auth import run_secret
from agentrl.envs import Environment, load_function
from agentrl.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)
# A server named in engine_urls runs already: it answers /health at once or is not there.
EXTERNAL_HEALTH_TIMEOUT_S = 15.0


@dataclass
class RolloutBatch:
    """One batch of :meth:`RolloutManager.rollout`: the proved groups, the batch's metrics, every episode."""

    groups: list[list[Any]]
    metrics: dict[str, float]
    episodes: list[Any]


@dataclass
class _Batches:
    """A task source of given batches (``train(n, index)``: batch ``index``)."""

    batches: list[list[Any]]

    def train(self, n: int, index: int) -> list[Any]:
        return self.batches[index][:n]


class RolloutManager:
    """Start engines + router for ``model_dir``; run episodes of ``env_factory`` through them.

    With ``log_dir`` every engine and the router log to ``log_dir/engine-<port>.log`` and
    ``log_dir/router-<port>.log``; without it, to temp files.

    ``secret`` (default :func:`~agentrl.engine.auth.run_secret`: ``$AGENTRL_ENGINE_SECRET``, or a fresh
    one stored there) guards the engines' and the router's control routes; :attr:`secret` is what a weight
    sync must present. A dead engine leaves the router within seconds (:class:`~agentrl.rollout.router.
    EngineWatch`) and, with ``settings.restart_dead_engines``, is started again. Embedded engines split ``cpus``
    (default: the cores this process may use) evenly between their torch thread pools.

    Where the engines come from: ``settings.engine_urls`` names servers that already run (agentrl serve or
    SGLang): each is health-checked and must accept the secret, none is started or stopped here. Else
    ``engine_factory(i)`` (e.g. an engine started on another node by the run) returns engine ``i`` with
    :class:`~agentrl.engine.launch.EngineProcess`'s API; else engines are this process's children.
    """

    def __init__(self, model_dir: str | Path, env_factory: Callable[[], Environment],
                 settings: RolloutSettings | None = None, *, dtype: str = "float32",
                 log_dir: str | Path | None = None, secret: str | None = None,
                 cpus: int | None = None, engine_factory: Callable[[int], Any] | None = None) -> None:
        from transformers import AutoTokenizer

        from agentrl.engine.protocol import context_length_of
        from agentrl.envs.render import ChatRenderer

        self.model_dir = str(model_dir)
        self.settings = settings or RolloutSettings()
        # Optional class-level hooks of the environment: rollout_metrics() -> {name: value} about its own
        # infrastructure since the last call (reported as env/<name> after each rollout), and
        # close_resources() (what its episodes share, e.g. sandbox pools; called by shutdown()).
        self.env_source = env_factory
        self.env_factory = self._configured(env_factory)
        self.log_dir = log_dir
        self.dtype = dtype  # the model's: engines serve the weights the trainer holds
        self.secret = secret or run_secret()
        self.cpus = cpus
        self.engine_factory = engine_factory
        self.watch: Any = None
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.renderer = ChatRenderer(tokenizer, **self.settings.chat_template_kwargs)
        self.max_context_tokens = context_length_of(self.model_dir)
        self.engines: list[Any] = []
        self.router: Any = None
        self._client: Any = None

    def _configured(self, env_factory: Callable[[], Environment]) -> Callable[[], Environment]:
        """``env_factory`` with the settings' reward weights, tool format, prompt mode and remote reward
        applied to each env (the loop reads the format and mode from the env, so a custom rollout function
        sees them too)."""
        from agentrl.rollout.judge import Judge, with_judge
        from agentrl.rollout.remote_reward import RemoteReward, with_remote_reward

        s = self.settings
        self.judge = Judge(s.judge) if s.judge else None

        def make() -> Environment:
            env = env_factory()
            if s.reward_weights:
                env.reward_weights = dict(s.reward_weights)
            if s.tool_format is not None:
                env.tool_format = s.tool_format
            if s.prompt_mode is not None:
                env.prompt_mode = s.prompt_mode
            if s.mcp is not None:
                s.mcp.apply(env)
            return env

        judged = with_judge(make, self.judge) if self.judge else make
        return with_remote_reward(judged, RemoteReward(s.remote_reward)) if s.remote_reward else judged

    # -- processes -----------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> RolloutManager:
        from agentrl.rollout.router import EngineWatch, SmgRouter

        s = self.settings
        count = len(s.engine_urls) if s.engine_urls else s.num_engines
        make = self._engine_maker()
        try:
            self.engines = [make(i) for i in range(count)]
            for engine in self.engines:
                engine.start()
            for engine in self.engines:
                engine.wait_healthy(min(timeout, EXTERNAL_HEALTH_TIMEOUT_S) if s.engine_urls else timeout)
            self.router = SmgRouter([e.url for e in self.engines], log_dir=self.log_dir,
                                    secret=self.secret).start(timeout)
            self.watch = EngineWatch(self.router, self.engines, restart=self.settings.restart_dead_engines).start()
            if self.judge is not None:
                self.judge.start(self.engine_urls, self.renderer.tokenizer, self.max_context_tokens, dtype=self.dtype,
                                 log_dir=self.log_dir, secret=self.secret)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _engine_maker(self) -> Callable[[int], Any]:
        s = self.settings
        if s.engine_urls:
            from agentrl.engine.launch import ExternalEngine

            return lambda i: ExternalEngine(s.engine_urls[i], secret=self.secret)
        if self.engine_factory is not None:
            return self.engine_factory
        if s.engine == "embedded":
            from agentrl.engine.launch import EngineProcess, threads_per_engine

            threads = threads_per_engine(s.num_engines, self.cpus)
            return lambda i: EngineProcess(self.model_dir, dtype=self.dtype, extra_args=s.engine_args,
                                           log_dir=self.log_dir, secret=self.secret, threads=threads)
        if s.engine == "sglang":
            from agentrl.engine.sglang import SGLangProcess

            return lambda i: SGLangProcess(self.model_dir, dtype=self.dtype, sglang_args=s.engine_args,
                                           log_dir=self.log_dir, secret=self.secret)
        raise ValueError(f"unknown engine {s.engine!r}: choose 'embedded' or 'sglang'")

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def engine_kinds(self) -> dict[str, str]:
        """Each engine's kind by url: ``agentrl-embedded`` or ``sglang`` (for a running server: what its
        ``/server_info`` says; only agentrl's engine advertises the delta routes)."""
        kinds = {}
        for engine in self.engines:
            info = getattr(engine, "info", None)
            if info is not None:
                kinds[engine.url] = str(info.get("engine") or "sglang")
            else:
                kinds[engine.url] = "agentrl-embedded" if self.settings.engine == "embedded" else "sglang"
        return kinds

    async def aclose_client(self) -> None:
        """Close the HTTP pool; call from the event loop that used it, before :meth:`shutdown`."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
        if self.judge is not None:
            await self.judge.aclose()

    def shutdown(self) -> None:
        """Stop the router and every engine this manager started."""
        self._client = None
        if self.watch is not None:  # first, so it does not restart engines being stopped
            self.watch.stop()
            self.watch = None
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.judge is not None:
            self.judge.stop()
        for engine in self.engines:
            engine.stop()
        self.engines = []
        closer = getattr(self.env_source, "close_resources", None)
        if callable(closer):
            closer()

    def __enter__(self) -> RolloutManager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def client(self) -> Any:
        from agentrl.rollout.client import RolloutClient

        if self._client is None:
            from agentrl.engine.protocol import routes_experts

            # MoE on agentrl's engines: every turn records its experts (the trainer replays or compares them)
            routing = self.settings.engine == "embedded" and routes_experts(self.model_dir)
            self._client = RolloutClient(self.router.url, return_routed_experts=routing)
        return self._client

    # -- episodes ------------------------------------------------------------------------------

    def episode_function(self) -> Callable[..., Any] | None:
        """``settings.episode_function`` loaded (None: :func:`~agentrl.envs.loop.run_episode`)."""
        return load_function(self.settings.episode_function) if self.settings.episode_function else None

    def pool(self, task_source: Any, schedule: Any, buffer: Any, *, first_batch: int = 0,
             engine_control: Callable[[str], Any] | None = None, settings: RolloutSettings | None = None) -> Any:
        """An :class:`~agentrl.rollout.episode_pool.EpisodePool` playing through these engines (not started),
        under ``settings`` (default: this manager's)."""
        from agentrl.rollout.episode_pool import EpisodePool

        return EpisodePool(env_factory=self.env_factory, renderer=self.renderer, generate=self.client().generate_turn,
                           task_source=task_source, rollout=settings or self.settings, schedule=schedule, buffer=buffer,
                           max_context_tokens=self.max_context_tokens, engine_control=engine_control,
                           first_batch=first_batch, episode_function=self.episode_function())

    async def rollout(self, tasks: Sequence[Any], samples_per_task: int, *,
                      temperature: float | None = None) -> RolloutBatch:
        """``samples_per_task`` episodes of each of ``tasks`` as one admitted batch of an episode pool (the
        training path, proof included), outside a run: ``agentrl rollout``, benchmarks, tests."""
        from agentrl.rollout.buffer import DataBuffer, keep_all

        settings = self.settings.model_copy(update={
            "prompts_per_step": max(1, len(tasks)), "samples_per_prompt": samples_per_task,
            **({} if temperature is None else {"temperature": temperature})})
        pool = self.pool(_Batches([list(tasks)]), None, DataBuffer(keep_all), settings=settings)
        try:
            groups, metrics, episodes = await pool.take(0, batch=0)
        finally:
            await pool.close()
        return RolloutBatch(groups=[g for g in groups if g], metrics=metrics, episodes=episodes)

    async def evaluate(self, tasks: Sequence[Any]) -> dict[str, float]:
        """Greedy held-out accuracy: mean reward of one episode per task at temperature 0 (a failed episode
        counts 0), played by the pool's episode runner (never trained, so not proved)."""
        from agentrl.rollout.passk import episode_rewards

        rewards = [r for (r,) in await episode_rewards(self, tasks, 1, 0.0) if r is not None]
        return {"eval_accuracy": sum(rewards) / max(len(tasks), 1), "eval_episodes": float(len(rewards))}
