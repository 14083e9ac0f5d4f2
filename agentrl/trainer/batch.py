"""Turn Samples into micro-batches under a token budget, with per-token loss masks.

Position ``t`` of every per-token tensor refers to ``tokens[t]``, predicted by the logits at ``t - 1``:
``loss_mask[:, t]`` is the Sample's ``loss_mask[t - response_start]`` for ``t >= response_start`` and 0
elsewhere (prompt, padding, position 0). The loss always sees this right-padded ``[b, L]`` layout.

The model sees one of two layouts. *Padded*: the ``[b, L]`` tokens themselves; with causal attention the
padding never reaches a real token, but every padded position costs a full forward/backward. *Packed*
(:class:`PackedLayout`): the sequences end to end in one ``[1, T]`` row, ``T`` the real token count, with
positions restarting at each sequence and attention causal within each sequence only (Megatron's
``thd`` format); :meth:`MicroBatch.unpack` puts per-token outputs back into ``[b, L]``.
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
class PackedLayout:
    """A micro-batch's sequences laid end to end in one row, without padding.

    ``flat_index[p]`` is where packed position ``p`` sits in the flattened ``[b, L]`` padded layout
    (``row * L + column``); ``interior`` lists the packed positions that start no sequence (a sequence's
    first token has no prediction inside that sequence: column 0 of the padded layout).
    """

    tokens: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, 0 at each sequence's first token
    cu_seqlens: torch.Tensor  # [b + 1] int32, sequence boundaries in the packed row
    max_seqlen: int
    flat_index: torch.Tensor  # [T] long
    interior: torch.Tensor  # [T - b] long
    rows: int
    width: int
    # cu_seqlens as built, on the host: Megatron's thd RoPE reads the lengths with .tolist() in every
    # layer, a device sync each time if they live on the GPU (see attention.packed_seq_params)
    cu_seqlens_host: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> PackedLayout:
        for name in ("tokens", "position_ids", "cu_seqlens", "flat_index", "interior"):
            setattr(self, name, getattr(self, name).to(device))
        return self


@dataclass
class MicroBatch:
    """One micro-batch in the padded ``[b, L]`` layout (plus, if packed, the model's :class:`PackedLayout`);
    ``index`` maps rows back to positions in the input sample list."""

    tokens: torch.Tensor  # [b, L] long
    position_ids: torch.Tensor  # [b, L] long
    loss_mask: torch.Tensor  # [b, L] float
    rollout_logprobs: torch.Tensor  # [b, L] float (0 where unknown)
    advantages: torch.Tensor  # [b] float
    lengths: list[int]
    response_starts: list[int]
    index: list[int]
    packed: PackedLayout | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def model_tokens(self) -> torch.Tensor:
        """The token ids the model is run on: ``[1, T]`` if packed, else ``[b, L]``."""
        return self.packed.tokens if self.packed is not None else self.tokens

    def to(self, device: torch.device | str) -> MicroBatch:
        for name in ("tokens", "position_ids", "loss_mask", "rollout_logprobs", "advantages"):
            setattr(self, name, getattr(self, name).to(device))
        if self.packed is not None:
            self.packed.to(device)
        return self

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Shifted per-token values (``[1, T]`` model layout, as
        :func:`~agentrl.trainer.chunked_logprobs.shifted_logprobs_and_entropy`
        returns them) as ``[b, L]``, 0 at column 0 and padding; differentiable. Identity when not packed.

        A sequence's first packed position holds a prediction made from the previous sequence's last
        token: it is dropped, as column 0 of the padded layout is."""
        p = self.packed
        if p is None:
            return values
        flat = values.reshape(-1)
        out = flat.new_zeros(p.rows * p.width)
        return out.index_copy(0, p.flat_index[p.interior], flat[p.interior]).view(p.rows, p.width)


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


def plan_packed_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices so that the *real* tokens of a micro-batch stay within ``max_tokens``.

    Longest first, each into the first micro-batch it fits (first-fit decreasing); deterministic. A
    sequence longer than the budget gets a micro-batch of its own.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = lengths[i]
        slot = next((j for j, u in enumerate(used) if u + n <= max_tokens), None)
        if slot is None:
            plans.append([i])
            used.append(n)
        else:
            plans[slot].append(i)
            used[slot] += n
    return plans


def pack_layout(lengths: Sequence[int], tokens: torch.Tensor) -> PackedLayout:
    """The :class:`PackedLayout` of padded ``tokens`` ``[b, L]`` whose rows hold ``lengths`` real tokens."""
    b, width = tokens.shape
    lens = torch.tensor(lengths, dtype=torch.long)
    real = torch.arange(width)[None, :] < lens[:, None]  # [b, L]
    flat_index = real.reshape(-1).nonzero().squeeze(1)  # row-major: sequence after sequence
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    starts = torch.zeros(int(cu[-1]), dtype=torch.bool)
    starts[cu[:-1].long()] = True
    return PackedLayout(
        tokens=tokens.reshape(-1)[flat_index][None],
        position_ids=(flat_index % width)[None],
        cu_seqlens=cu, max_seqlen=int(lens.max()), flat_index=flat_index,
        interior=(~starts).nonzero().squeeze(1), rows=b, width=width, cu_seqlens_host=cu,
    )


def collate(samples: Sequence[Any], index: Sequence[int], advantages: Sequence[float] | None = None,
            pad_id: int = 0, *, packed: bool = False) -> MicroBatch:
    """Pad ``samples[i] for i in index`` into a :class:`MicroBatch` (with its :class:`PackedLayout` if
    ``packed``)."""
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
    layout = pack_layout(lengths, tokens) if packed else None
    return MicroBatch(tokens, positions, mask, rollout, adv, lengths, starts, list(index), layout)


def make_micro_batches(
    samples: Sequence[Any], max_tokens: int, advantages: Sequence[float] | None = None, pad_id: int = 0,
    *, packed: bool = False,
) -> list[MicroBatch]:
    """Plan and collate ``samples`` (validated by the caller, once) into micro-batches of at most
    ``max_tokens`` model tokens: padded ``rows x longest``, or with ``packed`` the real tokens."""
    lengths = [len(sample_field(s, "tokens")) for s in samples]
    plan = plan_packed_micro_batches if packed else plan_micro_batches
    return [collate(samples, p, advantages, pad_id, packed=packed) for p in plan(lengths, max_tokens)]


def response_values(values: torch.Tensor, mb: MicroBatch) -> list[list[float]]:
    """Per-sample lists over ``tokens[response_start:]`` from a ``[b, L]`` tensor (Sample order of ``mb``)."""
    return [values[r, s:n].tolist() for r, (s, n) in enumerate(zip(mb.response_starts, mb.lengths, strict=True))]
