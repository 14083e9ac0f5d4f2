"""Grouped admission (scheduler.py): while rows run, waiting sequences join once the oldest has waited
``admit_wait_ratio`` admissions' cost, or at once when they fill the free rows or nothing runs. The worker's
steps are driven by hand here (its thread never starts), so every decision is deterministic."""

from __future__ import annotations

import time

import pytest

from agentrl.engine.null_model import NullRunner, NullScript
from agentrl.engine.protocol import SamplingParams
from agentrl.engine.scheduler import Sequence


@pytest.fixture
def engine(tiny_model):
    from agentrl.engine.engine import Engine, EngineConfig

    runner = NullRunner(str(tiny_model), NullScript(replies=[[10, 11, 12]], marker=7))
    return Engine(EngineConfig(model_path=str(tiny_model), max_batch_size=4, lean_decode=False), runner=runner)


def sequence(new_tokens: int = 50) -> Sequence:
    return Sequence(prompt_ids=[3, 4, 5], params=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))


def test_a_busy_batch_keeps_a_fresh_arrival_waiting_until_its_wait_outweighs_an_admission(engine):
    scheduler = engine.scheduler
    first, second = sequence(), sequence()
    scheduler.submit(first)
    scheduler._admit()  # nothing runs: admitted at once
    assert scheduler.running == [first]
    scheduler.admit_seconds = 10.0  # admissions "cost" 10 s: a fresh arrival waits 40 s at ratio 4
    scheduler.submit(second)
    scheduler._admit()
    scheduler._decode_step()
    assert scheduler.running == [first] and list(scheduler.waiting) == [second]
    second.queued = time.monotonic() - 41.0  # it has waited longer than 4 admissions
    scheduler._admit()
    assert scheduler.running == [first, second] and not scheduler.waiting
    assert scheduler.admissions == 2


def test_arrivals_that_fill_the_free_rows_join_at_once_and_a_full_batch_admits_nobody(engine):
    scheduler = engine.scheduler
    scheduler.submit(sequence())
    scheduler._admit()
    scheduler.admit_seconds = 10.0
    for _ in range(3):  # max_batch_size 4: three waiting fill the free rows
        scheduler.submit(sequence())
    assert scheduler._admit_due()
    scheduler._admit()
    assert len(scheduler.running) == 4
    scheduler.submit(sequence())
    assert not scheduler._admit_due()  # no free row: the queue waits without stopping the steps


def test_ratio_zero_admits_before_every_step_and_a_negative_ratio_is_refused(engine):
    from agentrl.engine.scheduler import Scheduler

    scheduler = engine.scheduler
    scheduler.admit_wait_ratio = 0.0
    scheduler.submit(sequence())
    scheduler._admit()
    scheduler.admit_seconds = 10.0
    scheduler.submit(sequence())
    assert scheduler._admit_due()
    with pytest.raises(ValueError, match="admit_wait_ratio"):
        Scheduler(engine.runner, engine.prefix_cache, engine.metrics, weight_version=lambda: "v", admit_wait_ratio=-1)
