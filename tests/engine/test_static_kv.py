"""StaticBatchKV (fixed KV buffers, the CUDA-graph decode layout) decodes exactly like the plain left-padded
BatchKV and like HF, through rows joining, leaving, compaction and buffer growth; here eagerly on CPU (the
graph replays the same step)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from agentrl.engine.model_runner import BatchKV, ModelRunner, StaticBatchKV, decode_bucket

TOL = 1e-5  # fp32; attention over masked extra columns changes only the summation order


@pytest.fixture(scope="module")
def runners(tiny_model):
    plain = ModelRunner(str(tiny_model), dtype="float32", device="cpu", static_kv=False)
    static = ModelRunner(str(tiny_model), dtype="float32", device="cpu", static_kv=True)
    static.static_rows = 2  # tiny buffers: joining rows must grow them
    return plain, static


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("leave", ["select", "remove"])  # remove: holes filled by the last rows (the scheduler's)
def test_static_batch_decodes_like_the_padded_batch_through_joins_leaves_and_growth(runners, leave):
    plain, static = runners
    assert isinstance(static.empty_batch(), StaticBatchKV) and isinstance(plain.empty_batch(), BatchKV)
    rng = random.Random(0)
    # a longer prompt joins later (rows shift right); the longest row leaves, then the width hits the buffer's
    # 48 columns (rows shift left into the freed columns); later the rows outgrow it (the buffer grows)
    prompts = [[1] + [rng.randrange(3, 1000) for _ in range(n - 1)] for n in (10, 20, 5, 40, 8, 30, 12)]
    a, b = plain.empty_batch(), static.empty_batch()
    assert b.rows == 0  # an empty batch holds no buffers
    b._initial = (2, 48)  # start narrow: decoding past 48 columns must compact or grow
    tokens: list[int] = []
    for step in range(60):
        if step in (0, 5, 23):  # rows join (different lengths: the batch widens, rows shift right)
            new = prompts[: 3] if step == 0 else prompts[3:5] if step == 5 else prompts[5:]
            _, kvs = plain.prefill([(p, None) for p in new])
            a, b = a.extend(kvs), b.extend(kvs)
            tokens += [rng.randrange(3, 1000) for _ in new]
        if step in (12, 40):  # rows leave (the longest first: columns become padding in every row)
            keep = [i for i in range(len(tokens)) if i != 0 and i != len(tokens) - 2]
            if leave == "remove":
                keep = b.remove([0, len(tokens) - 2])
                assert sorted(keep) == [i for i in range(len(tokens)) if i != 0 and i != len(tokens) - 2]
                a = a.select(keep)
            else:
                a, b = a.select(keep), b.select(keep)
            tokens = [tokens[i] for i in keep]
        la, a = plain.decode(a, tokens)
        lb, b = static.decode(b, tokens)
        assert a.lengths == b.lengths
        assert (_logprobs(la) - _logprobs(lb)).abs().max().item() < TOL, step
        for i in range(len(tokens)):  # each row's KV is the same tokens' KV
            for (ka, va), (kb, vb) in zip(a.row(i), b.row(i), strict=True):
                assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
        tokens = la.argmax(-1).tolist()
    assert b.rows >= 5 and b.columns > 48  # the buffers did grow, in rows and in columns


def test_decode_buckets_cover_every_size():
    assert [decode_bucket(n) for n in (1, 3, 17, 64, 65, 256, 600)] == [1, 4, 24, 64, 96, 256, 640]


def test_engine_with_static_kv_returns_hf_log_probs(tiny_model, hf_model, hf_logprobs, server_thread):
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 30))] for _ in range(6)]
    sp = {"max_new_tokens": 10, "temperature": 1.1, "ignore_eos": True}
    with server_thread(tiny_model, static_kv=True, max_batch_size=8) as server:
        assert isinstance(server.engine.scheduler.batch, StaticBatchKV)

        def generate(p):
            r = httpx.post(server.url + "/generate", json={"input_ids": p, "sampling_params": sp,
                                                            "return_logprob": True}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(generate, prompts))
    for p, out in zip(prompts, outs, strict=True):
        ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(hf_model, p, out["output_ids"], 1.1)
        assert len(ours) == len(ref) == 10
        assert max(abs(x - y) for x, y in zip(ours, ref, strict=True)) < TOL


def test_releasing_kv_memory_frees_the_static_buffers_and_decoding_resumes(tiny_model, hf_model, hf_logprobs,
                                                                           server_thread):
    """Colocated runs release KV memory between rollouts: the static buffers and captured steps go with it."""
    sp = {"max_new_tokens": 6, "temperature": 0.9, "ignore_eos": True}
    prompt = [1, 5, 77, 300, 12]
    with server_thread(tiny_model, static_kv=True, max_batch_size=4) as server:
        def generate():
            r = httpx.post(server.url + "/generate", json={"input_ids": prompt, "sampling_params": sp,
                                                            "return_logprob": True}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        generate()
        engine = server.engine
        assert engine.scheduler.batch.rows > 0 and engine.runner._graphs  # buffers and steps kept between requests
        engine.release_memory(["kv_cache"])
        assert engine.scheduler.batch.rows == 0 and not engine.runner._graphs
        engine.resume_memory(["kv_cache"])
        out = generate()
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    ref = hf_logprobs(hf_model, prompt, out["output_ids"], 0.9)
    assert max(abs(x - y) for x, y in zip(ours, ref, strict=True)) < TOL



class _EagerGraph:
    """Stands in for a captured step on CPU: replays by running the step's function."""

    def __init__(self, step) -> None:
        self.step = step

    def replay(self) -> None:
        self.step["forward"]()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused decode step is a captured CUDA graph"))])
