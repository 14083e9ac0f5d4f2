"""ModelRunner: batched prefill over mixed cached prefixes and padded decode equal plain HF forwards."""

from __future__ import annotations

import random

import pytest
import torch

from agentrl.engine.model_runner import BatchKV, ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_model):
    return ModelRunner(str(tiny_model), dtype="float32", device="cpu")


def ref_last_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(input_ids=torch.tensor([tokens])).logits[0, -1].float(), -1)


def test_batched_prefill_with_mixed_cached_prefixes_matches_hf(runner, hf_model):
    rng = random.Random(0)
    seqs = [[1] + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    # KV of the first half of some sequences, computed separately, then reused as their "past"
    pasts = []
    for i, s in enumerate(seqs):
        if i % 2 == 0 and len(s) > 2:
            _, (kv,) = runner.prefill([(s[: len(s) // 2], None)])
            pasts.append(kv)
        else:
            pasts.append(None)
    logits, kvs = runner.prefill(list(zip(seqs, pasts, strict=True)))
    for s, lg, kv in zip(seqs, logits, kvs, strict=True):
        assert kv[0][0].shape[1] == len(s)
        diff = (torch.log_softmax(lg.float(), -1) - ref_last_logprobs(hf_model, s)).abs().max().item()
        assert diff < 1e-5
    # decode two steps on the left-padded batch built from those KVs
    batch = BatchKV.empty().extend(kvs)
    nxt = [[rng.randrange(3, 1000) for _ in range(2)] for _ in seqs]
    for step in range(2):
        logits, batch = runner.decode(batch, [n[step] for n in nxt])
        for s, n, lg in zip(seqs, nxt, logits, strict=True):
            ref = ref_last_logprobs(hf_model, s + n[: step + 1])
            assert (torch.log_softmax(lg.float(), -1) - ref).abs().max().item() < 1e-5
    # dropping rows trims padding and keeps the rest exact
    batch = batch.select([1, 3])
    assert batch.width == max(len(seqs[1]), len(seqs[3])) + 2
    logits, batch = runner.decode(batch, [7, 7])
    for i, lg in zip([1, 3], logits, strict=True):
        ref = ref_last_logprobs(hf_model, seqs[i] + nxt[i] + [7])
        assert (torch.log_softmax(lg.float(), -1) - ref).abs().max().item() < 1e-5
    row = batch.row(0)
    assert row[0][0].shape[1] == len(seqs[1]) + 3


def test_bfloat16_runner_is_close_to_fp32(tiny_model, runner):
    bf16 = ModelRunner(str(tiny_model), dtype="bfloat16", device="cpu")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    items = [([1, 5, 9, 200, 17], None), ([1, 2], None)]
    lg16, kv16 = bf16.prefill(items)
    lg32, kv32 = runner.prefill(items)
    assert torch.isfinite(lg16.float()).all()
    assert (torch.log_softmax(lg16.float(), -1) - torch.log_softmax(lg32, -1)).abs().max() < 0.1
    logits, _ = bf16.decode(BatchKV.empty().extend(kv16), [3, 4])
    assert torch.isfinite(logits.float()).all() and logits.shape == (2, bf16.vocab_size)


def test_after_a_failed_capture_unseeded_draws_leave_the_default_generator_alone(tiny_model):
    # On the H200 (SmolLM2, 2026-12-03) a capture that failed inside cuBLAS left torch's default CUDA
    # generator marked as capturing; every eager draw from it then raised and the engine aborted every
    # sampled request. After a failed capture the runner draws from a generator of its own.
    from agentrl.engine.protocol import SamplingParams
    from agentrl.engine.sampling import sample_next

    runner = ModelRunner(str(tiny_model), dtype="float32", device="cpu")
    assert runner.sampling_rng is None

    def fails():
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    runner._capture({"forward": fails, "graph": None})
    assert runner._graph_failed and isinstance(runner.sampling_rng, torch.Generator)
    assert runner.sampling_rng.device == runner.device

    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0)] * 8
    before = torch.get_rng_state()
    runner.sampling_rng.manual_seed(7)
    first = sample_next(logits, params, [None] * 8, runner.sampling_rng)
    runner.sampling_rng.manual_seed(7)
    assert sample_next(logits, params, [None] * 8, runner.sampling_rng) == first  # its own stream
    assert torch.equal(torch.get_rng_state(), before)  # the default generator was never drawn from
