"""Credit plug-ins: edit which tokens a sample trains once its advantage is known.

A ``credit_fn`` (``TrainerConfig.credit_fn``, a dotted path) takes the batch's samples and their
advantages and returns the samples to train, with loss masks that may only lose ones: a credit rule can
withhold training from a token, never give it to a token the trajectory contract did not prove.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from agentrl.trainer.batch import sample_field
from agentrl.trajectory.provenance import MODEL  # only model tokens carry loss


def _is_ill_formed(turn_meta: Mapping[str, Any] | None) -> bool:
    return bool(turn_meta) and bool(turn_meta.get("ill_formed") or turn_meta.get("malformed_calls"))


def replace_loss_mask(sample: Any, loss_mask: list[int]) -> Any:
    """``sample`` (a mapping or a dataclass record) with ``loss_mask`` in place of its own; for credit rules."""
    if isinstance(sample, Mapping):
        return {**sample, "loss_mask": loss_mask}
    return dataclasses.replace(sample, loss_mask=loss_mask)


def _runs(provenance: Any) -> list[Sequence[Any]]:
    return provenance.to_list() if hasattr(provenance, "to_list") else list(provenance)


def withhold_turns(sample: Any, turns: set[int]) -> Any:
    """``sample`` with no loss on the model tokens of ``turns`` (the rest of its loss mask unchanged)."""
    start = int(sample_field(sample, "response_start"))
    mask = list(sample_field(sample, "loss_mask"))
    for run_start, run_end, source, turn, *_ in _runs(sample_field(sample, "provenance")):
        if source == MODEL and turn in turns:
            for i in range(max(run_start, start), run_end):
                mask[i - start] = 0
    return replace_loss_mask(sample, mask)


def withhold_positive_credit_from_ill_formed_turns(samples: Sequence[Any], advantages: Sequence[float]) -> list[Any]:
    """Untrain the turns with an ill-formed tool call in samples whose advantage is positive.

    An episode can fumble a call, read the error and still succeed; the success would then credit the
    fumble too, teaching that fumbling costs nothing. Below-average samples keep those turns, so they are
    still pushed down. (On the tiny arithmetic task a fumble almost never leads to a success — 0 of 40
    successes in 512 warm-model episodes — so its example config leaves this off.)
    """
    out = []
    for sample, advantage in zip(samples, advantages, strict=True):
        metadata = sample_field(sample, "metadata") or {}
        bad = {t for t, m in zip(metadata.get("turns", ()), metadata.get("turn_metadata", ()), strict=False)
               if _is_ill_formed(m)}
        if advantage <= 0 or not bad:
            out.append(sample)
            continue
        out.append(withhold_turns(sample, bad))
    return out
