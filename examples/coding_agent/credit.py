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
from agentrl.trainer.credit import replace_loss_mask, withhold_turns


def train_above_average_only(samples: Sequence[Any], advantages: Sequence[float]) -> list[Any]:
    """Each sample with advantage <= 0 gets an all-zero loss mask; the others are returned unchanged."""
    out = []
    for sample, advantage in zip(samples, advantages, strict=True):
        if advantage > 0:
            out.append(sample)
        else:
            out.append(replace_loss_mask(sample, [0] * len(sample_field(sample, "loss_mask"))))
    return out


def _superseded_write_turns(sample: Any) -> set[int]:
    """The turns of ``sample`` that called ``write`` while a later turn wrote again (attempts it replaced)."""
    metadata = sample_field(sample, "metadata") or {}
    writes = [turn for turn, meta in zip(metadata.get("turns", ()), metadata.get("turn_metadata", ()), strict=False)
              if "write" in ((meta or {}).get("tool_calls") or ())]
    return set(writes[:-1])


def train_above_average_only_without_superseded_writes(samples: Sequence[Any], advantages: Sequence[float],
                                                       ) -> list[Any]:
    """:func:`train_above_average_only`, and in the episodes that train, no credit to a ``write`` that a later
    ``write`` replaced.

    Why: with repair chats in the warm-up an episode can write a near miss, read the FAIL and fix it; its
    reward credits the first write too, so plain above-average training would teach writing the near miss
    first (a probe from the repair warm model: held-out 0.203 -> 0.094 in 5 steps). The run_tests turn after
    it and the fix keep their credit."""
    out = []
    for kept in train_above_average_only(samples, advantages):
        superseded = _superseded_write_turns(kept) if any(sample_field(kept, "loss_mask")) else set()
        out.append(withhold_turns(kept, superseded) if superseded else kept)
    return out
