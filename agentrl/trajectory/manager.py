"""``TrajectoryManager``: record turns per session, guard against drift, emit samples.

All state is plain dicts and lists and no method awaits or blocks, so it is safe to call from asyncio
code on one event loop. Every method validates its input before touching state, so a bad call raises
and leaves this session and every other session exactly as they were.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.trajectory.assemble import Chain, assemble_sample
from agentrl.trajectory.policies import DRIFT_OUTCOMES, FORKED, REALIGNED, Drift, DriftPolicy, make_policy
from agentrl.trajectory.records import TurnRecord
from agentrl.trajectory.sample import Sample, StopReason, check_reward
from agentrl.trajectory.tree import MessageTree, message_key

# Per-turn outcomes (besides the drift outcomes realigned / cut / forked):
NEW = "new"  # the first turn of a session
BRANCHED = "branched"  # a prompt that rewinds or branches off the message tree: a new sample
CLEAN = "clean"  # the prompt extends the held tokens exactly
TURN_OUTCOMES = (NEW, CLEAN, BRANCHED, *DRIFT_OUTCOMES)
# Metadata keys the manager writes; "turns" is what verify() replays, so callers may not override them.
RESERVED_METADATA = frozenset(
    {
        "turns",
        "trained_turns",
        "untrained_turns",
        "lost_turns",
        "outcomes",
        "drift",
        "drift_points",
        "forked",
        "branched",
        "realigned",
        "truncated",
        "use_tool",
        "finish_reasons",
        "weight_versions",
        "turn_metadata",
        "stop_reason",
    }
)


class UnknownSessionError(KeyError):
    """No session with this id is being recorded (never recorded, dropped, or already consumed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown session"


def common_prefix_length(a: Sequence[int] | bytes, b: Sequence[int] | bytes) -> int:
    """Length of the longest common prefix of two sequences, by C-level slice compares (binary search).

    On ``bytes`` the compares are memcmp; pass :attr:`TurnRecord.packed_prompt`-style uint32 bytes and
    divide by 4 to get a token index.
    """
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


@dataclass
class _Session:
    tree: MessageTree = field(default_factory=MessageTree)
    records: list[TurnRecord] = field(default_factory=list)
    turn_metadata: list[dict[str, Any] | None] = field(default_factory=list)
    used_tool: list[bool] = field(default_factory=list)
    chains: list[Chain] = field(default_factory=list)
    tips: dict[int, Chain] = field(default_factory=dict)  # last turn of an open chain -> chain
    last_chain: Chain | None = None


class TrajectoryManager:
    """Merge the turns of each session into training samples under a drift policy.

    ``policy`` is ``"realign"`` (slime's CLEAN / REALIGN / FORK), ``"fork"``, ``"truncate"``, a
    ``"module:Class"`` path or a :class:`DriftPolicy` instance. ``fork_threshold_tokens`` bounds how
    many drifted tokens ``realign`` overwrites before it forks instead.
    """

    def __init__(self, policy: str | DriftPolicy = "realign", fork_threshold_tokens: int = 1024) -> None:
        self.policy = make_policy(policy, fork_threshold_tokens)
        self._sessions: dict[str, _Session] = {}
        self._stats: Counter[str] = Counter()

    # -- queries -------------------------------------------------------------------------------
    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    def turn_count(self, session_id: str) -> int:
        return len(self._session(session_id).records)

    def turns(self, session_id: str) -> list[TurnRecord]:
        """The session's turn records, indexed by turn number (what :func:`verify` checks against)."""
        return list(self._session(session_id).records)

    @property
    def sessions(self) -> list[str]:
        return list(self._sessions)

    @property
    def stats(self) -> dict[str, int]:
        """Counts since construction: turns per outcome (new / clean / branched / realigned / cut /
        forked) and, from emitted samples, ``samples``, ``turns_untrained`` and ``tokens_untrained``."""
        out = dict.fromkeys(TURN_OUTCOMES, 0)
        out.update(samples=0, turns_untrained=0, tokens_untrained=0)
        out.update(self._stats)
        return out

    # -- recording -----------------------------------------------------------------------------
    def record_turn(
        self,
        session_id: str,
        *,
        turn: TurnRecord,
        prompt_messages: Sequence[Mapping[str, Any]],
        response_message: Mapping[str, Any],
        metadata: Mapping[str, Any] | None = None,
    ) -> str:
        """Merge one sampled turn into its session; return its outcome (``clean``, ``realigned``, ...)."""
        if not isinstance(session_id, str) or not session_id:
            raise TypeError(f"session_id must be a non-empty str, got {session_id!r}")
        if not isinstance(turn, TurnRecord):
            raise TypeError(f"turn must be a TurnRecord, got {type(turn).__name__}")
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a mapping or None, got {type(metadata).__name__}")
        session = self._sessions.get(session_id) or _Session()
        path = session.tree.locate(prompt_messages)
        response_key = message_key(response_message)
        index = len(session.records)
        chain, divergence, outcome = self._place(session, path.producers, turn)

        # Everything below only mutates; nothing can raise on well-typed state.
        if chain is None:
            chain = Chain.start(index, turn, outcome)
            session.chains.append(chain)
        elif divergence < chain.response_start:  # a cut inside the first prompt keeps nothing trained
            session.tips.pop(chain.turns[-1], None)
            lost = [t for t in chain.turns if session.records[t].output_ids]
            restarted = Chain.start(index, turn, outcome)
            restarted.lost_turns = chain.lost_turns + lost
            chain.__dict__.update(restarted.__dict__)
        else:
            session.tips.pop(chain.turns[-1], None)
            chain.extend(index, turn, divergence, outcome)
            if outcome != CLEAN:
                chain.drift_points.append({"turn": index, "position": divergence, "outcome": outcome})
        session.tips[index] = chain
        session.last_chain = chain
        session.records.append(turn)
        session.turn_metadata.append(dict(metadata) if metadata else None)
        session.used_tool.append(bool(response_message.get("tool_calls")))
        session.tree.add(path, response_message, response_key, index)
        self._sessions[session_id] = session
        self._stats[outcome] += 1
        return outcome

    def _place(
        self, session: _Session, producers: list[int], turn: TurnRecord
    ) -> tuple[Chain | None, int, str]:
        """Decide (without mutating) which chain the turn joins, at which divergence, with which outcome."""
        if not session.records:
            return None, 0, NEW
        prompt = turn.prompt_ids
        chain = next((session.tips[t] for t in reversed(producers) if t in session.tips), None)
        if chain is None:
            # No open sample ends on this message path. An exact token extension of the latest sample
            # is still provably safe (e.g. the caller reformatted a message); anything else branches.
            last = session.last_chain
            if last is not None and last.is_extended_by(turn):
                return last, last.held_length, CLEAN
            return None, 0, BRANCHED
        if chain.is_extended_by(turn):
            return chain, chain.held_length, CLEAN
        drift = Drift(
            divergence=common_prefix_length(chain.held_packed(), turn.packed_prompt) // 4,
            held_length=chain.held_length,
            latest_response_start=chain.latest_output_start,
            response_start=chain.response_start,
            prompt_length=len(prompt),
        )
        outcome = self.policy.decide(drift)
        if outcome not in DRIFT_OUTCOMES:
            raise ValueError(
                f"drift policy {self.policy.name!r} returned {outcome!r}; expected one of {DRIFT_OUTCOMES}"
            )
        if outcome == FORKED:
            return None, 0, FORKED
        return chain, drift.divergence, outcome

    # -- emitting ------------------------------------------------------------------------------
    def get_trajectory(
        self,
        session_id: str,
        *,
        reward: float | dict[str, float] = 0.0,
        extra_metadata: Mapping[str, Any] | None = None,
        max_sample_tokens: int = 0,
        group_id: str | int | None = None,
        stop_reason: StopReason | str | None = None,
    ) -> list[Sample]:
        """Consume the session and return its samples (one per chain, in creation order).

        ``max_sample_tokens > 0`` cuts longer samples (``metadata["truncated"] = True``); tokens kept
        before the cut stay trained, as with ``finish_reason="length"``. ``stop_reason`` (why the
        episode ended; also ``metadata["stop_reason"]``) marks every sample truncated when a limit
        ended the episode.
        """
        session = self._session(session_id)
        if stop_reason is not None:
            stop_reason = StopReason(stop_reason)  # a plain string is accepted; an unknown one raises
        if isinstance(reward, bool) or not isinstance(reward, int | float | dict):
            raise TypeError(f"reward must be a float (or a dict of floats), got {type(reward).__name__}")
        check_reward(reward)  # before the session is consumed: a corrected call still finds it
        if extra_metadata is not None and not isinstance(extra_metadata, Mapping):
            raise TypeError(f"extra_metadata must be a mapping or None, got {type(extra_metadata).__name__}")
        if type(max_sample_tokens) is not int or max_sample_tokens < 0:
            raise ValueError(f"max_sample_tokens must be an int >= 0, got {max_sample_tokens!r}")
        clashes = sorted(set(extra_metadata) & RESERVED_METADATA) if extra_metadata else None
        if clashes:
            raise ValueError(f"extra_metadata may not override the contract's metadata keys {clashes}")

        samples = [
            self._build(session_id, session, chain, reward, extra_metadata, max_sample_tokens, group_id,
                        stop_reason)
            for chain in session.chains
        ]
        del self._sessions[session_id]
        return samples

    def drop_session(self, session_id: str) -> None:
        """Forget a session without emitting samples (e.g. the episode failed)."""
        self._session(session_id)
        del self._sessions[session_id]

    def _session(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except (KeyError, TypeError):
            raise UnknownSessionError(
                f"unknown session {session_id!r} (never recorded, dropped, or already consumed by get_trajectory)"
            ) from None

    def _build(
        self,
        session_id: str,
        session: _Session,
        chain: Chain,
        reward: float | dict[str, float],
        extra_metadata: Mapping[str, Any] | None,
        max_sample_tokens: int,
        group_id: str | int | None,
        stop_reason: StopReason | None,
    ) -> Sample:
        sample, facts = assemble_sample(
            chain, session.records, max_sample_tokens=max_sample_tokens, stop_reason=stop_reason
        )
        records = session.records
        trained = set(facts["trained_turns"])
        untrained = [t for t in chain.turns if t not in trained and records[t].output_ids]
        counts = dict.fromkeys(TURN_OUTCOMES, 0)
        for outcome in chain.outcomes:
            counts[outcome] += 1
        metadata: dict[str, Any] = {
            "turns": list(chain.turns),
            "trained_turns": [t for t in chain.turns if t in trained],
            "untrained_turns": untrained,
            "lost_turns": list(chain.lost_turns),
            "outcomes": list(chain.outcomes),
            "drift": counts,
            "drift_points": [dict(point) for point in chain.drift_points],
            "forked": chain.outcomes[0] == FORKED,
            "branched": chain.outcomes[0] == BRANCHED,
            "realigned": counts[REALIGNED],
            "truncated": facts["budget_cut"],
            "use_tool": any(session.used_tool[t] for t in chain.turns),
            "finish_reasons": [records[t].finish_reason for t in chain.turns],
            "weight_versions": sorted(
                {v for t in trained for _, _, v in records[t].version_runs() if v is not None}
            ),
        }
        turn_metadata = [session.turn_metadata[t] for t in chain.turns]
        if any(turn_metadata):
            metadata["turn_metadata"] = turn_metadata
        if stop_reason is not None:
            metadata["stop_reason"] = stop_reason
        if extra_metadata:
            metadata.update(extra_metadata)
        sample.reward = reward
        sample.session_id = session_id
        sample.group_id = group_id
        sample.metadata = metadata
        self._stats["samples"] += 1
        self._stats["turns_untrained"] += len(untrained) + len(chain.lost_turns)
        self._stats["tokens_untrained"] += (
            sum(len(records[t].output_ids) for t in chain.turns + chain.lost_turns) - facts["trained_tokens"]
        )
        return sample
