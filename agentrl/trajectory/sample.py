"""``Sample``: one training sequence produced from a session, with per-token provenance."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agentrl.trajectory.provenance import Provenance, TokenProvenance

# Sample.status values. A sample is "truncated" when its last turn stopped on length, it was cut to
# max_sample_tokens, or a limit ended its episode; "aborted" when its last turn was aborted by the engine.
COMPLETED = "completed"
TRUNCATED = "truncated"
ABORTED = "aborted"
STATUSES = (COMPLETED, TRUNCATED, ABORTED)


class StopReason(StrEnum):
    """Why an episode stopped; a ``str``, so it reads as its value in JSON and metric keys."""

    DONE = "done"  # a tool set env.done
    NO_TOOL_CALL = "no_tool_call"  # the model replied without a tool call
    ABORT = "abort"  # the engine aborted the turn
    ERROR = "error"  # the episode raised
    MAX_TURNS = "max_turns"
    MAX_TOTAL_TOKENS = "max_total_tokens"
    CONTEXT_LENGTH = "context_length"
    LENGTH = "length"  # the final reply hit its max_new_tokens

    @property
    def cut_short(self) -> bool:
        """A limit ended the episode before the task did: its samples are truncated."""
        return self in _LIMITS


_LIMITS = frozenset(
    {StopReason.MAX_TURNS, StopReason.MAX_TOTAL_TOKENS, StopReason.CONTEXT_LENGTH, StopReason.LENGTH}
)


def sample_status(last_finish_reason: str, *, budget_cut: bool, stop_reason: StopReason | None) -> str:
    """The one rule for ``Sample.status``, from the sample's last turn, its budget cut and its episode."""
    if budget_cut or last_finish_reason == "length":
        return TRUNCATED
    if last_finish_reason == "abort":
        return ABORTED
    if stop_reason is not None and stop_reason.cut_short:
        return TRUNCATED
    return COMPLETED


# The largest |reward| accepted. The trainer holds rewards in float32 (max 3.4e38) and its group
# normalisation squares deviations and sums them over the group: (2 * 1e15)**2 * 1e6 samples = 4e36
# still fits, so no accepted reward can turn into inf or nan there, while any reward scale in use
# (scores, costs, log-likelihoods) stays far inside it.
REWARD_LIMIT = 1e15


class BadRewardError(ValueError):
    """A reward the trainer cannot use; the episode carrying it is counted and dropped."""


class NonFiniteRewardError(BadRewardError):
    """A reward (or a component of a dict reward) that is NaN or infinite: it would poison every weight."""


class RewardOutOfRangeError(BadRewardError):
    """A finite reward beyond ``REWARD_LIMIT`` (e.g. 1e39, -1e308, 10**400): inf or nan in float32 training."""


class NonNumericRewardError(BadRewardError, TypeError):
    """A reward that is not a real number (a string, None, a complex)."""


def check_reward(reward: float | Mapping[str, float]) -> None:
    """Raise a :class:`BadRewardError` unless ``reward`` (each value of a dict reward) is a real number
    with ``abs(value) <= REWARD_LIMIT``."""
    parts = reward.items() if isinstance(reward, Mapping) else (("", reward),)
    for key, value in parts:
        what = f"reward component {key!r}" if isinstance(reward, Mapping) else "reward"
        if not isinstance(value, numbers.Real):
            if not hasattr(type(value), "__float__") or isinstance(value, numbers.Complex):
                raise NonNumericRewardError(f"{what} must be a number, got {type(value).__name__}")
            value = float(value)  # a 0-d tensor or array
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int too large for a float64 (10**400)
            raise RewardOutOfRangeError(f"{what} must be within +-{REWARD_LIMIT:g}, got an integer of "
                                        f"{len(str(abs(value)))} digits") from None
        if not finite:
            raise NonFiniteRewardError(f"{what} must be a finite number, got {value!r}")
        if abs(value) > REWARD_LIMIT:
            raise RewardOutOfRangeError(f"{what} must be within +-{REWARD_LIMIT:g} (the trainer computes in "
                                        f"float32), got {value!r}")


