"""``verify``: re-prove a sample's invariants from the turn records alone.

Written independently of the manager's layout code: it replays the merge from ``sample.metadata["turns"]``
and the :class:`TurnRecord` s, and checks every token id, loss-mask bit, log-prob and provenance entry
(each model token at the weight version that drew it). It checks a stretch of tokens at a time with
C-level compares; where anything differs, a token-by-token walk names the first offending token in
:class:`ProvenanceError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agentrl.trajectory.provenance import CONTEXT, MODEL, PROMPT, REALIGNED_PROMPT, Provenance
from agentrl.trajectory.records import TurnRecord
from agentrl.trajectory.sample import Sample

_INT = {int}


class ProvenanceError(ValueError):
    """A sample breaks the trajectory contract; ``index`` is the first offending token (None: sample-level)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message if index is None else f"token {index}: {message}")
        self.index = index
        self.detail = message


def _prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class _Replay:
    """The merge of ``recs`` (the sample's turns, in ``order``) replayed from the records alone."""

    order: list[int]  # session turn index of each merged turn
    recs: list[TurnRecord]
    full: list[tuple[int, ...]]  # each turn's prompt + outputs
    divergences: list[int]  # where turn k leaves the tokens held before it (0 for the first)
    owner: list[int]  # owner[i] = the last merged turn k with divergence <= i
    later_min: list[float]  # the smallest divergence of any turn after k (inf for the last)


def _check_lengths(sample: Sample) -> None:
    """Invariant 3: ``response_start``, loss mask, log-probs and provenance cover the tokens they must."""
    n, rs = len(sample.tokens), sample.response_start
    if type(rs) is not int or not 0 <= rs <= n:
        raise ProvenanceError(f"response_start {rs!r} is outside 0..{n}")
    if len(sample.loss_mask) != n - rs or len(sample.rollout_logprobs) != n - rs:
        raise ProvenanceError(
            f"loss_mask ({len(sample.loss_mask)}) and rollout_logprobs ({len(sample.rollout_logprobs)}) "
            f"must both cover tokens[response_start:] ({n - rs})"
        )
    if len(sample.provenance) != n:
        raise ProvenanceError(f"{len(sample.provenance)} provenance entries for {n} tokens")
    if sample.routed_experts is not None and len(sample.routed_experts) != n - rs:
        raise ProvenanceError(f"routed_experts ({len(sample.routed_experts)}) must cover tokens[response_start:] ({n - rs})")


def _merged_turns(sample: Sample, turns: Sequence[TurnRecord] | Mapping[int, TurnRecord]) -> tuple[list[int], list[TurnRecord]]:
    """``metadata["turns"]`` (checked: distinct recorded indices) and their records."""
    order = sample.metadata.get("turns")
    if not isinstance(order, list) or not order or not all(type(t) is int and t >= 0 for t in order):
        raise ProvenanceError(f"metadata['turns'] must be a non-empty list of turn indices, got {order!r}")
    if len(set(order)) != len(order):
        raise ProvenanceError(f"metadata['turns'] repeats a turn: {order}")
    try:
        return order, [turns[t] for t in order]
    except (IndexError, KeyError) as exc:
        raise ProvenanceError(f"metadata['turns'] names a turn that was not recorded: {exc}") from None


def _replay(sample: Sample, order: list[int], recs: list[TurnRecord]) -> _Replay:
    """Replay the merge (each turn's divergence from the tokens held before it) and check its layout:
    the sample starts at the first prompt's end, no turn leaves the first prompt, and the sample is the
    last turn's tokens (a prefix of them only when marked truncated)."""
    n, rs = len(sample.tokens), sample.response_start
    full = [rec.prompt_ids + rec.output_ids for rec in recs]
    divergences = [0] + [_prefix(full[k - 1], recs[k].prompt_ids) for k in range(1, len(recs))]
    first_prompt = len(recs[0].prompt_ids)
    if rs != min(first_prompt, n):
        raise ProvenanceError(f"response_start {rs} is not the first turn's prompt length {first_prompt}")
    for k in range(1, len(recs)):
        if divergences[k] < first_prompt:
            raise ProvenanceError(
                f"turn {order[k]} leaves the sample's first prompt at {divergences[k]}: it cannot share this sample"
            )
    if n > len(full[-1]):
        raise ProvenanceError(f"{n} tokens but the last turn holds only {len(full[-1])}", len(full[-1]))
    if n < len(full[-1]) and not sample.metadata.get("truncated"):
        raise ProvenanceError("sample is shorter than its last turn but metadata['truncated'] is not set", n)
    owner = [0] * n
    for k in range(1, len(recs)):
        owner[divergences[k] : n] = [k] * max(0, n - divergences[k])
    later_min = [math.inf] * len(recs)
    for k in range(len(recs) - 2, -1, -1):
        later_min[k] = min(later_min[k + 1], divergences[k + 1])
    return _Replay(order, recs, full, divergences, owner, later_min)


