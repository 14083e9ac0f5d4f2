"""A turn continued across a weight update (``partial_rollout: resume``) reaches the trainer with per-token
weight versions: the engine's ``meta_info.weight_version_spans`` -> the rollout client's ``TurnRecord`` -> the
sample's provenance, re-proved by ``verify`` and counted token by token in the staleness metrics.

The engine is the real one (null model, scheduler steps driven by hand, as in
``tests/engine/test_resume_partial.py``); its answer is the JSON the server sends for it."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from agentrl.engine.generation import Generation
from agentrl.engine.null_model import NullRunner, NullScript
from agentrl.engine.protocol import SamplingParams
from agentrl.engine.scheduler import Sequence
from agentrl.rollout.buffer import staleness_metrics, trained_token_versions
from agentrl.rollout.client import MalformedResponseError, RolloutClient, parse_generate_response
from agentrl.trajectory import MODEL, ProvenanceError, Sample, TrajectoryManager, verify

PROMPT = [3, 4, 5]


@pytest.fixture
def engine(tiny_model_dir):
    from agentrl.engine.engine import Engine, EngineConfig

    runner = NullRunner(str(tiny_model_dir), NullScript(replies=[list(range(10, 40))], marker=7))
    engine = Engine(EngineConfig(model_path=str(tiny_model_dir), max_batch_size=4, lean_decode=False), runner=runner)

    def at_once(fn):  # the worker thread never starts: controls run where they are called
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(fn())
        return fut

    engine.scheduler.call = at_once
    engine.weight_version = "0"
    return engine


def resumed_answer(engine, *, before: int = 5, total: int = 12) -> dict:
    """Draw ``before`` tokens on version "0", retract at an update to "1", finish: the server's JSON answer."""
    scheduler = engine.scheduler
    seq = Sequence(prompt_ids=list(PROMPT), params=SamplingParams(max_new_tokens=total, ignore_eos=True))
    scheduler.submit(seq)
    scheduler._admit()
    for _ in range(before - 1):
        scheduler._decode_step()
    scheduler.pause("retract")
    engine.weight_version = "1"
    scheduler.resume()
    while scheduler.running or scheduler.waiting:
        scheduler._admit()
        if scheduler.running:
            scheduler._decode_step()
    return json.loads(json.dumps(Generation(engine).result(seq, return_logprob=True)))


def test_a_resumed_turns_sample_carries_both_versions_at_the_update(engine):
    answer = resumed_answer(engine)
    assert answer["meta_info"]["weight_version_spans"] == [[0, "0"], [5, "1"]]
    turn = parse_generate_response(PROMPT, answer).turn
    assert turn.weight_version == "1" and turn.weight_version_spans == ((0, "0"), (5, "1"))
    assert [turn.version_at(j) for j in range(12)] == ["0"] * 5 + ["1"] * 7

    manager = TrajectoryManager()
    manager.record_turn("s", turn=turn, prompt_messages=[{"role": "user", "content": "q"}],
                        response_message={"role": "assistant", "content": "a"})
    (sample,) = manager.get_trajectory("s", reward=1.0)
    n = len(PROMPT)
    model_runs = [tuple(r) for r in sample.provenance.runs if r.source == MODEL]
    assert model_runs == [(n, n + 5, MODEL, 0, "0"), (n + 5, n + 12, MODEL, 0, "1")]
    assert sample.metadata["weight_versions"] == ["0", "1"]
    verify(sample, [turn])
    verify(Sample.from_json(sample.to_json()), [turn])  # survives the trip to the trainer

    # staleness is per token: 5 tokens one step behind the trainer at version 1, 7 fresh
    assert trained_token_versions(sample) == {0: 5, 1: 7}
    metrics = staleness_metrics([sample], trainer_version=1)
    assert metrics["rollout/staleness_hist/0"] == 7 and metrics["rollout/staleness_hist/1"] == 5
    assert metrics["rollout/staleness_max"] == 1

    # verify proves the versions: one token claimed by the wrong version is named
    runs = sample.provenance.to_list()
    k = next(i for i, r in enumerate(runs) if r[4] == "1")
    runs[k - 1][1] += 1  # the first token of version "1" relabelled "0"
    runs[k][0] += 1
    forged = Sample.from_dict({**sample.to_dict(), "provenance": runs})
    with pytest.raises(ProvenanceError, match="provenance") as info:
        verify(forged, [turn])
    assert info.value.index == n + 5


@pytest.mark.parametrize(
    ("spans", "match"),
    [
        ([[0, "0"], [12, "1"]], "starts at 12, outside the 12 output ids"),
        ([[2, "0"], [5, "1"]], "must start at token 0"),
        ([[0, "0"], [5, "1"], [5, "2"]], "strictly increase"),
        ([[0, "1"], [5, "0"]], "go back from version '1' to '0'"),
        ([[0, "0"], [5, None]], "version must be a str"),
        ({"0": "0"}, "pairs, got dict"),
    ],
)
def test_bad_spans_from_the_engine_are_a_clear_error_for_that_turn(engine, spans, match):
    answer = resumed_answer(engine)
    answer["meta_info"]["weight_version_spans"] = spans
    with pytest.raises((ValueError, TypeError), match=match):  # the client makes either a MalformedResponseError
        parse_generate_response(PROMPT, answer)


def test_the_client_reports_bad_spans_as_a_malformed_answer(engine, monkeypatch):
    answer = resumed_answer(engine)
    answer["meta_info"]["weight_version_spans"] = [[0, "0"], [99, "1"]]
    client = RolloutClient("http://127.0.0.1:9")  # never reached: the answer is handed in below

    async def post(payload, headers):
        return answer

    monkeypatch.setattr(client, "_post_generate", post)

    import asyncio

    with pytest.raises(MalformedResponseError, match="starts at 99, outside the 12 output ids"):
        asyncio.run(client.generate(PROMPT, {"max_new_tokens": 12}, session_id="s"))
