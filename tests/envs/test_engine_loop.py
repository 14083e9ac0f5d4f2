"""The agent loop against the real embedded engine over HTTP (``/generate``, SGLang native API)."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.envs.arithmetic import ArithmeticToolEnv, make_tasks
from agentrl.envs.loop import generate_rollout
from agentrl.trajectory import TrajectoryManager, TurnRecord, verify_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    launch = pytest.importorskip("agentrl.engine.launch")
    with launch.EngineProcess(tiny_model_dir) as proc:
        yield proc


class HttpGenerate:
    """``generate`` over plain aiohttp: one POST /generate per turn, session id as the routing key."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.turns: dict[str, list[TurnRecord]] = {}

    async def __call__(self, input_ids, *, session_id, sampling_params=None):
        import aiohttp

        body = {"input_ids": list(input_ids), "sampling_params": sampling_params or {}, "return_logprob": True}
        async with aiohttp.ClientSession() as http, http.post(
            self.url + "/generate", json=body, headers={"X-SMG-Routing-Key": session_id}
        ) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
        meta = out["meta_info"]
        served = meta["output_token_logprobs"]
        assert [t for _, t, _ in served] == out["output_ids"]
        record = TurnRecord(prompt_ids=list(input_ids), output_ids=out["output_ids"],
                            output_logprobs=[lp for lp, _, _ in served],
                            finish_reason=meta["finish_reason"]["type"], weight_version=meta.get("weight_version"))
        self.turns.setdefault(session_id, []).append(record)
        return record


def test_episodes_through_the_engine_verify(engine, renderer):
    class Nudge(ArithmeticToolEnv):
        max_turns = 2

        def on_text_response(self, text):
            return [{"role": "user", "content": "Use a tool."}]

    generate = HttpGenerate(engine.url)
    manager = TrajectoryManager()
    result = asyncio.run(generate_rollout(
        Nudge, make_tasks(2, seed=13, multi_turn=True), generate, renderer, n_samples_per_task=1,
        concurrency=2, trajectory_manager=manager, max_context_tokens=512,
        sampling_params={"temperature": 1.0, "max_new_tokens": 16},
    ))
    assert result.summary()["failed"] == 0, [e.metrics.error for e in result.episodes]
    assert [len({e.group_id for e in g}) for g in result.groups] == [1, 1]
    for episode in result.episodes:
        turns = generate.turns[episode.session_id]
        assert len(turns) == episode.metrics.turns == 2
        verify_session(episode.samples, turns)
        for sample in episode.samples:
            for mask, prov in zip(sample.loss_mask, sample.provenance[sample.response_start:], strict=True):
                assert not mask or prov.source == "model"


def test_search_r1_episode_through_the_engine_verifies(engine, renderer):
    pytest.importorskip("bm25s")
    pytest.importorskip("countryinfo")
    from examples.search_r1.env import SearchR1Env
    from examples.search_r1.questions import make_questions

    generate = HttpGenerate(engine.url)
    tasks = make_questions(2, split="heldout", seed=1)
    result = asyncio.run(generate_rollout(
        SearchR1Env, tasks, generate, renderer, concurrency=2, max_context_tokens=512,
        sampling_params={"temperature": 1.0, "max_new_tokens": 24},
    ))
    assert result.summary()["failed"] == 0, [e.metrics.error for e in result.episodes]
    for episode in result.episodes:
        assert episode.metrics.turns >= 1
        verify_session(episode.samples, generate.turns[episode.session_id])
