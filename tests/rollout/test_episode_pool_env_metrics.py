"""The fully-async episode pool reports the environment's ``rollout_metrics()`` hook in every batch's
metrics as ``env/<name>``, as the synchronous rollout does, also when the env factory is a wrapper; and it
refills itself between back-to-back takes."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentrl.envs.arithmetic import ArithmeticToolEnv, make_tasks
from agentrl.envs.render import ChatRenderer
from agentrl.models.tiny import TOKENIZER_DIR
from agentrl.rollout.buffer import DataBuffer, keep_all
from agentrl.rollout.episode_pool import EpisodePool
from agentrl.rollout.settings import RolloutSettings
from agentrl.run.config import RunConfig
from agentrl.trajectory import TurnRecord


class CountingEnv(ArithmeticToolEnv):
    """Counts its tool calls at class level, as a sandboxed env counts executions; the hook reports the
    count since its last call."""

    total = 0
    unreported = 0

    async def call_tool(self, call):
        type(self).total += 1
        type(self).unreported += 1
        await asyncio.sleep(0.001)
        return await super().call_tool(call)

    @classmethod
    def rollout_metrics(cls) -> dict[str, float]:
        out, cls.unreported = {"tool/calls": float(cls.unreported)}, 0
        return out


class PlainEnv(ArithmeticToolEnv):
    """No hook: no env/ metrics."""


class RightAnswers:
    """A scripted policy: ``add`` first, then ``submit`` the sum; every turn at weight version 0."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    async def generate(self, input_ids, *, session_id, sampling_params=None) -> TurnRecord:
        text = self.tokenizer.decode(list(input_ids))
        a, b = map(int, re.findall(r"What is (\d+)\+(\d+)\?", text)[-1])
        call = ({"name": "add", "arguments": {"a": a, "b": b}} if "<tool_response>" not in text
                else {"name": "submit", "arguments": {"answer": a + b}})
        out = self.tokenizer(f"<tool_call>{json.dumps(call)}</tool_call>").input_ids + [self.tokenizer.eos_token_id]
        await asyncio.sleep(0.001)
        return TurnRecord(tuple(input_ids), tuple(out), tuple(-0.5 for _ in out), "stop", "0")


class Tasks:
    def train(self, n: int, index: int) -> list[dict[str, Any]]:
        return make_tasks(n, seed=index, split="train", multi_turn=True)


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(TOKENIZER_DIR))


ROLLOUT = RolloutSettings(samples_per_prompt=2, prompts_per_step=2, concurrency=4, max_new_tokens=64)
SCHEDULE = RunConfig(schedule="fully_async", max_staleness=1)


def make_pool(renderer: ChatRenderer, env_factory: Any, engine: Any) -> EpisodePool:
    return EpisodePool(env_factory=env_factory, renderer=renderer, generate=engine.generate, task_source=Tasks(),
                       rollout=ROLLOUT, schedule=SCHEDULE, buffer=DataBuffer(keep_all)).start()


def _take_rows(renderer: ChatRenderer, env_factory: Any, steps: int) -> list[dict[str, float]]:
    engine = RightAnswers(renderer.tokenizer)

    async def main() -> list[dict[str, float]]:
        pool = make_pool(renderer, env_factory, engine)
        try:
            # no weight update here: every batch is for version 0, the version every turn carries
            return [(await pool.take(0))[1] for _ in range(steps)]
        finally:
            await pool.close()

    return asyncio.run(main())


def test_every_batch_carries_the_env_hook_through_a_wrapping_factory(renderer) -> None:
    CountingEnv.total = CountingEnv.unreported = 0

    def configured() -> CountingEnv:  # like the rollout manager's factory: a closure with no hooks
        return CountingEnv()

    rows = _take_rows(renderer, configured, steps=3)
    assert all("env/tool/calls" in row for row in rows)
    # each batch's groups called add (4 episodes of 2 groups at least): the hook saw them
    assert all(row["env/tool/calls"] >= 4 for row in rows)
    # nothing counted twice or lost: every call is in some row or still unreported at the end
    assert sum(row["env/tool/calls"] for row in rows) + CountingEnv.unreported == CountingEnv.total


def test_an_env_without_the_hook_adds_no_env_metrics(renderer) -> None:
    rows = _take_rows(renderer, PlainEnv, steps=1)
    assert not [k for k in rows[0] if k.startswith("env/")]


def test_back_to_back_takes_refill_the_pool_when_a_batchs_episodes_end_together(renderer) -> None:
    """A batch's episodes end within one loop iteration and the next take starts at once (no await between):
    the pool must count them as ended and start the next batch's episodes, not wait with nothing running. Each
    pool runs under a 10 s timeout, so a hang fails the test instead of stalling the suite (before the fix it
    timed out)."""
    engine = RightAnswers(renderer.tokenizer)

    async def main() -> None:
        for _ in range(20):
            pool = make_pool(renderer, PlainEnv, engine)
            try:
                async with asyncio.timeout(10):
                    for _ in range(3):
                        groups, _, episodes = await pool.take(0)
                        assert len(groups) == ROLLOUT.prompts_per_step
                        assert len(episodes) == ROLLOUT.prompts_per_step * ROLLOUT.samples_per_prompt
            finally:
                await pool.close()

    asyncio.run(main())
