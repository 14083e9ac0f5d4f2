"""``TurnRecord``: one ``/generate`` call exactly as the engine served it.

It is the only source of trainable tokens, so it is validated once, on construction, and then frozen
(token ids and log-probs are stored as tuples).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

_INT = {int}
_NUMBER = {float, int}


def _token_ids(name: str, values: Iterable[int]) -> tuple[int, ...]:
    if isinstance(values, str | bytes | Mapping):
        raise TypeError(f"{name} must be a sequence of int token ids, got {type(values).__name__}")
    ids = tuple(values)
    # One C-level pass over the types: bool, float, numpy ints, strings are all rejected here.
    kinds = set(map(type, ids))
    if not kinds <= _INT:
        bad = next(i for i, v in enumerate(ids) if type(v) is not int)
        raise TypeError(f"{name}[{bad}] must be an int token id, got {type(ids[bad]).__name__} {ids[bad]!r}")
    return ids


def _packed(name: str, ids: tuple[int, ...]) -> bytes:
    """Token ids as uint32 bytes: prefix checks become memcmp. Also rejects negative / huge ids."""
    try:
        return array("I", ids).tobytes()
    except OverflowError:
        bad = next(i for i, v in enumerate(ids) if not 0 <= v < 2**32)
        raise ValueError(
            f"{name}[{bad}] is not a valid token id ({ids[bad]}): negative or >= 2**32"
        ) from None


def _logprobs(values: Iterable[float]) -> tuple[float, ...]:
    if isinstance(values, str | bytes | Mapping):
        raise TypeError(f"output_logprobs must be a sequence of floats, got {type(values).__name__}")
    lps = tuple(values)
    kinds = set(map(type, lps))
    if not kinds <= _NUMBER:
        bad = next(i for i, v in enumerate(lps) if type(v) not in _NUMBER)
        raise TypeError(f"output_logprobs[{bad}] must be a float, got {type(lps[bad]).__name__} {lps[bad]!r}")
    if int in kinds:
        lps = tuple(map(float, lps))
    if lps and math.isnan(sum(lps)):  # NaN (or +inf and -inf together) somewhere: find it
        bad = next((i for i, v in enumerate(lps) if math.isnan(v)), None)
        if bad is not None:
            raise ValueError(f"output_logprobs[{bad}] is NaN")
    return lps


def _routed_experts(values: Any, n_output: int) -> tuple[tuple[int, ...], ...]:
    """Per output token, the expert ids an MoE engine routed it through (one flat ``layers x k`` list each)."""
    if isinstance(values, str | bytes | Mapping):
        raise TypeError(f"routed_experts must be a list of expert-id lists, got {type(values).__name__}")
    rows = tuple(values)
    if len(rows) != n_output:
        raise ValueError(f"routed_experts has {len(rows)} entries for {n_output} output ids (one per output id)")
    out = tuple(_token_ids(f"routed_experts[{i}]", row) for i, row in enumerate(rows))
    if out and (not out[0] or any(len(row) != len(out[0]) for row in out)):
        raise ValueError("routed_experts entries must all hold the same (non-zero) number of expert ids")
    if any(e < 0 for row in out for e in row):
        raise ValueError("routed_experts holds a negative expert id")
    return out


def _version_order(version: str) -> int | None:
    """A version's place in training order when it is a step number (``"3"``, read as
    :func:`agentrl.rollout.buffer.version_number` reads it); None for a label (``"default"``)."""
    try:
        return int(version)
    except ValueError:
        return None


def _version_spans(values: Any, n_output: int) -> tuple[tuple[int, str], ...]:
    """Which weight version drew which output tokens: ``[first index, version]`` per run, as the engine's
    ``meta_info.weight_version_spans`` reports a turn continued across a weight update. Checked: the first
    run starts at 0, starts strictly increase and lie inside the output (an empty output has the one run
    ``[0, v]``), versions are strings and step-number versions never go back. Equal neighbours merge."""
    if not isinstance(values, list | tuple):
        raise TypeError(f"weight_version_spans must be a list of [start, version] pairs, got {type(values).__name__}")
    spans: list[tuple[int, str]] = []
    previous, highest = -1, None  # the last start read; the latest step-number version
    for i, span in enumerate(values):
        if not isinstance(span, list | tuple) or len(span) != 2:
            raise ValueError(f"weight_version_spans[{i}] must be a [start, version] pair, got {span!r}")
        start, version = span
        if type(start) is not int:
            raise TypeError(f"weight_version_spans[{i}] start must be an int, got {type(start).__name__} {start!r}")
        if not isinstance(version, str):
            raise TypeError(f"weight_version_spans[{i}] version must be a str, got {type(version).__name__} {version!r}")
        if i == 0 and start != 0:
            raise ValueError(f"weight_version_spans must start at token 0, the first starts at {start}")
        if start <= previous:
            raise ValueError(f"weight_version_spans starts must strictly increase: {start} after {previous}")
        if start >= max(n_output, 1):
            raise ValueError(f"weight_version_spans[{i}] starts at {start}, outside the {n_output} output ids")
        order = _version_order(version)
        if order is not None and highest is not None and order < highest[0]:
            raise ValueError(f"weight_version_spans go back from version {highest[1]!r} to {version!r} at token {start}")
        if order is not None:
            highest = (order, version)
        previous = start
        if not spans or version != spans[-1][1]:  # equal neighbours: the same weights go on, one run
            spans.append((start, version))
    if not spans:
        raise ValueError("weight_version_spans is empty: a turn was drawn by at least one version")
    return tuple(spans)


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One sampled turn: the exact prompt ids sent, the sampled ids and their log-probs.

    ``output_logprobs`` is empty (the engine returned none) or one float per output id.
    ``finish_reason`` is the engine's reason string: ``"stop"``, ``"length"``, ``"abort"``, ...
    ``routed_experts`` (MoE engines, when asked): per output id, the experts every MoE layer chose at the
    position the id was sampled from, flat ``layers x k``; None when the engine reported none.
    ``weight_version_spans``: a turn continued across a weight update (``partial_rollout: resume``) was
    drawn by several versions: ``((first index, version), ...)`` over the output ids, as the engine reports
    them; None when one version, ``weight_version``, drew every token. :meth:`version_at` reads either.
    """

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    finish_reason: str
    weight_version: str | None = None
    routed_experts: tuple[tuple[int, ...], ...] | None = None
    weight_version_spans: tuple[tuple[int, str], ...] | None = None
    # uint32 bytes of prompt_ids / output_ids, for memcmp-speed prefix checks in the drift guard.
    packed_prompt: bytes = field(init=False, repr=False, compare=False)
    packed_output: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prompt = _token_ids("prompt_ids", self.prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids is empty: a turn needs the prompt it was sampled from")
        output = _token_ids("output_ids", self.output_ids)
        packed_prompt = _packed("prompt_ids", prompt)
        packed_output = _packed("output_ids", output)
        lps = _logprobs(self.output_logprobs)
        if lps and len(lps) != len(output):
            raise ValueError(
                f"output_logprobs has {len(lps)} entries for {len(output)} output ids "
                "(it must be empty or one log-prob per output id)"
            )
        if not isinstance(self.finish_reason, str) or not self.finish_reason:
            raise TypeError(f"finish_reason must be a non-empty str, got {self.finish_reason!r}")
        if self.weight_version is not None and not isinstance(self.weight_version, str):
            raise TypeError(f"weight_version must be a str or None, got {type(self.weight_version).__name__}")
        object.__setattr__(self, "prompt_ids", prompt)
        object.__setattr__(self, "output_ids", output)
        object.__setattr__(self, "output_logprobs", lps)
        if self.routed_experts is not None:
            object.__setattr__(self, "routed_experts", _routed_experts(self.routed_experts, len(output)))
        if self.weight_version_spans is not None:
            spans = _version_spans(self.weight_version_spans, len(output))
            # one run of the turn's own version says nothing more than weight_version does
            object.__setattr__(self, "weight_version_spans",
                               None if len(spans) == 1 and spans[0][1] == self.weight_version else spans)
        object.__setattr__(self, "packed_prompt", packed_prompt)
        object.__setattr__(self, "packed_output", packed_output)

    def version_runs(self) -> tuple[tuple[int, int, str | None], ...]:
        """``(start, end, version)`` over the output ids: one run, or one per weight version that drew them."""
        n = len(self.output_ids)
        spans = self.weight_version_spans
        if spans is None:
            return ((0, n, self.weight_version),)
        ends = [start for start, _ in spans[1:]] + [n]
        return tuple((start, end, version) for (start, version), end in zip(spans, ends, strict=True))

    def version_at(self, index: int) -> str | None:
        """The weight version that drew output token ``index``."""
        spans = self.weight_version_spans
        if spans is None:
            return self.weight_version
        version = spans[0][1]
        for start, v in spans:
            if start > index:
                break
            version = v
        return version

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (use this, not ``dataclasses.asdict``, which would include the packed bytes)."""
        out = {
            "prompt_ids": list(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "output_logprobs": list(self.output_logprobs),
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
        }
        if self.routed_experts is not None:
            out["routed_experts"] = [list(row) for row in self.routed_experts]
        if self.weight_version_spans is not None:
            out["weight_version_spans"] = [list(span) for span in self.weight_version_spans]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TurnRecord:
        return cls(
            prompt_ids=data["prompt_ids"],
            output_ids=data["output_ids"],
            output_logprobs=data.get("output_logprobs", ()),
            finish_reason=data["finish_reason"],
            weight_version=data.get("weight_version"),
            routed_experts=data.get("routed_experts"),
            weight_version_spans=data.get("weight_version_spans"),
        )

    @classmethod
    def from_generate_response(cls, prompt_ids: Iterable[int], response: Any) -> TurnRecord:
        """Build a record from SGLang's ``/generate`` JSON answer to ``return_logprob: true``.

        The one parser of that answer. Raises ``ValueError`` (or ``TypeError``) unless it is one complete
        answer with a log-prob per output token. A missing finish reason is recorded as ``"unknown"``:
        the engine did not say why it stopped.
        """
        if not isinstance(response, Mapping):
            if isinstance(response, list):  # SGLang answers a list when n > 1; a turn is one continuation
                raise ValueError("batched /generate answers (n > 1) are not supported")
            raise TypeError(f"a /generate answer must be a JSON object, got {type(response).__name__}")
        meta = response.get("meta_info")
        if not isinstance(meta, Mapping):
            raise ValueError("the /generate answer has no meta_info object")
        output_ids = response.get("output_ids")
        if output_ids is None:
            raise ValueError("the /generate answer has no output_ids")
        pairs = meta.get("output_token_logprobs") or []
        if len(pairs) != len(output_ids):
            raise ValueError(f"{len(pairs)} log-probs for {len(output_ids)} output tokens")
        try:  # one C-level compare in the common case; the walk below explains any difference
            same = [p[1] for p in pairs] == (output_ids if type(output_ids) is list else list(output_ids))
        except (TypeError, IndexError, KeyError):
            same = False
        if not same:
            for i, ((_, token_id, *_), out_id) in enumerate(zip(pairs, output_ids, strict=True)):
                if token_id is not None and token_id != out_id:
                    raise ValueError(
                        f"meta_info.output_token_logprobs token ids differ from output_ids at {i}: {token_id} != {out_id}"
                    )
        finish = meta.get("finish_reason")
        if isinstance(finish, Mapping):
            finish = finish.get("type")
        weight_version = meta.get("weight_version")
        routed = meta.get("routed_experts")
        spans = meta.get("weight_version_spans")
        if type(spans) is list and len(spans) == 1 and spans[0] == [0, weight_version]:
            spans = None  # the common case, one version: nothing to check
        return cls(
            prompt_ids=tuple(prompt_ids),
            output_ids=tuple(output_ids),
            output_logprobs=tuple([p[0] for p in pairs]),
            finish_reason="unknown" if finish is None else str(finish),
            weight_version=None if weight_version is None else str(weight_version),
            routed_experts=None if routed is None else routed,
            weight_version_spans=spans,
        )
