"""A model runner that answers at once with scripted tokens: the real server and scheduler, no model math.

``python -m agentrl.engine --model DIR --null-model SCRIPT.json`` serves DIR's tokenizer and config through the
real HTTP server, scheduler and sampler plumbing, but every forward pass is replaced by a lookup, so a benchmark
measures the host cost of the rollout path alone (``benchmarks/rollout_host_bench.py``). ``SCRIPT.json``::

    {"replies": [[id, ...], ...], "marker": id, "first": n, "per_turn": k, "logprob": -0.25}

A prompt holding ``c`` copies of token ``marker`` gets reply ``(c - first) // per_turn`` (clamped to the list),
token by token, then the tokenizer's end-of-sequence token for as long as generation goes on; every token's
log-prob is ``logprob``. Weight routes see no parameters: the null model has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class NullScript:
    """What the null model says (see the module docstring)."""

    replies: list[list[int]]
    marker: int
    first: int = 0
    per_turn: int = 1
    logprob: float = -0.25

    @classmethod
    def load(cls, path: str | Path) -> NullScript:
        try:
            raw = json.loads(Path(path).read_text())
            script = cls(replies=[[int(t) for t in r] for r in raw["replies"]], marker=int(raw["marker"]),
                         first=int(raw.get("first", 0)), per_turn=int(raw.get("per_turn", 1)),
                         logprob=float(raw.get("logprob", -0.25)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--null-model {str(path)!r} is not a null-model script: {exc}") from None
        if not script.replies or not all(script.replies) or script.per_turn < 1:
            raise ValueError(f"--null-model {str(path)!r}: give non-empty replies and per_turn >= 1")
        return script

    def reply_for(self, prompt: list[int]) -> int:
        index = (prompt.count(self.marker) - self.first) // self.per_turn
        return min(max(index, 0), len(self.replies) - 1)


@dataclass
class NullBatch:
    """The running rows' place in their replies (reply index, tokens drawn); holds no KV, so nothing is cached."""

    rows: list[list[int]] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return [0] * len(self.rows)

    def extend(self, kvs: list[list[int]]) -> NullBatch:
        return NullBatch(self.rows + kvs)

    def select(self, order: list[int]) -> NullBatch:
        return NullBatch([self.rows[i] for i in order])

    def row(self, i: int) -> None:
        return None


class NullRunner:
    """The :class:`~agentrl.engine.model_runner.ModelRunner` surface the scheduler and server use, answering from
    a :class:`NullScript`; ``prefill`` and ``decode`` return the drawn ``(tokens, logprobs)`` in place of logits."""

    static_kv = False
    static_rows = 0

    def __init__(self, model_path: str, script: NullScript) -> None:
        import torch
        from transformers import AutoConfig, AutoTokenizer

        self.script = script
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path)
        self.model = _NoWeights(config)
        self.context_length = int(getattr(config, "max_position_embeddings", 2048))
        self.vocab_size = max(int(getattr(config, "vocab_size", 0)), len(self.tokenizer))
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = {eos} if eos is not None else set()
        self.end = eos if eos is not None else 0
        bad = [t for r in script.replies for t in r if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"null-model replies hold token ids outside the vocabulary: {bad[:8]}")

    def empty_batch(self, rows: int | None = None) -> NullBatch:
        return NullBatch()

    def prefill(self, items: list[tuple[list[int], Any]]) -> tuple[tuple[list[int], list[float]], list[list[int]]]:
        rows = [[self.script.reply_for(tokens), 0] for tokens, _ in items]
        return self._draw(rows), rows

    def decode(self, batch: NullBatch, tokens: list[int]) -> tuple[tuple[list[int], list[float]], NullBatch]:
        return self._draw(batch.rows), batch

    def _draw(self, rows: list[list[int]]) -> tuple[list[int], list[float]]:
        drawn = []
        for row in rows:
            reply = self.script.replies[row[0]]
            drawn.append(reply[row[1]] if row[1] < len(reply) else self.end)
            row[1] += 1
        return drawn, [self.script.logprob] * len(rows)

    def named_parameters(self) -> list[tuple[str, Any]]:
        return []

    def named_tensors(self) -> dict[str, Any]:
        return {}

    def release_static(self) -> None:
        pass


class _NoWeights:
    """Stands where the HF model would: its config, no parameters."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def state_dict(self, keep_vars: bool = False) -> dict[str, Any]:
        return {}

    def parameters(self):
        return iter(())
