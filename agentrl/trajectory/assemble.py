"""Turn a chain of merged turns into a :class:`Sample` (the layout rule, in one place).

A chain is the ordered list of turns merged into one sample, each with its *divergence* ``d``: the
first position where its prompt left the tokens held before it (``0`` for the first turn, the held
length for a clean extension). After the merge of turn ``k`` the sample is exactly
``prompt_k + output_k``; so token ``i`` of the final sample was introduced by the last turn ``k`` with
``d_k <= i``, and it is

* ``prompt`` if ``i < response_start`` (the first turn's prompt),
* ``model`` if ``i >= len(prompt_k)`` (turn ``k``'s output at its sampled position),
* ``realigned`` if a previous turn held position ``i`` (the new prompt overwrote held tokens),
* ``context`` otherwise (new user / tool / system / template tokens).

A model token is trained unless a later divergence cut *inside* its turn's output (the tokens it was
sampled after are then partly gone from the sample, and its tail is replaced).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrl.trajectory.provenance import CONTEXT, MODEL, PROMPT, REALIGNED_PROMPT, Provenance, ProvenanceRun
from agentrl.trajectory.records import TurnRecord
from agentrl.trajectory.sample import Sample, StopReason, sample_status


@dataclass
class Chain:
    """An open sample of one session: turns merged so far and the tokens it holds."""

    turns: list[int]
    divergences: list[int]
    outcomes: list[str]  # per merged turn: new / branched / forked / clean / realigned / cut
    last: TurnRecord  # the last merged turn: the sample holds exactly last.prompt_ids + last.output_ids
    response_start: int
    lost_turns: list[int] = field(default_factory=list)  # turns dropped when a cut hit the first prompt
    drift_points: list[dict[str, Any]] = field(default_factory=list)  # {turn, position, outcome} per drift

    @property
    def latest_output_start(self) -> int:
        return len(self.last.prompt_ids)

    @property
    def held_length(self) -> int:
        return len(self.last.prompt_ids) + len(self.last.output_ids)

    def held(self) -> tuple[int, ...]:
        return self.last.prompt_ids + self.last.output_ids

    def held_packed(self) -> bytes:
        return self.last.packed_prompt + self.last.packed_output

    def is_extended_by(self, record: TurnRecord) -> bool:
        """Does ``record``'s prompt start with every held token? Two memcmp, no copies."""
        last = self.last
        packed = record.packed_prompt
        return packed.startswith(last.packed_prompt) and packed.startswith(
            last.packed_output, len(last.packed_prompt)
        )

    @classmethod
    def start(cls, turn: int, record: TurnRecord, outcome: str) -> Chain:
        return cls(
            turns=[turn],
            divergences=[0],
            outcomes=[outcome],
            last=record,
            response_start=len(record.prompt_ids),
        )

    def extend(self, turn: int, record: TurnRecord, divergence: int, outcome: str) -> None:
        self.turns.append(turn)
        self.divergences.append(divergence)
        self.outcomes.append(outcome)
        self.last = record


class _Columns:
    """The per-response-token columns of a sample being built: loss mask, rollout log-probs and, when some
    record has them, the experts the engine routed each trained token to (``None`` on untrained ones)."""

    def __init__(self, with_experts: bool) -> None:
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.routed: list[list[int] | None] | None = [] if with_experts else None

    def untrained(self, width: int) -> None:
        self.loss_mask += [0] * width
        self.logprobs += [0.0] * width
        if self.routed is not None:
            self.routed += [None] * width

    def trained(self, rec: TurnRecord, width: int) -> None:
        self.loss_mask += [1] * width
        self.logprobs += rec.output_logprobs[:width] if rec.output_logprobs else [0.0] * width
        if self.routed is not None:
            self.routed += (list(map(list, rec.routed_experts[:width])) if rec.routed_experts is not None
                            else [None] * width)


def assemble_sample(
    chain: Chain,
    records: list[TurnRecord],
    *,
    max_sample_tokens: int = 0,
    stop_reason: StopReason | None = None,
) -> tuple[Sample, dict[str, Any]]:
    """Build the sample of ``chain`` (``stop_reason``: its episode's, for the status); also return layout
    facts (trained turns, budget cut) for metadata."""
    turns = chain.turns
    divergences = chain.divergences
    recs = [records[t] for t in turns]
    full_length = chain.held_length
    n = min(full_length, max_sample_tokens) if max_sample_tokens > 0 else full_length
    # ends[k]: the smallest later divergence; turn k's tokens are [d_k, ends[k]) (none if d_k >= ends[k]).
    ends = [full_length] * len(turns)
    for k in range(len(turns) - 2, -1, -1):
        later = divergences[k + 1]
        ends[k] = later if later < ends[k + 1] else ends[k + 1]

    runs: list[ProvenanceRun] = []
    columns = _Columns(with_experts=any(rec.routed_experts is not None for rec in recs))
    trained_turns: list[int] = []
    trained_tokens = 0
    held_before = 0  # len(prompt + output) of the previous turn: what the sample held when turn k came
    for k, rec in enumerate(recs):
        turn, d, end = turns[k], divergences[k], ends[k]
        prompt_len = len(rec.prompt_ids)
        output_end = prompt_len + len(rec.output_ids)
        previous_held, held_before = held_before, output_end
        if d >= end:
            continue  # a later turn re-rendered everything this one introduced
        cap = end if end < n else n
        if k == 0:
            stop = min(prompt_len, cap)
            if stop > 0:
                runs.append(ProvenanceRun(0, stop, PROMPT, turn, None))
        else:
            stop = min(previous_held, prompt_len, cap)
            if stop > d:
                runs.append(ProvenanceRun(d, stop, REALIGNED_PROMPT, turn, None))
                columns.untrained(stop - d)
            start, stop = max(d, previous_held), min(prompt_len, cap)
            if stop > start:
                runs.append(ProvenanceRun(start, stop, CONTEXT, turn, None))
                columns.untrained(stop - start)
        stop = min(output_end, cap)
        if stop > prompt_len:
            width = stop - prompt_len
            if rec.weight_version_spans is None:
                runs.append(ProvenanceRun(prompt_len, stop, MODEL, turn, rec.weight_version))
            else:  # a turn continued across a weight update: each token carries the version that drew it
                runs.extend(ProvenanceRun(prompt_len + lo, prompt_len + min(hi, width), MODEL, turn, version)
                            for lo, hi, version in rec.version_runs() if lo < width)
            if prompt_len < end < output_end:  # a later drift cut inside this output: not trained
                columns.untrained(width)
            else:
                columns.trained(rec, width)
                trained_turns.append(turn)
                trained_tokens += width

    budget_cut = n < full_length
    last = chain.last
    sample = Sample(
        tokens=list(chain.held()[:n]) if budget_cut else [*last.prompt_ids, *last.output_ids],
        response_start=min(chain.response_start, n),
        loss_mask=columns.loss_mask,
        rollout_logprobs=columns.logprobs,
        provenance=Provenance._trusted(runs),  # contiguous by construction; verify() re-checks
        status=sample_status(last.finish_reason, budget_cut=budget_cut, stop_reason=stop_reason),
        routed_experts=columns.routed,
    )
    return sample, {
        "trained_turns": trained_turns,
        "trained_tokens": trained_tokens,
        "budget_cut": budget_cut,
    }
