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

from agentrl.trajectory.provenance import CONTEXT, MODEL, PROMPT, REALIGNED, Provenance, ProvenanceRun
from agentrl.trajectory.records import TurnRecord
from agentrl.trajectory.sample import ABORTED, COMPLETED, TRUNCATED, Sample


@dataclass
class Chain:
    """An open sample of one session: turns merged so far and the tokens it holds."""

    turns: list[int]
    divergences: list[int]
    outcomes: list[str]  # per merged turn: new / branched / forked / clean / realigned / truncated
    last: TurnRecord  # the last merged turn: the sample holds exactly last.prompt_ids + last.output_ids
    response_start: int
    lost_turns: list[int] = field(default_factory=list)  # turns dropped when a cut hit the first prompt

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


def _status(records: list[TurnRecord], budget_cut: bool) -> str:
    if budget_cut:
        return TRUNCATED
    reason = records[-1].finish_reason
    if reason == "length":
        return TRUNCATED
    if reason == "abort":
        return ABORTED
    return COMPLETED


def assemble_sample(
    chain: Chain,
    records: list[TurnRecord],
    *,
    max_sample_tokens: int = 0,
) -> tuple[Sample, dict[str, Any]]:
    """Build the sample of ``chain``; also return layout facts (trained turns, budget cut) for metadata."""
    turns = chain.turns
    recs = [records[t] for t in turns]
    full_length = chain.held_length
    n = min(full_length, max_sample_tokens) if max_sample_tokens > 0 else full_length

    # Walk turns backwards; `limit` is the smallest later divergence, beyond which a turn's tokens are gone.
    segments: list[tuple[int, int, str, int, bool]] = []  # (start, end, source, k, trained)
    limit = full_length
    for k in range(len(turns) - 1, -1, -1):
        rec = recs[k]
        d = chain.divergences[k]
        prompt_len = len(rec.prompt_ids)
        output_end = prompt_len + len(rec.output_ids)
        end = limit
        if d < end:
            own: list[tuple[int, int, str, int, bool]] = []
            if k == 0:
                own.append((0, min(prompt_len, end), PROMPT, k, False))
            else:
                held_before = len(recs[k - 1].prompt_ids) + len(recs[k - 1].output_ids)
                own.append((d, min(held_before, prompt_len, end), REALIGNED, k, False))
                own.append((max(d, held_before), min(prompt_len, end), CONTEXT, k, False))
            cut_inside = prompt_len < end < output_end
            own.append((prompt_len, min(output_end, end), MODEL, k, not cut_inside))
            segments.extend(reversed(own))
        limit = min(limit, d)
    segments.reverse()

    runs: list[ProvenanceRun] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    trained_turns: list[int] = []
    trained_tokens = 0
    response_start = min(chain.response_start, n)
    for start, end, source, k, trained in segments:
        end = min(end, n)
        if end <= start:
            continue
        rec = recs[k]
        turn = turns[k]
        runs.append(ProvenanceRun(start, end, source, turn, rec.weight_version if source == MODEL else None))
        if source == PROMPT:
            continue
        width = end - start
        if trained:
            loss_mask += [1] * width
            if rec.output_logprobs:
                offset = len(rec.prompt_ids)
                logprobs += rec.output_logprobs[start - offset : end - offset]
            else:
                logprobs += [0.0] * width
            trained_turns.append(turn)
            trained_tokens += width
        else:
            loss_mask += [0] * width
            logprobs += [0.0] * width

    sample = Sample(
        tokens=list(chain.held()[:n])
        if n < full_length
        else [*chain.last.prompt_ids, *chain.last.output_ids],
        response_start=response_start,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        provenance=Provenance._trusted(runs),  # contiguous by construction; verify() re-checks
        status=_status(recs, n < full_length),
    )
    facts = {"trained_turns": trained_turns, "trained_tokens": trained_tokens, "budget_cut": n < full_length}
    return sample, facts