def test_fused_decode_step_draws_tokens_with_the_plain_forwards_log_probs(tiny_model, device, monkeypatch):
    """``decode_sample`` (the token drawn and its log-prob taken inside the captured step, inputs kept on the
    device between steps) returns the log-prob a plain decode gives the same token at the row's temperature,
    greedy rows the argmax, through rows leaving and joining (the device inputs are rewritten then). On CPU
    the step's function is replayed eagerly in place of a graph."""
    from agentrl.engine.protocol import SamplingParams

    fused = ModelRunner(str(tiny_model), dtype="float32", device=device)
    plain = ModelRunner(str(tiny_model), dtype="float32", device=device, static_kv=False)
    if device == "cpu":
        assert fused.decode_sample(fused.empty_batch(), [], [], []) is None  # no graphs on CPU: the host samples
        fused.static_kv, fused.cuda_graphs = True, True

        def capture(step):
            with torch.inference_mode():
                step["forward"]()  # the real capture's warm-up: advances the inputs
            step["graph"] = _EagerGraph(step)

        monkeypatch.setattr(fused, "_capture", capture)
    assert fused.cuda_graphs and fused.static_kv
    writes = []
    write = fused._write_fused_inputs
    monkeypatch.setattr(fused, "_write_fused_inputs", lambda *a: writes.append(1) or write(*a))
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 1000) for _ in range(n)] for n in (9, 25, 4, 14, 30)]
    params = [SamplingParams(temperature=t) for t in (0.7, 1.0, 0.0, 1.3, 1.0)]
    _, kvs = plain.prefill([(p, None) for p in prompts[:3]])
    a, b = plain.empty_batch().extend(kvs), fused.empty_batch().extend(kvs)
    rows = [0, 1, 2]
    tokens = [rng.randrange(3, 1000) for _ in rows]
    for step in range(12):
        if step == 4:  # row 1 leaves
            keep = [0, 2]
            a, b, rows, tokens = a.select(keep), b.select(keep), [rows[i] for i in keep], [tokens[i] for i in keep]
        if step == 7:  # two rows join
            _, kvs = plain.prefill([(p, None) for p in prompts[3:]])
            a, b, rows, tokens = a.extend(kvs), b.extend(kvs), rows + [3, 4], tokens + [5, 6]
        ref, a = plain.decode(a, tokens)
        drawn, logprobs = fused.decode_sample(b, tokens, [params[r] for r in rows], [None] * len(rows))
        assert a.lengths == b.lengths
        for i, r in enumerate(rows):
            temp = 1.0 if params[r].greedy else params[r].temperature
            expect = torch.log_softmax(ref[i].float() / temp, -1)
            if params[r].greedy:
                assert drawn[i] == int(ref[i].argmax())
            assert abs(logprobs[i] - expect[drawn[i]].item()) < TOL, (step, r)
        tokens = drawn
    assert fused._graphs and all(key[2] for key in fused._graphs)  # the fused steps ran, captured
    # inputs written at each step's capture (twice) and when the rows changed, not at every step
    assert len(writes) == 5
    seeded = [SamplingParams(temperature=1.0)] * len(rows)
    assert fused.decode_sample(b, tokens, seeded, [torch.Generator(device)] + [None] * (len(rows) - 1)) is None
    top_p = [SamplingParams(temperature=1.0, top_p=0.9)] * len(rows)
    assert fused.decode_sample(b, tokens, top_p, [None] * len(rows)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured CUDA graphs")
def test_steps_captured_after_the_graphs_were_dropped_keep_the_plain_forwards_log_probs(tiny_model):
    """Dropping every captured step (a memory release; weights that moved) frees their graph pool. Steps
    captured after that still replay to the plain decode's log-probs, captured and not eager: nothing the
    new captures use (cuBLAS's workspace included) lived in the freed pool (2026-12-03: a capture after a
    colocated release failed in cuBLAS, and the engine decoded eagerly from then on)."""
    from agentrl.engine.protocol import SamplingParams

    fused = ModelRunner(str(tiny_model), dtype="float32", device="cuda")
    plain = ModelRunner(str(tiny_model), dtype="float32", device="cuda", static_kv=False)
    rng = random.Random(4)
    params = [SamplingParams(temperature=t) for t in (0.7, 1.0, 1.3)]
    for round_ in range(3):
        if round_ == 1:
            fused.release_static()  # what releasing the KV cache and graphs does
        elif round_ == 2:
            for p in fused.model.parameters():  # what releasing and resuming the weights does
                p.data = p.data.clone()
            fused.weights_moved()
            torch.cuda.empty_cache()
        prompts = [[1] + [rng.randrange(3, 1000) for _ in range(n)] for n in (9, 25, 4)]
        _, kvs = plain.prefill([(p, None) for p in prompts])
        a, b = plain.empty_batch().extend(kvs), fused.empty_batch().extend(kvs)
        tokens = [rng.randrange(3, 1000) for _ in prompts]
        for _ in range(6):
            ref, a = plain.decode(a, tokens)
            drawn = fused.decode_sample(b, tokens, params, [None] * len(prompts))
            assert drawn is not None and not fused._graph_failed, round_
            for i, p in enumerate(params):
                expect = torch.log_softmax(ref[i].float() / p.temperature, -1)[drawn[0][i]].item()
                assert abs(drawn[1][i] - expect) < TOL, (round_, i)
            tokens = drawn[0]
        assert fused._graphs and all(step["graph"] is not None for step in fused._graphs.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled for CUDA (fused_ops.py); too slow to compile on CPU")
def test_compiled_sampler_draws_from_the_softmax_at_the_rows_temperature():
    """The captured step's compiled Gumbel-max sampler: token frequencies follow softmax(logits / T) (4,096 draws
    per row: within 5 standard errors), greedy rows take the argmax, log-probs are log_softmax's."""
    from agentrl.engine.fused_ops import kernels

    g = torch.Generator("cuda").manual_seed(0)
    base = torch.randn(8, device="cuda", generator=g) * 2
    rows, temps = 4096, torch.tensor([0.5, 1.0, 2.0, 1.0], device="cuda")
    logits = base.repeat(4 * rows, 1)
    t = temps.repeat_interleave(rows)
    greedy = torch.zeros(4 * rows, dtype=torch.bool, device="cuda")
    greedy[3 * rows :] = True
    chosen, lp = kernels()["sample"](logits, t, greedy, torch.rand(logits.shape, device="cuda", generator=g))
    want = torch.log_softmax(logits / t.unsqueeze(1), -1)
    assert torch.allclose(lp, want.gather(1, chosen.unsqueeze(1)).squeeze(1), atol=1e-6)
    assert (chosen[3 * rows :] == base.argmax()).all()
    for i in range(3):
        p = torch.softmax(base / temps[i], -1)
        freq = torch.bincount(chosen[i * rows : (i + 1) * rows], minlength=8).float() / rows
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / rows).sqrt() + 1e-3).all(), (i, freq, p)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_steps_queued_ahead_keep_the_plain_forwards_log_probs(tiny_model, hf_model, hf_logprobs, monkeypatch, depth):
    """The scheduler queues up to ``depth`` captured steps before appending a step's tokens when no row can
    finish by length in between. Rows finishing at different steps by length, a request joining mid-way,
    and rows ending on a stop token drawn while a later step was queued (whose token for them is dropped)
    still get exactly the plain forward's log-probs, and the prefix cache keeps only KV of tokens a row
    really has. Here on CPU, the captured step replayed eagerly."""
    import threading

    from agentrl.engine.engine import Engine, EngineConfig
    from agentrl.engine.protocol import SamplingParams
    from agentrl.engine.scheduler import Sequence

    runner = ModelRunner(str(tiny_model), dtype="float32", device="cpu", static_kv=True)
    runner.cuda_graphs = True

    def capture(step):
        with torch.inference_mode():
            step["forward"]()
        step["graph"] = _EagerGraph(step)

    monkeypatch.setattr(runner, "_capture", capture)
    engine = Engine(EngineConfig(str(tiny_model), device="cpu", static_kv=True, max_batch_size=8), runner=runner)
    engine.scheduler.pipeline_depth = depth
    rng = random.Random(5)
    stop = set(range(0, 1000, 8))

    class Inline:
        def call_soon_threadsafe(self, fn):
            fn()

    def make(n, stop_ids=(), prompt=None):
        prompt = prompt or [1] + [rng.randrange(3, 1000) for _ in range(rng.randrange(3, 25))]
        seq = Sequence(prompt_ids=prompt, loop=Inline(), params=SamplingParams(
            max_new_tokens=n, temperature=1.1, ignore_eos=True, stop_token_ids=sorted(stop_ids)))
        seq.finished_event = threading.Event()
        seq.notify = lambda: seq.finished and seq.finished_event.set()
        return seq

    def run(seqs):
        for seq in seqs:
            engine.scheduler.submit(seq)
        assert all(seq.finished_event.wait(120) for seq in seqs)

    by_length = [make(n) for n in (12, 5, 9, 12, 3)]
    joining = make(7)
    # six rows that end on any token in ``stop`` (1 in 8) or at 100 tokens; only a stop among a row's first
    # two tokens comes before a step is queued behind it, so from depth 2 on some row's stop is drawn with a step
    # in flight unless all six stop that early (p ~ 0.234^6 ~ 2e-4)
    stopping = [make(100, stop) for _ in range(6)]
    engine.start()
    try:
        for seq in by_length:
            engine.scheduler.submit(seq)
        while not any(len(s.output_ids) >= 4 for s in by_length):
            time.sleep(0.005)
        run([joining])  # joins while steps are queued ahead
        run(stopping)
        stopped = next(s for s in stopping if s.finish_reason["type"] == "stop")
        follow = make(4, prompt=stopped.prompt_ids + stopped.output_ids + [5, 6])
        run([follow])  # a follow-up turn on the stopped row's tokens reuses its cached KV
    finally:
        engine.shutdown()
    assert engine.scheduler.pipelined_steps > 0
    # at depth 1 nothing is queued behind a step whose token may stop a row, so no token is ever dropped
    assert (engine.scheduler.dropped_tokens > 0) == (depth > 1)
    for seq in [*by_length, joining]:
        assert seq.finish_reason["type"] == "length" and len(seq.output_ids) == seq.params.max_new_tokens
    for seq in stopping:
        assert seq.finish_reason["type"] == ("stop" if seq.output_ids[-1] in stop else "length")
        assert not stop & set(seq.output_ids[:-1])  # nothing was appended after the stop token
    # every token of the stopped row was cached (from depth 2 on perhaps its stop token too: a queued step fed
    # it), and at depth 3 the entry's KV also has a column of a token drawn after the stop, which is never read
    cached = len(stopped.prompt_ids) + len(stopped.output_ids)
    assert follow.cached_tokens in (cached - 1, cached)
    for seq in [*by_length, joining, *stopping, follow]:
        ref = hf_logprobs(hf_model, seq.prompt_ids, seq.output_ids, 1.1)
        assert max(abs(a - b) for a, b in zip(seq.output_logprobs, ref, strict=True)) < TOL
