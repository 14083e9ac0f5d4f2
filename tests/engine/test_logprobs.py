"""Returned log-probs equal a plain transformers forward at the sampling temperature (fp32, 1e-5) at batch 1
and 16, with and without prefix-cache reuse and left padding."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

TOL = 1e-5


def _generate(url: str, prompt: list[int], sp: dict) -> dict:
    r = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": sp, "return_logprob": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _check(hf_logprobs, hf_model, prompt: list[int], out: dict, temperature: float = 1.0) -> None:
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    ref = hf_logprobs(hf_model, prompt, out["output_ids"], temperature)
    assert len(ours) == len(ref) == len(out["output_ids"]) > 0
    worst = max(abs(a - b) for a, b in zip(ours, ref, strict=True))
    assert worst < TOL, f"max |engine - hf| = {worst:.2e}"


def test_batch_1_matches_hf_forward(server, hf_model, hf_logprobs):
    server.engine.flush_cache()
    prompt = [1, 17, 250, 3, 99, 14]
    out = _generate(server.url, prompt, {"max_new_tokens": 16, "temperature": 0.6, "ignore_eos": True})
    _check(hf_logprobs, hf_model, prompt, out, temperature=0.6)


def test_batch_16_with_left_padding_matches_hf_forward(server, hf_model, hf_logprobs):
    """16 concurrent prompts of different lengths share decode steps (left-padded KV)."""
    server.engine.flush_cache()
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 40))] for _ in range(16)]
    sp = {"max_new_tokens": 12, "temperature": 1.3, "ignore_eos": True}
    before = server.engine.metrics.batch_size._sum.get()
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: _generate(server.url, p, sp), prompts))
    for p, o in zip(prompts, outs, strict=True):
        _check(hf_logprobs, hf_model, p, o, temperature=1.3)
    # the decode steps really were batched (not 16 sequential batch-1 runs)
    steps = server.engine.metrics.batch_size._sum.get() - before
    assert steps > 16 * 11 * 0.99
    assert max(server.engine.scheduler.load().values()) == 0


@pytest.mark.parametrize("batched", [False, True])
def test_prefix_cache_reuse_keeps_logprobs(server, hf_model, hf_logprobs, batched):
    """A second turn extending the first reuses its KV (cached_tokens > 0) with the same log-probs."""
    server.engine.flush_cache()
    rng = random.Random(1 + batched)
    first = [1] + [rng.randrange(3, 1000) for _ in range(20)]
    out1 = _generate(server.url, first, {"max_new_tokens": 8, "ignore_eos": True})
    second = first + out1["output_ids"] + [rng.randrange(3, 1000) for _ in range(5)]
    if batched:  # the cached request decodes next to an uncached one of another length
        other = [1] + [rng.randrange(3, 1000) for _ in range(33)]
        with ThreadPoolExecutor(2) as pool:
            out2, out_other = pool.map(
                lambda p: _generate(server.url, p, {"max_new_tokens": 8, "ignore_eos": True}), [second, other]
            )
        _check(hf_logprobs, hf_model, other, out_other)
    else:
        out2 = _generate(server.url, second, {"max_new_tokens": 8, "ignore_eos": True})
    assert out2["meta_info"]["cached_tokens"] == len(first) + len(out1["output_ids"]) - 1
    _check(hf_logprobs, hf_model, second, out2)
