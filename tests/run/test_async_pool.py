"""The fully-async episode pool (agentrl.rollout.episode_pool) against a scripted engine that reports a
weight version per turn and obeys SGLang's pause semantics: the staleness bound, aborted turns re-queued
with their episodes intact, per-token versions equal to the engine's reports, dynamic sampling's cap."""

from __future__ import annotations

import asyncio
import random
import re
from collections import defaultdict
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentrl.envs.arithmetic import ArithmeticToolEnv, make_tasks
from agentrl.envs.render import ChatRenderer
from agentrl.models.tiny import TOKENIZER_DIR
from agentrl.rollout.buffer import (
    DataBuffer,
    group_lag,
    has_reward_variance,
    keep_all,
    staleness_metrics,
    trained_token_versions,
)
from agentrl.rollout.episode_pool import EpisodePool
from agentrl.rollout.settings import RolloutSettings
from agentrl.run.config import RunConfig
from agentrl.trajectory import MODEL, StopReason, TurnRecord


class SlowToolEnv(ArithmeticToolEnv):
    """``add`` sleeps a seeded heavy-tailed time, so episodes straddle weight updates."""

    rng = random.Random(7)

    async def call_tool(self, call):
        await asyncio.sleep(min(0.3, 0.004 * 2.0 ** (self.rng.random() * 6)))  # 4 ms .. 256 ms
        return await super().call_tool(call)


