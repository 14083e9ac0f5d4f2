"""The CPU engine's lean decode (cpu_decode.py) against transformers' decode, as rows join and leave."""

from __future__ import annotations

import random

import pytest
import torch

from agentrl.engine.cpu_decode import LeanDecoder, SlotBatchKV
from agentrl.engine.model_runner import ModelRunner

TOL = 1e-5  # fp32 log-probs; the two paths sum attention columns in a different order


@pytest.fixture(scope="module")
def runner(tiny_model):
    return ModelRunner(str(tiny_model), device="cpu")


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def test_lean_decode_matches_transformers_as_rows_join_and_leave(runner):
    """Same rows through both paths: prefill, decode steps, rows leaving (the lean batch reorders, the
    reference follows its order), new rows joining (one with a cached past), more steps."""
    decoder = LeanDecoder.for_model(runner.model, runner.dtype, runner.device, rows=2)  # rows=2: buffers regrow
    assert decoder is not None
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 30))] for _ in range(5)]
    ref, lean = runner.empty_batch(), decoder.empty_batch()
    with torch.inference_mode():
        logits, kvs = runner.prefill([(p, None) for p in prompts])
        ref = ref.extend(kvs)
        got = decoder.prefill_into(lean, [(p, None) for p in prompts])
        assert (_logprobs(got) - _logprobs(logits)).abs().max().item() < TOL
        tokens = logits.argmax(-1).tolist()
        for step in range(12):
            want, ref = runner.decode(ref, tokens)
            got, lean = decoder.decode(lean, tokens)
            assert lean.lengths == ref.lengths
            assert (_logprobs(got) - _logprobs(want)).abs().max().item() < TOL, step
            tokens = want.argmax(-1).tolist()
            if step == 3:  # rows 0 and 2 leave: the lean batch moves its last row into the hole
                order = lean.remove([0, 2])
                assert sorted(order) == [1, 3, 4] and order != [1, 3, 4]
                ref, tokens = ref.select(order), [tokens[i] for i in order]
            if step == 6:  # rows join: one with a cached past (the prefix of a running row), one without
                past = lean.row(1)
                cut = past[0][0].shape[1] - 3
                items = [([0] * cut + [7, 8, 9, 10], [(k[:, :cut], v[:, :cut]) for k, v in past]), (prompts[0], None)]
                logits, kvs = runner.prefill(items)
                ref = ref.extend(kvs)
                got = decoder.prefill_into(lean, items)
                assert (_logprobs(got) - _logprobs(logits)).abs().max().item() < TOL
                tokens = [*tokens, *logits.argmax(-1).tolist()]


def test_remove_moves_only_the_last_rows_into_holes():
    batch = SlotBatchKV(layers=1, kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu", rows=8, columns=4)
    batch.extend([[(torch.full((1, n, 1), float(i)), torch.full((1, n, 1), float(-i)))] for i, n in
                  enumerate([1, 2, 3, 1, 2, 3])])
    order = batch.remove([1, 4])
    assert order == [0, 5, 2, 3]
    assert batch.lengths == [1, 3, 3, 1]
    for row, old in enumerate(order):
        k, v = batch.row(row)[0]
        assert torch.equal(k, torch.full_like(k, float(old))) and torch.equal(v, torch.full_like(v, float(-old)))
    assert batch.remove([0, 1, 2, 3]) == [] and batch.lengths == []


def test_prompts_admitted_together_share_their_common_prefix(server, hf_model, hf_logprobs, monkeypatch):
    """Eight prompts with a 30-token common start, admitted in one go: the start is prefilled once (each
    row then starts from it as a cached past), and every answer's log-probs still equal a plain forward's."""
    import threading
    import time

    import httpx

    scheduler = server.engine.scheduler
    assert isinstance(scheduler.decoder, LeanDecoder)
    server.engine.flush_cache()
    rng = random.Random(3)
    common = [1] + [rng.randrange(3, 1000) for _ in range(29)]
    prompts = [common + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 6))] for _ in range(8)]
    outs: dict[int, dict] = {}
    pasts: list[list[int]] = []  # per prefill call, each row's cached past length
    real = scheduler.decoder.prefill_into

    def recording(batch, items):
        pasts.append([past[0][0].shape[1] if past else 0 for _, past in items])
        return real(batch, items)

    monkeypatch.setattr(scheduler.decoder, "prefill_into", recording)

    def ask(i: int) -> None:
        body = {"input_ids": prompts[i], "sampling_params": {"max_new_tokens": 4, "temperature": 0.8, "ignore_eos": True},
                "return_logprob": True}
        outs[i] = httpx.post(server.url + "/generate", json=body, timeout=60).json()

    scheduler.pause("in_place")  # all eight wait, then join the batch in one admission
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(scheduler.waiting) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    scheduler.resume()
    for t in threads:
        t.join()
    assert [0] in pasts  # the common start, alone
    assert any(len(call) == 8 and min(call) >= 30 for call in pasts)
    for i, out in outs.items():
        ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(hf_model, prompts[i], out["output_ids"], 0.8)
        assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < TOL