def _routed_per_token(raw: Any) -> list[list[int] | None] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(
            row is None or (isinstance(row, list) and all(type(e) is int and e >= 0 for e in row)) for row in raw):
        raise ValueError("routed_experts must be a list with, per response token, null or a list of expert ids")
    return raw


_REQUIRED = ("tokens", "response_start", "loss_mask", "rollout_logprobs", "provenance")


@dataclass
class Sample:
    """A training sequence: ``tokens`` with ``loss_mask`` / ``rollout_logprobs`` over ``tokens[response_start:]``.

    ``provenance`` has one :class:`TokenProvenance` per token. ``metadata["turns"]`` lists the session
    turn indices merged into this sample, in merge order; :func:`agentrl.trajectory.verify` needs it.
    ``routed_experts`` (MoE engines that reported routing): per response token, the experts its turn's
    record holds for it where the token is trained (loss mask 1), else None; None when no turn had routing.
    """

    tokens: list[int]
    response_start: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    provenance: Provenance
    reward: float | dict[str, float] = 0.0
    status: str = COMPLETED
    session_id: str = ""
    group_id: str | int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: list[list[int] | None] | None = None

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; provenance is written as runs ``[start, end, source, turn, weight_version]``."""
        return {
            "tokens": list(self.tokens),
            "response_start": self.response_start,
            "loss_mask": list(self.loss_mask),
            "rollout_logprobs": list(self.rollout_logprobs),
            "provenance": self.provenance.to_list(),
            "reward": self.reward,
            "status": self.status,
            "session_id": self.session_id,
            "group_id": self.group_id,
            "metadata": self.metadata,
            **({} if self.routed_experts is None else {"routed_experts": self.routed_experts}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`. ``provenance`` may also be a per-token list of ``[source, turn, wv]``."""
        if not isinstance(data, dict):
            raise TypeError(f"a sample must be a JSON object, got {type(data).__name__}")
        missing = [key for key in _REQUIRED if key not in data]
        if missing:
            raise ValueError(f"sample dict lacks {missing}")
        tokens = list(data["tokens"])
        response_start = data["response_start"]
        if type(response_start) is not int or not 0 <= response_start <= len(tokens):
            raise ValueError(f"response_start {response_start!r} is outside 0..{len(tokens)}")
        check_reward(data.get("reward", 0.0))
        raw = data["provenance"]
        if raw and len(raw[0]) == 5 and isinstance(raw[0][0], int):
            provenance = Provenance(raw)
        else:
            provenance = Provenance.from_entries(TokenProvenance(*entry) for entry in raw)
        sample = cls(
            tokens=tokens,
            response_start=response_start,
            loss_mask=list(data["loss_mask"]),
            rollout_logprobs=[float(x) for x in data["rollout_logprobs"]],
            provenance=provenance,
            reward=data.get("reward", 0.0),
            status=data.get("status", COMPLETED),
            session_id=data.get("session_id", ""),
            group_id=data.get("group_id"),
            metadata=dict(data.get("metadata") or {}),
            routed_experts=_routed_per_token(data.get("routed_experts")),
        )
        n_resp = len(tokens) - response_start
        if not (
            len(sample.loss_mask) == len(sample.rollout_logprobs) == n_resp and len(provenance) == len(tokens)
            and (sample.routed_experts is None or len(sample.routed_experts) == n_resp)
        ):
            raise ValueError(
                f"inconsistent lengths: {len(tokens)} tokens, response_start {response_start}, "
                f"{len(sample.loss_mask)} loss_mask, {len(sample.rollout_logprobs)} rollout_logprobs, "
                f"{len(provenance)} provenance entries"
            )
        return sample

    @classmethod
    def from_json(cls, text: str) -> Sample:
        return cls.from_dict(json.loads(text))
