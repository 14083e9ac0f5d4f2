"""A remote reward: an HTTP endpoint (e.g. a reward-model server) that scores each finished episode.

``POST url`` with ``{"task": ..., "messages": [...], "reward_components": {...}}`` (the environment's own
components, if any); the answer is ``{"reward": <finite number>}``. Transient failures (connection
errors, timeouts, 5xx, 429) are retried with backoff; anything else, or running out of retries, raises
:class:`RemoteRewardError`, which fails the episode: it is counted (``rollout/failure_reasons/
RemoteRewardError``) and dropped, never given a made-up reward. The score joins the environment's
components under ``name`` and is weighted like them (``Environment.reward_weights``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import Field

from agentrl.envs.environment import Environment, maybe_await
from agentrl.settings import Settings
from agentrl.trajectory.sample import BadRewardError, check_reward


class RemoteRewardError(RuntimeError):
    """The endpoint gave no usable reward for an episode."""


class RemoteRewardSettings(Settings):
    url: str = Field(description="endpoint that answers POST {task, messages, reward_components} with {reward}")
    name: str = Field("remote", description="the component name the score is logged and weighted under")
    timeout_s: float = Field(30.0, gt=0, description="per attempt")
    retries: int = Field(2, ge=0, description="extra attempts after a transient failure")
    backoff_s: float = Field(0.5, ge=0, description="first wait between attempts (doubles each time)")


class RemoteReward:
    """Scores episodes through one pooled aiohttp session (opened lazily in the running loop)."""

    def __init__(self, settings: RemoteRewardSettings) -> None:
        self.settings = settings
        self._session: Any = None

    async def score(self, task: Any, messages: list[dict[str, Any]], components: Mapping[str, float]) -> float:
        import aiohttp

        s = self.settings
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=s.timeout_s))
        body = json.dumps({"task": task, "messages": messages, "reward_components": dict(components)}, default=str)
        problem = ""
        for attempt in range(s.retries + 1):
            if attempt:
                await asyncio.sleep(s.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._session.post(s.url, data=body, headers={"Content-Type": "application/json"}) as r:
                    text = await r.text()
                    if r.status >= 500 or r.status == 429:
                        problem = f"HTTP {r.status}: {text[:200]}"
                        continue
                    if r.status >= 400:
                        raise RemoteRewardError(f"{s.url} refused the episode: HTTP {r.status}: {text[:200]}")
                    return _reward_of(text, s.url)
            except (aiohttp.ClientError, TimeoutError) as err:
                problem = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        raise RemoteRewardError(f"{s.url} gave no reward after {s.retries + 1} attempts ({problem})")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _reward_of(text: str, url: str) -> float:
    try:
        value = json.loads(text)["reward"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise RemoteRewardError(f"{url} answered without a 'reward' number: {text[:200]}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RemoteRewardError(f"{url} answered a reward that is not a finite number: {value!r}")
    try:
        check_reward(value)
    except BadRewardError as err:
        raise RemoteRewardError(f"{url} answered a reward that is not a finite number the trainer can use ({err})") from None
    return float(value)


def with_remote_reward(env_factory: Callable[[], Environment], remote: RemoteReward) -> Callable[[], Environment]:
    """``env_factory`` whose environments add the remote score to their reward components."""

    def make() -> Environment:
        env = env_factory()
        local = env.reward

        async def reward() -> dict[str, float]:
            own = await maybe_await(local())
            components = dict(own) if isinstance(own, Mapping) else {}
            if not components:  # a plain number is the environment's one component
                components = {"env": float(own)}
            score = await remote.score(env.task, list(env.messages), components)
            return {**components, remote.settings.name: score}

        env.reward = reward
        return env

    return make
