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
    reference follows its order), new rows joining with a cached past, more steps."""
    decoder = LeanDecoder.for_model(runner.model, runner.dtype, runner.device, rows=2)  # rows=2: buffers regrow
    assert decoder is not None
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 30))] for _ in range(5)]
    ref, lean = runner.empty_batch(), decoder.empty_batch()
    with torch.inference_mode():
        logits, kvs = runner.prefill([(p, None) for p in prompts])
        ref, lean = ref.extend(kvs), lean.extend(kvs)
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
            if step == 6:  # a row joins with a cached past (the prefix of a row that is running)
                past = lean.row(1)
                cut = past[0][0].shape[1] - 3
                prompt = [7, 8, 9, 10]
                logits, kvs = runner.prefill([([0] * cut + prompt, [(k[:, :cut], v[:, :cut]) for k, v in past])])
                ref, lean = ref.extend(kvs), lean.extend(kvs)
                tokens = [*tokens, int(logits.argmax(-1)[0])]


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
