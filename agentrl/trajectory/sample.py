"""``Sample``: one training sequence produced from a session, with per-token provenance."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentrl.trajectory.provenance import Provenance, TokenProvenance

# Sample.status values. A sample is "truncated" when its last turn stopped on length or it was cut to
# max_sample_tokens, "aborted" when its last turn was aborted by the engine.
COMPLETED = "completed"
TRUNCATED = "truncated"
ABORTED = "aborted"
STATUSES = (COMPLETED, TRUNCATED, ABORTED)

_REQUIRED = ("tokens", "response_start", "loss_mask", "rollout_logprobs", "provenance")


@dataclass
class Sample:
    """A training sequence: ``tokens`` with ``loss_mask`` / ``rollout_logprobs`` over ``tokens[response_start:]``.

    ``provenance`` has one :class:`TokenProvenance` per token. ``metadata["turns"]`` lists the session
    turn indices merged into this sample, in merge order; :func:`agentrl.trajectory.verify` needs it.
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

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.response_start

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
        )
        n_resp = len(tokens) - response_start
        if not (
            len(sample.loss_mask) == len(sample.rollout_logprobs) == n_resp and len(provenance) == len(tokens)
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