class ScriptedEngine:
    """Answers each prompt like a policy that is right with probability ``p_right``; every reply is
    stamped with the current weight version; ``pause("abort")`` aborts what is being generated."""

    def __init__(self, tokenizer: Any, *, p_right: float = 0.6, seed: int = 0, gen_s: float = 0.01) -> None:
        self.tokenizer, self.p_right, self.gen_s = tokenizer, p_right, gen_s
        self.rng = random.Random(seed)
        self.version = 0
        self.paused = asyncio.Event()
        self.paused.set()  # set = running
        self.in_flight: dict[int, asyncio.Event] = {}
        self.reported: dict[str, list[tuple[str, str]]] = defaultdict(list)  # session -> [(finish, version)]
        self.aborted_sessions: set[str] = set()
        self._n = 0

    def _reply(self, prompt_ids: list[int]) -> str:
        text = self.tokenizer.decode(prompt_ids)
        a, b = map(int, re.findall(r"What is (\d+)\+(\d+)\?", text)[-1])
        if "<tool_response>" not in text:
            call = {"name": "add", "arguments": {"a": a, "b": b}}
        else:
            answer = a + b if self.rng.random() < self.p_right else a + b + 1
            call = {"name": "submit", "arguments": {"answer": answer}}
        import json

        return f"<tool_call>{json.dumps(call)}</tool_call>"

    async def generate(self, input_ids, *, session_id, sampling_params=None) -> TurnRecord:
        await self.paused.wait()
        self._n += 1
        key, stop = self._n, asyncio.Event()
        self.in_flight[key] = stop
        try:
            with_eos = self.tokenizer(self._reply(list(input_ids))).input_ids + [self.tokenizer.eos_token_id]
            try:
                await asyncio.wait_for(stop.wait(), self.gen_s * (1 + self.rng.random()))
                aborted = True
            except TimeoutError:
                aborted = False
            out = with_eos[: len(with_eos) // 2] if aborted else with_eos
            finish = "abort" if aborted else "stop"
            version = str(self.version)
            self.reported[session_id].append((finish, version))
            if aborted:
                self.aborted_sessions.add(session_id)
            return TurnRecord(tuple(input_ids), tuple(out), tuple(-0.5 for _ in out), finish, version)
        finally:
            del self.in_flight[key]

    def control(self, mode: str) -> None:  # called from a worker thread, as the router's fan-out is
        loop = self.loop
        if mode == "abort":
            loop.call_soon_threadsafe(lambda: [e.set() for e in self.in_flight.values()])
        if mode:
            loop.call_soon_threadsafe(self.paused.clear)
        else:
            loop.call_soon_threadsafe(self.paused.set)


class FiniteTasks:
    """``batches`` batches of seeded arithmetic tasks, then nothing."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def train(self, n: int, index: int) -> list[dict[str, Any]]:
        return make_tasks(n, seed=index, split="train", multi_turn=True) if index < self.batches else []


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(TOKENIZER_DIR))


ROLLOUT_KEYS = set(RolloutSettings.model_fields)


def make_pool(renderer, engine, *, batches=1000, group_filter=keep_all, **overrides) -> EpisodePool:
    """A fully_async pool: 4 tasks x 4 episodes a batch, 16 in flight, the rest from ``overrides`` (a field
    of RolloutSettings or a schedule field of RunConfig, by name)."""
    settings = dict(samples_per_prompt=4, prompts_per_step=4, concurrency=16, max_staleness=1, max_new_tokens=64)
    settings.update(overrides)
    rollout = RolloutSettings(**{k: v for k, v in settings.items() if k in ROLLOUT_KEYS})
    schedule = RunConfig(schedule="fully_async", **{k: v for k, v in settings.items() if k not in ROLLOUT_KEYS})
    return EpisodePool(env_factory=SlowToolEnv, renderer=renderer, generate=engine.generate,
                       task_source=FiniteTasks(batches), rollout=rollout, schedule=schedule,
                       buffer=DataBuffer(group_filter), engine_control=engine.control)


async def train_steps(pool: EpisodePool, engine: ScriptedEngine, steps: int, train_s: float = 0.05):
    """A trainer: take a batch for version v, 'train', then pause, move the engine to v + 1, continue."""
    engine.loop = asyncio.get_running_loop()
    pool.start()
    batches = []
    for step in range(steps):
        groups, metrics, episodes = await pool.take(step)
        batches.append((step, groups, metrics))
        await asyncio.sleep(train_s)
        await pool.pause()
        engine.version = step + 1
        await pool.resume()
    return batches


@pytest.mark.parametrize("stale_groups", ["drop", "regenerate"])
def test_no_trained_token_is_older_than_max_staleness(renderer, stale_groups: str) -> None:
    engine = ScriptedEngine(renderer.tokenizer)
    pool = make_pool(renderer, engine, max_staleness=1, stale_groups=stale_groups, concurrency=32)

    async def go():
        try:
            return await train_steps(pool, engine, steps=10, train_s=0.08)
        finally:
            await pool.close()

    batches = asyncio.run(go())
    stale = sum(m["rollout/stale_groups"] for _, _, m in batches)
    assert stale > 0  # the workload does produce groups older than the bound: the bound is exercised
    lags = []
    for step, groups, metrics in batches:
        for group in groups:
            lag = group_lag(group, step)
            assert lag is not None and 0 <= lag <= 1
            lags.append(lag)
        assert metrics["rollout/staleness_max"] == staleness_metrics([s for g in groups for s in g], step)["rollout/staleness_max"] <= 1
        assert len(groups) == 4  # without dynamic sampling a batch is the next 4 fresh groups (keep_all)
    assert 1 in lags  # episodes did continue across updates and were trained one version late
    if stale_groups == "regenerate":
        assert sum(m["rollout/stale_groups_regenerated"] for _, _, m in batches) == stale
    else:
        assert sum(m["rollout/stale_groups_regenerated"] for _, _, m in batches) == 0


def test_aborted_turns_are_all_requeued_and_versions_match_the_engine(renderer) -> None:
    engine = ScriptedEngine(renderer.tokenizer, gen_s=0.03)
    n_batches = 6  # 6 x 4 tasks x 4 episodes, every group taken (no staleness drop: max_staleness 100)
    pool = make_pool(renderer, engine, batches=n_batches, partial_rollout="abort", max_staleness=100, concurrency=32)

    async def go():
        try:
            return await train_steps(pool, engine, steps=n_batches, train_s=0.02)
        finally:
            counts = dict(pool.counts)
            await pool.close()
            return_value.append(counts)

    return_value: list[dict] = []
    batches = asyncio.run(go())
    counts = return_value[0]
    n_episodes = n_batches * 4 * 4
    assert counts["episodes_started"] == counts["episodes_ended"] == n_episodes  # count in = count out
    assert counts["turns_aborted"] > 0 and counts["turns_requeued"] == counts["turns_aborted"]
    assert sum(m["rollout/turns_aborted"] for _, _, m in batches) == counts["turns_aborted"]
    samples = [s for _, groups, _ in batches for g in groups for s in g]
    assert len({s.session_id for s in samples}) == n_episodes  # every episode came out with its sample
    assert engine.aborted_sessions <= {s.session_id for s in samples}
    for s in samples:
        assert s.metadata["stop_reason"] != StopReason.ABORT and "abort" not in s.metadata["finish_reasons"]
        # the engine's answers to this session, without the aborted ones: exactly the recorded turns
        served = [version for finish, version in engine.reported[s.session_id] if finish != "abort"]
        for run in s.provenance.runs:
            if run.source == MODEL:
                assert run.weight_version == served[run.turn]
        assert sum(trained_token_versions(s).values()) == s.trained_tokens
    versions = {v for s in samples for v in trained_token_versions(s)}
    assert len(versions) > 1  # weights did change under these episodes


def test_continue_mode_waits_for_turns_being_generated(renderer) -> None:
    engine = ScriptedEngine(renderer.tokenizer, gen_s=0.03)
    pool = make_pool(renderer, engine, partial_rollout="continue", max_staleness=100)

    async def go():
        try:
            return await train_steps(pool, engine, steps=4)
        finally:
            await pool.close()

    asyncio.run(go())
    assert all(f != "abort" for turns in engine.reported.values() for f, _ in turns)
    assert pool.counts["turns_aborted"] == 0


def test_dynamic_sampling_fills_the_batch_with_mixed_groups_within_the_cap(renderer) -> None:
    engine = ScriptedEngine(renderer.tokenizer, p_right=0.3)  # many groups all wrong: zero variance
    pool = make_pool(renderer, engine, group_filter=has_reward_variance, dynamic_sampling=True,
                     max_oversample=3.0, max_staleness=100)

    async def go():
        try:
            return await train_steps(pool, engine, steps=5)
        finally:
            await pool.close()

    batches = asyncio.run(go())
    assert any(m["rollout/oversampled_groups"] > 0 for _, _, m in batches)  # refill happened
    for _, groups, m in batches:
        assert all(has_reward_variance(g) for g in groups)
        assert m["rollout/groups_considered"] <= 12  # the cap: 3 x 4 groups
        assert len(groups) == 4 or m["rollout/groups_considered"] == 12
        assert m["rollout/groups_kept"] == len(groups)


def test_the_schedule_fields_refuse_nonsense() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_staleness"):
        RunConfig(max_staleness=-1)
    with pytest.raises(ValidationError, match="partial_rollout"):
        RunConfig(partial_rollout="keep")
