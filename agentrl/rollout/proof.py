"""The contract enforced where a training batch is built: every Sample is re-proved against the turn
records of its session (:func:`agentrl.trajectory.verify_session`) before it may reach the buffer, and
one that does not verify is refused with a counted reason, never trained.

:class:`RecordingTrajectoryManager` keeps the records of each session it emits, since emitting consumes
the session; :func:`prove_groups` checks a batch against them and reports its cost.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from agentrl.trajectory import Sample, TrajectoryManager, TurnRecord
from agentrl.trajectory.verify import ProvenanceError, verify_session


class RecordingTrajectoryManager(TrajectoryManager):
    """A :class:`TrajectoryManager` that keeps each emitted session's turn records for the proof."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.emitted: dict[str, list[TurnRecord]] = {}

    def get_trajectory(self, session_id: str, **kwargs: Any) -> list[Sample]:
        self.emitted[session_id] = self.turns(session_id)
        return super().get_trajectory(session_id, **kwargs)


def _reason(exc: ProvenanceError) -> str:
    """A short, countable reason: the message without the token and sample positions."""
    detail = exc.detail.split(": ", 1)[-1] if exc.detail.startswith("sample ") else exc.detail
    return " ".join(w for w in detail.split() if not w.strip(",.:").isdigit())[:80]


def prove_groups(groups: list[list[Sample]], records: dict[str, list[TurnRecord]],
                 ) -> tuple[list[list[Sample]], dict[str, float], list[str]]:
    """Groups with every unproven sample removed (empty groups dropped), metrics
    (``verify/samples``, ``verify/refused``, ``verify/seconds``, ``verify/refused/<reason>``) and the
    refusal messages, one per refused session."""
    started = time.perf_counter()
    refused: Counter[str] = Counter()
    messages: list[str] = []
    bad_sessions: set[str] = set()
    by_session: dict[str, list[Sample]] = {}
    for group in groups:
        for sample in group:
            by_session.setdefault(sample.session_id, []).append(sample)
    for session_id, samples in by_session.items():
        turns = records.get(session_id)
        try:
            if turns is None:
                raise ProvenanceError("no turn records for this session")
            verify_session(samples, turns)
        except ProvenanceError as exc:
            bad_sessions.add(session_id)
            refused[_reason(exc)] += len(samples)
            messages.append(f"session {session_id!r}: {exc}")
    kept = [[s for s in g if s.session_id not in bad_sessions] for g in groups]
    metrics = {"verify/samples": float(sum(map(len, groups))), "verify/refused": float(sum(refused.values())),
               "verify/seconds": time.perf_counter() - started}
    metrics.update({f"verify/refused/{reason}": float(n) for reason, n in refused.items()})
    return [g for g in kept if g], metrics, messages
