"""Partial rollouts that continue (``partial_rollout: resume``): a sequence retracted at a weight update keeps
its tokens, is prefilled again on the new weights and goes on from its last sampled token; the answer says which
tokens each weight version drew (``meta_info.weight_version_spans``). The worker's steps are driven by hand."""

from __future__ import annotations

import concurrent.futures

import pytest

from agentrl.engine.generation import Generation
from agentrl.engine.null_model import NullRunner, NullScript
from agentrl.engine.protocol import SamplingParams
from agentrl.engine.scheduler import Sequence


@pytest.fixture
def engine(tiny_model):
    from agentrl.engine.engine import Engine, EngineConfig

    runner = NullRunner(str(tiny_model), NullScript(replies=[list(range(10, 40))], marker=7))
    engine = Engine(EngineConfig(model_path=str(tiny_model), max_batch_size=4, lean_decode=False), runner=runner)

    def at_once(fn):  # the worker thread never starts: controls run where they are called
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(fn())
        return fut

    engine.scheduler.call = at_once
    return engine


def run_to_end(scheduler) -> None:
    while scheduler.running or scheduler.waiting:
        scheduler._admit()
        if scheduler.running:
            scheduler._decode_step()


def started(engine, new_tokens: int = 12, steps: int = 4) -> Sequence:
    seq = Sequence(prompt_ids=[3, 4, 5], params=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    engine.scheduler.submit(seq)
    engine.scheduler._admit()
    for _ in range(steps):
        engine.scheduler._decode_step()
    assert len(seq.output_ids) == steps + 1
    return seq


def test_a_retracted_turn_goes_on_from_its_last_token_on_the_new_weights(engine):
    seq = started(engine)
    drawn = list(seq.output_ids)
    engine.scheduler.pause("retract")
    assert list(engine.scheduler.waiting) == [seq] and not engine.scheduler.running
    engine.weight_version = "v1"
    engine.scheduler.resume()
    run_to_end(engine.scheduler)
    assert seq.finished and len(seq.output_ids) == 12 and seq.output_ids[:5] == drawn  # kept, then continued
    meta = Generation(engine).result(seq, return_logprob=True)["meta_info"]
    assert meta["weight_version_spans"] == [[0, "default"], [5, "v1"]]
    assert meta["weight_version"] == "v1" and meta["completion_tokens"] == 12


def test_weights_changed_under_rows_paused_in_place_start_a_span_too(engine):
    seq = started(engine, steps=2)
    engine.scheduler.pause("in_place")
    engine.weight_version = "v2"
    engine.scheduler.resume()
    run_to_end(engine.scheduler)
    assert Generation(engine).result(seq, return_logprob=False)["meta_info"]["weight_version_spans"] == [
        [0, "default"], [3, "v2"]]


def test_a_turn_of_one_version_reports_one_span(engine):
    seq = started(engine, steps=1)
    run_to_end(engine.scheduler)
    assert Generation(engine).result(seq, return_logprob=False)["meta_info"]["weight_version_spans"] == [[0, "default"]]
