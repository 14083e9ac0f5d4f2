"""Shared helpers for trainer tests: deterministic synthetic Samples (plain dicts with Sample's fields)."""

from __future__ import annotations

import random


def synthetic_samples(n_groups: int = 4, per_group: int = 4, seed: int = 0, vocab: int = 1000) -> list[dict]:
    """Ragged prompts/responses with partial loss masks, per-group rewards and fake rollout log-probs."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 12))]
        for _ in range(per_group):
            resp = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 24))]
            mask = [1] * len(resp)
            if len(resp) > 6:  # a tool-response span inside the response is not trained
                mask[2:4] = [0, 0]
            out.append(dict(
                tokens=prompt + resp, response_start=len(prompt), loss_mask=mask,
                rollout_logprobs=[-rng.random() * 5 for _ in resp], reward=float(rng.random() > 0.5),
                group_id=g,
            ))
    return out
