"""The decode loop's host work per step on the captured-graph path (issue 40), observable on CPU: the runner's
captured step is replayed eagerly here (as in test_static_kv.py), and the runner's and scheduler's counters
(``ModelRunner.stats``, ``Scheduler.stats``) say what each step cost the host: a replay and one collect of
its numbers, no rewrite of the step's inputs, no new capture once a batch size's step exists."""

from __future__ import annotations

import threading

import pytest
import torch

from agentrl.engine.model_runner import ModelRunner
from agentrl.engine.protocol import SamplingParams
from agentrl.engine.scheduler import Sequence


class _EagerGraph:
    def __init__(self, step) -> None:
        self.step = step

    def replay(self) -> None:
        self.step["forward"]()


class _Inline:
    def call_soon_threadsafe(self, fn) -> None:
        fn()


@pytest.fixture
def engine(tiny_model, monkeypatch):
    from agentrl.engine.engine import Engine, EngineConfig

    runner = ModelRunner(str(tiny_model), dtype="float32", device="cpu", static_kv=True)
    runner.cuda_graphs = True

    def capture(step):
        with torch.inference_mode():
            step["forward"]()  # the real capture's warm-up: advances the inputs
        step["graph"] = _EagerGraph(step)
        runner.stats["captures"] += 1

    monkeypatch.setattr(runner, "_capture", capture)
    engine = Engine(EngineConfig(str(tiny_model), device="cpu", static_kv=True, max_batch_size=8), runner=runner)
    yield engine
    engine.shutdown()


def _sequence(prompt: list[int], new_tokens: int) -> Sequence:
    seq = Sequence(prompt_ids=prompt, loop=_Inline(), stream=True,
                   params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True))
    seq.done = threading.Event()
    seq.notify = lambda: seq.finished and seq.done.set()
    return seq


def _run(engine, seqs: list[Sequence]) -> dict:
    before = engine.scheduler.stats()
    engine.scheduler.pause("in_place")  # all join in one admission, whatever the worker thread's timing
    for seq in seqs:
        engine.scheduler.submit(seq)
    engine.scheduler.resume()
    assert all(seq.done.wait(60) for seq in seqs)
    after = engine.scheduler.stats()
    return {k: after[k] - before[k] for k in after}


def test_a_steady_batch_costs_one_replay_and_one_collect_per_step_and_no_input_writes(engine):
    engine.start()
    # every batch size's step (buckets 1, 2, 4, 8 for max_batch_size 8) was captured before serving
    assert engine.runner.stats["captures"] == 4
    assert sorted(key[0] for key in engine.runner._graphs) == [1, 2, 4, 8]
    prompts = [[1] + [10 + 7 * i + j for j in range(6 + i)] for i in range(8)]
    first = _run(engine, [_sequence(p, 24) for p in prompts])
    assert first["runner_eager_steps"] == 0 and first["decode_steps"] == 23  # one prefill token, 23 steps
    assert first["runner_graph_steps"] == first["decode_steps"]
    # every step's inputs stay on the device: written once (the rows are new), then the graph feeds itself;
    # nothing captured while serving
    assert first["runner_input_writes"] == 1 and first["runner_captures"] == 0 and first["admissions"] == 1
    assert first["pipelined_steps"] > 0
    # the same batch again: the captured step is reused, nothing captured
    again = _run(engine, [_sequence([2, *p[1:]], 24) for p in prompts])
    assert again["runner_captures"] == 0 and again["runner_input_writes"] == 1
    assert again["runner_graph_steps"] == again["decode_steps"] == 23


def test_with_a_fused_prefill_cached_rows_prefill_apart_and_a_short_cached_prefix_is_not_used(engine, hf_model,
                                                                                             hf_logprobs):
    """A runner with its own prefill for new sequences (``fused_prefill``, CUDA) gets them in one call and the
    rows with a cached past in another (one past would send the whole group through transformers' forward);
    a cached prefix under MIN_CACHED_PREFIX_TOKENS is not used (random prompts hit one token of a warm cache).
    The rows' log-probs are still the plain forward's (fp32, tolerance: summation order)."""
    from agentrl.engine.scheduler import MIN_CACHED_PREFIX_TOKENS

    runner = engine.runner
    calls: list[list[bool]] = []
    plain = runner.prefill

    def prefill(items):  # records which rows had a past; the CPU runner's own prefill computes them
        calls.append([past is not None for _, past in items])
        runner.fused_prefill = False
        try:
            return plain(items)
        finally:
            runner.fused_prefill = True

    runner.prefill, runner.fused_prefill = prefill, True
    engine.start()
    first = [1] + list(range(100, 140))
    _run(engine, [_sequence(first, 4)])
    follow = _sequence(first + [7, 8, 9], 4)  # extends a cached row: a long hit
    other = _sequence([1, 3] + list(range(300, 330)), 4)  # shares one token with it: a short hit
    fresh = _sequence([2] + list(range(500, 520)), 4)
    calls.clear()
    _run(engine, [follow, other, fresh])
    assert sorted(calls) == [[False, False], [True]]
    assert follow.cached_tokens >= MIN_CACHED_PREFIX_TOKENS and other.cached_tokens == 0
    for seq in (follow, other, fresh):
        ref = hf_logprobs(hf_model, seq.prompt_ids, seq.output_ids)
        assert max(abs(a - b) for a, b in zip(seq.output_logprobs, ref, strict=True)) < 1e-4
