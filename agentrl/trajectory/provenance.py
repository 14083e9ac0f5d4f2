"""Per-token provenance, stored as runs and expanded lazily.

A sample of 32k tokens has a handful of runs (prompt, then context / model / realigned stretches per
turn), so the hot path builds a few tuples instead of one Python object per token, while
``sample.provenance[i]`` and ``len(sample.provenance) == len(sample.tokens)`` still hold.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, overload

PROMPT = "prompt"  # the sample's first prompt (before response_start)
CONTEXT = "context"  # later prompt tokens that were not held before: user / tool / system / template
MODEL = "model"  # a recorded turn's output token at its sampled position
REALIGNED_PROMPT = "realigned_prompt"  # a later prompt's tokens placed where held tokens drifted
SOURCES = (PROMPT, CONTEXT, MODEL, REALIGNED_PROMPT)
# Samples written before the source had its own name (it shared "realigned" with the drift outcome).
_LEGACY_SOURCES = {"realigned": REALIGNED_PROMPT}


class TokenProvenance(NamedTuple):
    """Where one token came from: its source, the turn that introduced it, and (model tokens) the weights."""

    source: str
    turn: int
    weight_version: str | None = None


class ProvenanceRun(NamedTuple):
    """Tokens ``[start, end)`` share one provenance."""

    start: int
    end: int
    source: str
    turn: int
    weight_version: str | None = None


class Provenance(Sequence[TokenProvenance]):
    """A read-only sequence of :class:`TokenProvenance`, one per token, backed by runs."""

    __slots__ = ("_runs", "_starts")

    def __init__(self, runs: Iterable[ProvenanceRun | Sequence] = ()) -> None:
        checked: list[ProvenanceRun] = []
        position = 0
        for raw in runs:
            run = raw if isinstance(raw, ProvenanceRun) else ProvenanceRun(*raw)
            if run.source in _LEGACY_SOURCES:
                run = run._replace(source=_LEGACY_SOURCES[run.source])
            if run.start != position or run.end <= run.start:
                raise ValueError(
                    f"provenance runs must be contiguous and non-empty; got {tuple(run)} at {position}"
                )
            if run.source not in SOURCES:
                raise ValueError(f"unknown provenance source {run.source!r} (expected one of {SOURCES})")
            if type(run.turn) is not int or run.turn < 0:
                raise ValueError(f"provenance turn must be a non-negative int, got {run.turn!r}")
            if run.weight_version is not None and not isinstance(run.weight_version, str):
                raise ValueError(
                    f"provenance weight_version must be a str or None, got {run.weight_version!r}"
                )
            if checked and checked[-1][2:] == run[2:]:  # merge neighbours with equal provenance
                run = ProvenanceRun(checked.pop().start, run.end, *run[2:])
            checked.append(run)
            position = run.end
        self._runs = tuple(checked)
        self._starts = [r.start for r in self._runs]

    @classmethod
    def _trusted(cls, runs: list[ProvenanceRun]) -> Provenance:
        """Wrap runs the manager built (contiguous, valid, no equal neighbours) without re-checking them."""
        self = cls.__new__(cls)
        self._runs = tuple(runs)
        self._starts = [r.start for r in runs]
        return self

    @classmethod
    def from_entries(cls, entries: Iterable[TokenProvenance | Sequence]) -> Provenance:
        """Compact a per-token list back into runs."""
        runs = []
        for i, entry in enumerate(entries):
            runs.append(ProvenanceRun(i, i + 1, *entry))
        return cls(runs)

    @property
    def runs(self) -> tuple[ProvenanceRun, ...]:
        return self._runs

    def __len__(self) -> int:
        return self._runs[-1].end if self._runs else 0

    @overload
    def __getitem__(self, index: int) -> TokenProvenance: ...
    @overload
    def __getitem__(self, index: slice) -> list[TokenProvenance]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"provenance index {index} out of range for {n} tokens")
        run = self._runs[bisect.bisect_right(self._starts, index) - 1]
        return TokenProvenance(run.source, run.turn, run.weight_version)

    def __iter__(self) -> Iterator[TokenProvenance]:
        for run in self._runs:
            entry = TokenProvenance(run.source, run.turn, run.weight_version)
            for _ in range(run.end - run.start):
                yield entry

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Provenance):
            return self._runs == other._runs
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._runs)

    def __repr__(self) -> str:
        return f"Provenance({list(self._runs)!r})"

    def to_list(self) -> list[list]:
        """JSON form: ``[[start, end, source, turn, weight_version], ...]``."""
        return [list(run) for run in self._runs]