def _source(replay: _Replay, i: int, response_start: int) -> str:
    """Which provenance source the replay gives token ``i``."""
    k = replay.owner[i]
    if i < response_start:
        return PROMPT
    if i >= len(replay.recs[k].prompt_ids):
        return MODEL
    if k > 0 and i < len(replay.full[k - 1]):
        return REALIGNED_PROMPT
    return CONTEXT


def _check_token(sample: Sample, replay: _Replay, i: int) -> bool:
    """Check token ``i``'s id, provenance, loss-mask bit and log-prob against the replay; whether it is
    trained (invariants 1 and 2)."""
    rs = sample.response_start
    k = replay.owner[i]
    rec, turn = replay.recs[k], replay.order[k]
    token, prov = sample.tokens[i], sample.provenance[i]
    source = _source(replay, i, rs)
    expected_wv = rec.version_at(i - len(rec.prompt_ids)) if source == MODEL else None
    if type(token) is not int or token != replay.full[k][i]:
        raise ProvenanceError(f"id {token!r} but turn {turn} recorded {replay.full[k][i]} here ({source})", i)
    if tuple(prov) != (source, turn, expected_wv):
        raise ProvenanceError(f"provenance {tuple(prov)} but the replay gives {(source, turn, expected_wv)}", i)
    if i < rs:
        return False
    prompt_len = len(rec.prompt_ids)
    # A later turn that diverges inside this turn's outputs takes them over: they are context there.
    trained = source == MODEL and not (prompt_len < replay.later_min[k] < prompt_len + len(rec.output_ids))
    mask = sample.loss_mask[i - rs]
    if type(mask) is not int or mask != int(trained):
        raise ProvenanceError(f"loss mask {mask!r} but a {source} token of turn {turn} must have {int(trained)}", i)
    if sample.routed_experts is not None:
        _check_routing(sample, rec, turn, i, trained)
    expected_lp = rec.output_logprobs[i - prompt_len] if trained and rec.output_logprobs else 0.0
    if sample.rollout_logprobs[i - rs] != expected_lp:
        raise ProvenanceError(
            f"rollout log-prob {sample.rollout_logprobs[i - rs]!r} but turn {turn} sampled it with {expected_lp!r}", i
        )
    return trained


def _check_routing(sample: Sample, rec: TurnRecord, turn: int, i: int, trained: bool) -> None:
    """A trained token carries exactly the experts its turn recorded for it; any other token none."""
    got = sample.routed_experts[i - sample.response_start]
    want = (list(rec.routed_experts[i - len(rec.prompt_ids)])
            if trained and rec.routed_experts is not None else None)
    if got != want:
        raise ProvenanceError(f"routed experts {got!r} but turn {turn} recorded {want!r} for this token", i)


def _expected_runs(replay: _Replay, k: int, a: int, b: int, rs: int) -> list[tuple]:
    """The provenance the replay gives tokens ``[a, b)``, all owned by merged turn ``k``, as runs: the rule of
    :func:`_source` (prompt, then realigned / context below the turn's prompt length, then model split by
    the versions that drew the outputs) at run granularity."""
    rec, turn = replay.recs[k], replay.order[k]
    plen = len(rec.prompt_ids)
    previous = len(replay.full[k - 1]) if k > 0 else 0
    cuts = [(min(b, rs), PROMPT), (min(b, plen, previous), REALIGNED_PROMPT), (min(b, plen), CONTEXT)]
    runs, lo = [], a
    for hi, source in cuts:
        if hi > lo:
            runs.append((lo, hi, source, turn, None))
            lo = hi
    for start, end, version in rec.version_runs():
        start, end = max(lo, plen + start), min(b, plen + end)
        if end > start:
            runs.append((start, end, MODEL, turn, version))
    return runs


