"""``credit_fn`` of the coding agent: train only the episodes that did better than their group.

Why: in a host-side replay of GRPO on the write turn (probe, not a run: the earlier task family, no
gradient clipping; `benchmarks/results/coding_agent/acceptance_2026-12-02/NOTES.md`) a learning rate of
2e-4 left held-out accuracy flat (0.33 -> 0.27 in 30 steps) and 1e-3 / 3e-3 collapsed the policy to
train reward ~0 within 5-20 steps: pushing the tiny model's failed writes down moved probability onto
junk faster than the successes taught anything. Withholding training from below-average episodes keeps
only the pull towards what passed the hidden tests (rejection-sampling fine-tuning on the policy's own
sandbox-graded episodes, weighted by the GRPO advantage), so a learning rate near the warm-up's can be
used. A credit rule may only narrow loss masks, so no token is trained that was not already.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrl.trainer.batch import sample_field
from agentrl.trainer.credit import replace_loss_mask


def train_above_average_only(samples: Sequence[Any], advantages: Sequence[float]) -> list[Any]:
    """Each sample with advantage <= 0 gets an all-zero loss mask; the others are returned unchanged."""
    out = []
    for sample, advantage in zip(samples, advantages, strict=True):
        if advantage > 0:
            out.append(sample)
        else:
            out.append(replace_loss_mask(sample, [0] * len(sample_field(sample, "loss_mask"))))
    return out
