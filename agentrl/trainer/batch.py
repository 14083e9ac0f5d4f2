"""Turn Samples into padded micro-batches under a token budget, with per-token loss masks.

Position ``t`` of every per-token tensor refers to ``tokens[t]``, predicted by the logits at ``t - 1``:
``loss_mask[:, t]`` is the Sample's ``loss_mask[t - response_start]`` for ``t >= response_start`` and 0
elsewhere (prompt, padding, position 0). Batches are right-padded; with causal attention the padding
never reaches a real token. Packing several sequences into one row would need a block-diagonal mask
(THD layout in TransformerEngine); padding works on every backend, so it is what we do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SAMPLE_FIELDS = ("tokens", "response_start", "loss_mask", "rollout_logprobs")


def sample_field(sample: Any, name: str, default: Any = None) -> Any:
    """Read a field from an ``agentrl.trajectory.Sample`` or a dict with the same keys."""
    if isinstance(sample, Mapping):
        return sample.get(name, default)
    return getattr(sample, name, default)


def sample_reward(sample: Any, key: str = "score") -> float:
    """A sample's scalar reward (a dict reward is read at ``key``)."""
    reward = sample_field(sample, "reward", 0.0)
    if isinstance(reward, Mapping):
        if key not in reward:
            raise KeyError(f"reward dict has no {key!r} (keys: {sorted(reward)})")
        reward = reward[key]
    return float(reward)


def validate_sample(sample: Any, index: int = 0) -> None:
    """Raise ``ValueError`` naming the sample and field if lengths or ranges disagree."""
    tokens = sample_field(sample, "tokens")
    start = sample_field(sample, "response_start")
    mask = sample_field(sample, "loss_mask")
    logprobs = sample_field(sample, "rollout_logprobs")
    if tokens is None or start is None or mask is None:
        raise ValueError(f"sample {index}: needs tokens, response_start and loss_mask")
    if not 1 <= start <= len(tokens):
        raise ValueError(f"sample {index}: response_start={start} outside [1, {len(tokens)}]")
    n_resp = len(tokens) - start
    if len(mask) != n_resp:
        raise ValueError(f"sample {index}: loss_mask has {len(mask)} entries, response has {n_resp} tokens")
    if logprobs is not None and len(logprobs) not in (0, n_resp):
        raise ValueError(f"sample {index}: rollout_logprobs has {len(logprobs)} entries, response has {n_resp}")


@dataclass
class MicroBatch:
    """One padded micro-batch; ``index`` maps rows back to positions in the input sample list."""

    tokens: torch.Tensor  # [b, L] long
    position_ids: torch.Tensor  # [b, L] long
    loss_mask: torch.Tensor  # [b, L] float
    rollout_logprobs: torch.Tensor  # [b, L] float (0 where unknown)
    advantages: torch.Tensor  # [b] float
    lengths: list[int]
    response_starts: list[int]
    index: list[int]

    @property
    def n_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device | str) -> MicroBatch:
        for name in ("tokens", "position_ids", "loss_mask", "rollout_logprobs", "advantages"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices so that ``rows x longest`` stays within ``max_tokens`` per micro-batch.

    Longest first, so similar lengths share a batch (less padding); deterministic. A sequence longer
    than the budget gets a micro-batch of its own.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if current and max(longest, n) * (len(current) + 1) > max_tokens:
            plans.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        plans.append(current)
    return plans


def collate(samples: Sequence[Any], index: Sequence[int], advantages: Sequence[float] | None = None,
            pad_id: int = 0) -> MicroBatch:
    """Pad ``samples[i] for i in index`` into a :class:`MicroBatch`."""
    rows = [samples[i] for i in index]
    lengths = [len(sample_field(s, "tokens")) for s in rows]
    width = max(lengths)
    b = len(rows)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros(b, width)
    rollout = torch.zeros(b, width)
    starts = []
    for r, s in enumerate(rows):
        toks = sample_field(s, "tokens")
        start = int(sample_field(s, "response_start"))
        starts.append(start)
        tokens[r, : len(toks)] = torch.as_tensor(toks, dtype=torch.long)
        mask[r, start : len(toks)] = torch.as_tensor(sample_field(s, "loss_mask"), dtype=torch.float32)
        lps = sample_field(s, "rollout_logprobs") or []
        if lps:
            rollout[r, start : len(toks)] = torch.as_tensor(lps, dtype=torch.float32)
    adv = torch.tensor([float(advantages[i]) for i in index]) if advantages is not None else torch.zeros(b)
    positions = torch.arange(width)[None].expand(b, width).contiguous()
    return MicroBatch(tokens, positions, mask, rollout, adv, lengths, starts, list(index))


def make_micro_batches(
    samples: Sequence[Any], max_tokens: int, advantages: Sequence[float] | None = None, pad_id: int = 0
) -> list[MicroBatch]:
    """Plan and collate ``samples`` (validated by the caller, once) into micro-batches of at most
    ``max_tokens`` padded tokens."""
    lengths = [len(sample_field(s, "tokens")) for s in samples]
    return [collate(samples, plan, advantages, pad_id) for plan in plan_micro_batches(lengths, max_tokens)]


def response_values(values: torch.Tensor, mb: MicroBatch) -> list[list[float]]:
    """Per-sample lists over ``tokens[response_start:]`` from a ``[b, L]`` tensor (Sample order of ``mb``)."""
    return [values[r, s:n].tolist() for r, (s, n) in enumerate(zip(mb.response_starts, mb.lengths, strict=True))]
