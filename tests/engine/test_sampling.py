"""sample_next: draws follow the filtered distribution; the returned log-prob is the raw one."""

from __future__ import annotations

import pytest
import torch

from agentrl.engine.protocol import SamplingParams
from agentrl.engine.sampling import sample_next

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
N = 20000


def draw(params: SamplingParams, n: int = N) -> tuple[torch.Tensor, list[float]]:
    torch.manual_seed(0)
    tokens, lps = sample_next(LOGITS.repeat(n, 1), [params] * n, [None] * n)
    return torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).float() / n, lps


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_follow_softmax_over_temperature(temperature):
    freq, _ = draw(SamplingParams(temperature=temperature))
    expected = torch.softmax(LOGITS / temperature, -1)
    assert (freq - expected).abs().max() < 0.015


def test_returned_logprob_is_at_the_sampling_temperature_before_filters():
    scaled = torch.log_softmax(LOGITS / 0.3, -1)  # top_k=3 changes the draw, not the returned log-prob
    torch.manual_seed(1)
    tokens, lps = sample_next(LOGITS.repeat(50, 1), [SamplingParams(temperature=0.3, top_k=3)] * 50, [None] * 50)
    assert all(abs(lp - scaled[t].item()) < 1e-6 for t, lp in zip(tokens, lps, strict=True))
    raw = torch.log_softmax(LOGITS, -1)
    tokens, lps = sample_next(LOGITS[None], [SamplingParams(temperature=0)], [None])
    assert abs(lps[0] - raw[tokens[0]].item()) < 1e-6  # greedy: temperature 1


def test_top_k_top_p_min_p_filter():
    freq, _ = draw(SamplingParams(top_k=2), 4000)
    assert freq[2:].sum() == 0 and freq[:2].min() > 0
    probs = torch.softmax(LOGITS, -1)  # [0.57, 0.21, 0.13, 0.08, 0.03, 0.004]
    freq, _ = draw(SamplingParams(top_p=0.7), 4000)  # 0.57 < 0.7 so the second token is still needed
    assert freq[2:].sum() == 0 and freq[1] > 0
    freq, _ = draw(SamplingParams(min_p=0.2), 4000)  # keep p >= 0.2 * 0.57
    assert freq[(probs < 0.2 * probs[0])].sum() == 0 and freq[2] > 0


def test_greedy_rows_and_seeded_rows_in_one_batch():
    params = [SamplingParams(temperature=0), SamplingParams(sampling_seed=5), SamplingParams()]
    logits = torch.randn(3, 50)
    gens = [None, torch.Generator().manual_seed(5), None]
    a, _ = sample_next(logits, params, gens)
    gens2 = [None, torch.Generator().manual_seed(5), None]
    b = [sample_next(logits, params, gens2)[0][1] for _ in range(1)]
    assert a[0] == logits[0].argmax().item()
    assert a[1] == b[0]
