"""Drift policies: what to do when a new prompt does not extend the tokens a sample holds.

A policy sees a :class:`Drift` and returns one outcome:

* ``REALIGNED`` / ``DRIFT_CUT`` — cut the held tokens at the divergence, continue the same sample from
  the new prompt (the tokens that replace held ones get source ``realigned``, loss mask 0). A turn whose
  output the cut lands *inside* is un-trained; turns wholly after the cut leave the sample.
  ``REALIGNED`` names slime's bounded case (a short drift inside the latest response), ``DRIFT_CUT``
  any other cut.
* ``FORKED`` — leave the current sample as it is (every turn in it stays trained) and open a new sample
  from the new prompt.

Both outcomes keep every invariant; policies only trade lost signal against sample count.
Plug in your own with a :class:`DriftPolicy` subclass instance or a dotted path ``"pkg.module:Class"``.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a policy decided for one drifting turn (turn outcomes, not sample statuses or token sources).
REALIGNED = "realigned"
DRIFT_CUT = "cut"
FORKED = "forked"
DRIFT_OUTCOMES = (REALIGNED, DRIFT_CUT, FORKED)


@dataclass(frozen=True, slots=True)
class Drift:
    """Where a new prompt leaves the held tokens. Positions are token indices in the sample."""

    divergence: int  # first index where the new prompt differs from the held tokens (or ends)
    held_length: int  # len(held tokens) = end of the latest response
    latest_response_start: int  # where the latest turn's output begins in the held tokens
    response_start: int  # end of the sample's first prompt
    prompt_length: int  # len(new prompt)

    @property
    def in_latest_response(self) -> bool:
        return self.divergence >= self.latest_response_start

    @property
    def drifted_tokens(self) -> int:
        """Held tokens the new prompt does not reproduce."""
        return self.held_length - self.divergence


class DriftPolicy:
    """Base class: subclass and override :meth:`decide`."""

    name = "custom"

    def __init__(self, fork_threshold_tokens: int = 1024) -> None:
        if type(fork_threshold_tokens) is not int or fork_threshold_tokens < 0:
            raise ValueError(f"fork_threshold_tokens must be an int >= 0, got {fork_threshold_tokens!r}")
        self.fork_threshold_tokens = fork_threshold_tokens

    def decide(self, drift: Drift) -> str:  # pragma: no cover - abstract
        raise NotImplementedError


class RealignPolicy(DriftPolicy):
    """slime's CLEAN / REALIGN / FORK: realign a short drift inside the latest response, fork otherwise."""

    name = "realign"

    def decide(self, drift: Drift) -> str:
        if drift.in_latest_response and drift.drifted_tokens <= self.fork_threshold_tokens:
            return REALIGNED
        return FORKED


class ForkPolicy(DriftPolicy):
    """Never realign: every drift opens a new sample, so no sampled turn loses its training signal."""

    name = "fork"

    def decide(self, drift: Drift) -> str:
        return FORKED


class TruncatePolicy(DriftPolicy):
    """Cut the held tokens at the first divergence, un-train the turn the cut lands inside, continue."""

    name = "truncate"

    def decide(self, drift: Drift) -> str:
        return DRIFT_CUT


POLICIES: dict[str, type[DriftPolicy]] = {
    RealignPolicy.name: RealignPolicy,
    ForkPolicy.name: ForkPolicy,
    TruncatePolicy.name: TruncatePolicy,
}


def make_policy(policy: str | DriftPolicy, fork_threshold_tokens: int = 1024) -> DriftPolicy:
    """Resolve a policy name (``realign`` / ``fork`` / ``truncate``), a ``"module:Class"`` path or an instance."""
    if isinstance(policy, DriftPolicy):
        return policy
    from agentrl.plugins import resolve

    return resolve(policy, POLICIES, what="drift policy", base=DriftPolicy)(fork_threshold_tokens)