def _verified_by_runs(sample: Sample, replay: _Replay) -> set[int] | None:
    """What the token walk (:func:`_check_token` on every token) proves, checked a run at a time with C-level
    slice compares: the merged turns with a trained token, or None when anything differs or is unusual
    (then the walk runs and names the first offending token). Never accepts what the walk refuses."""
    prov, tokens, n, rs = sample.provenance, sample.tokens, len(sample.tokens), sample.response_start
    if (not isinstance(prov, Provenance) or sample.routed_experts is not None
            or not set(map(type, tokens)) <= _INT or not set(map(type, sample.loss_mask)) <= _INT):
        return None
    expected: list[tuple] = []
    trained: set[int] = set()
    for k, rec in enumerate(replay.recs):
        a, b = replay.divergences[k], min(n, replay.later_min[k])  # the tokens turn k owns
        if b <= a:
            continue
        if tuple(tokens[a:b]) != replay.full[k][a:b]:
            return None
        plen = len(rec.prompt_ids)
        cut = plen < replay.later_min[k] < plen + len(rec.output_ids)
        for run in _expected_runs(replay, k, a, b, rs):
            lo, hi = max(run[0], rs), run[1]
            if expected and expected[-1][2:] == run[2:]:
                run = (expected.pop()[0], *run[1:])
            expected.append(run)
            if hi <= lo:
                continue
            is_trained = run[2] == MODEL and not cut
            mask, lps = sample.loss_mask[lo - rs : hi - rs], sample.rollout_logprobs[lo - rs : hi - rs]
            if mask != [int(is_trained)] * (hi - lo):
                return None
            if is_trained and rec.output_logprobs:
                if lps != list(rec.output_logprobs[lo - plen : hi - plen]):
                    return None
            elif lps != [0.0] * (hi - lo):
                return None
            if is_trained:
                trained.add(k)
    return trained if list(prov.runs) == expected else None


def _check_trained_context(sample: Sample, replay: _Replay, k: int) -> None:
    """Invariant 1 stated directly: trained turn ``k``'s whole left context is what the engine saw."""
    tokens, n = sample.tokens, len(sample.tokens)
    rec, turn = replay.recs[k], replay.order[k]
    prompt_len = len(rec.prompt_ids)
    if tuple(tokens[:prompt_len]) != rec.prompt_ids:
        raise ProvenanceError(f"turn {turn} is trained but the sample differs from its prompt here",
                              _prefix(tokens, rec.prompt_ids))
    end = min(n, prompt_len + len(rec.output_ids))
    if tuple(tokens[prompt_len:end]) != rec.output_ids[: end - prompt_len]:
        bad = prompt_len + _prefix(tokens[prompt_len:end], rec.output_ids)
        raise ProvenanceError(f"turn {turn} is trained but its outputs differ here", bad)


def verify(sample: Sample, turns: Sequence[TurnRecord] | Mapping[int, TurnRecord]) -> None:
    """Raise :class:`ProvenanceError` unless ``sample`` is a faithful merge of ``turns``.

    Proves: lengths agree (invariant 3); every token equals the record that introduced it; every
    trained token is a recorded output token whose full left context equals that turn's prompt plus its
    earlier outputs, with the sampled log-prob (1); only such tokens are trained (2); each turn is
    trained at most once (5); provenance, loss mask and log-probs match the replay exactly.
    """
    _check_lengths(sample)
    order, recs = _merged_turns(sample, turns)
    replay = _replay(sample, order, recs)
    trained = _verified_by_runs(sample, replay)
    if trained is None:  # something differs: the token walk finds (and names) it
        trained = {replay.owner[i] for i in range(len(sample.tokens)) if _check_token(sample, replay, i)}
    for k in sorted(trained):
        _check_trained_context(sample, replay, k)


def trained_turns(sample: Sample) -> set[int]:
    """Session turn indices with at least one trained token in ``sample``."""
    rs = sample.response_start
    out = set()
    for run in sample.provenance.runs:
        if run.source == MODEL and any(sample.loss_mask[max(run.start, rs) - rs : run.end - rs]):
            out.add(run.turn)
    return out


def verify_session(samples: Sequence[Sample], turns: Sequence[TurnRecord] | Mapping[int, TurnRecord]) -> None:
    """:func:`verify` each sample, and prove that no turn is trained in two samples (invariant 5)."""
    seen: dict[int, int] = {}
    for index, sample in enumerate(samples):
        try:
            verify(sample, turns)
        except ProvenanceError as exc:
            raise ProvenanceError(f"sample {index}: {exc.detail}", exc.index) from None
        for turn in trained_turns(sample):
            if turn in seen:
                raise ProvenanceError(f"turn {turn} is trained in samples {seen[turn]} and {index}")
            seen[turn] = index
