"""One sample as HTML: its turns, each token a ``<span data-provenance=...>`` with its facts on hover.

The alignment is the one ``agentrl dump`` prints (token ``i`` has ``provenance[i]``; loss mask and
rollout log-prob exist from ``response_start`` on). Every string that comes from the sample — token
text, chat, ids — is policy output, so it is escaped here, the only place that writes sample markup.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from agentrl.trajectory.policies import DRIFT_CUT, FORKED
from agentrl.trajectory.provenance import CONTEXT, MODEL, PROMPT, REALIGNED_PROMPT
from agentrl.trajectory.sample import Sample

Decoder = Callable[[int], str]

# data-provenance values: a model token is "trained" or "untrained" (a later drift cut inside its
# output); every other token is named by its provenance source.
TRAINED = "trained"
UNTRAINED = "untrained"
# class -> (legend label, token CSS); keyed by the trajectory's own names, so a renamed source keeps its colour.
PROVENANCE_STYLES: dict[str, tuple[str, str]] = {
    TRAINED: ("model output, trained", "background: #b8f0b8"),
    UNTRAINED: ("model output, not trained (a later drift re-rendered it)",
                "background: #ffd8a8; text-decoration: line-through"),
    PROMPT: ("the first prompt", "background: #e6e6e6; color: #555"),
    CONTEXT: ("tool results, user turns, template tokens", "background: #cfe3ff"),
    REALIGNED_PROMPT: ("a later prompt placed where held tokens drifted", "background: #e8d0ff"),
}
PROVENANCE_CLASSES: dict[str, str] = {name: label for name, (label, _) in PROVENANCE_STYLES.items()}
DRIFT_STYLES: dict[str, str] = {DRIFT_CUT: "border-left-style: dashed", FORKED: "border-left-style: dotted"}


def provenance_css() -> str:
    """The colour of each provenance class and the mark of each drift outcome, as CSS rules."""
    rules = [f'.tok[data-provenance="{name}"] {{ {css}; }}' for name, (_, css) in PROVENANCE_STYLES.items()]
    rules += [f'.drift[data-drift="{name}"] {{ {css}; }}' for name, css in DRIFT_STYLES.items()]
    return "\n".join(rules)


TRAINER_LOGPROBS = "trainer_logprobs"  # optional metadata: the trainer's log-prob per response token


def provenance_class(source: str, trained: bool) -> str:
    if source == MODEL:
        return TRAINED if trained else UNTRAINED
    return source


def cached_decoder(decode: Decoder | None) -> Decoder:
    """``decode`` memoised per token id (a vocabulary repeats); ``#id`` without a tokenizer."""
    if decode is None:
        return lambda token: f"#{token}"
    return lru_cache(maxsize=1 << 16)(decode)


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _visible(text: str) -> str:
    """Token text as shown: escaped, newlines marked, an empty piece kept visible."""
    if not text:
        return "\u2205"
    return _esc(text).replace("\n", "\u21b5\n")


def _token_span(s: Sample, i: int, text: str, trainer_lps: list[float] | None) -> str:
    prov = s.provenance[i]
    rs = s.response_start
    trained = i >= rs and bool(s.loss_mask[i - rs])
    cls = provenance_class(prov.source, trained)
    facts = [f"#{i} id {s.tokens[i]} {text!r}", f"{cls} (turn {prov.turn})"]
    attrs = [f'data-provenance="{_esc(cls)}"', f'data-i="{i}"', f'data-id="{s.tokens[i]}"']
    if i >= rs and prov.source == MODEL:
        lp = s.rollout_logprobs[i - rs]
        facts.append(f"rollout log-prob {lp:.4f}")
        attrs.append(f'data-lp="{lp:.6g}"')
        if trainer_lps is not None:
            facts.append(f"trainer log-prob {trainer_lps[i - rs]:.4f}")
            attrs.append(f'data-tlp="{trainer_lps[i - rs]:.6g}"')
    if prov.weight_version is not None:
        facts.append(f"weights {prov.weight_version}")
        attrs.append(f'data-wv="{_esc(prov.weight_version)}"')
    return f'<span class="tok" {" ".join(attrs)} title="{_esc(" | ".join(facts))}">{_visible(text)}</span>'


def _trainer_logprobs(s: Sample) -> list[float] | None:
    values = s.metadata.get(TRAINER_LOGPROBS)
    if isinstance(values, list) and len(values) == len(s.tokens) - s.response_start:
        return [float(v) for v in values]
    return None


def _header(s: Sample) -> str:
    meta = s.metadata
    facts = [("reward", s.reward), ("status", s.status), ("stop", meta.get("stop_reason")),
             ("tokens", len(s.tokens)), ("trained", s.trained_tokens), ("session", s.session_id),
             ("outcomes", ", ".join(map(str, meta.get("outcomes") or []))),
             ("advantage", meta.get("advantage"))]
    cells = "".join(f"<span><b>{_esc(k)}</b> {_esc(v)}</span>" for k, v in facts if v not in (None, ""))
    points = "".join(f'<li data-drift="{_esc(p.get("outcome"))}">turn {_esc(p.get("turn"))}: held tokens left '
                     f'at {_esc(p.get("position"))} &rarr; {_esc(p.get("outcome"))}</li>'
                     for p in meta.get("drift_points") or [] if isinstance(p, dict))
    return f'<div class="facts">{cells}</div>' + (f'<ul class="drifts">{points}</ul>' if points else "")


def render_sample(s: Sample, decode: Decoder) -> str:
    """The sample's markup: facts, drift points, then one block per turn of coloured tokens."""
    drift_at = {p.get("position"): p.get("outcome") for p in s.metadata.get("drift_points") or []
                if isinstance(p, dict)}
    trainer_lps = _trainer_logprobs(s)
    outcomes = s.metadata.get("outcomes") or []
    turns = s.metadata.get("turns") or []
    blocks: list[str] = []
    for run_turn, spans in _turn_blocks(s, decode, drift_at, trainer_lps):
        outcome = outcomes[turns.index(run_turn)] if run_turn in turns and turns.index(run_turn) < len(outcomes) \
            else None
        label = f"turn {run_turn}" + (f" &middot; {_esc(outcome)}" if outcome else "")
        blocks.append(f'<section class="turn" data-turn="{run_turn}"><h4>{label}</h4>'
                      f'<div class="tokens">{"".join(spans)}</div></section>')
    return _header(s) + "".join(blocks)


def _turn_blocks(s: Sample, decode: Decoder, drift_at: dict, trainer_lps: list[float] | None):
    """(turn, spans) per stretch of consecutive tokens that one turn introduced."""
    current: int | None = None
    spans: list[str] = []
    for run in s.provenance.runs:
        if run.turn != current and spans:
            yield current, spans
            spans = []
        current = run.turn
        for i in range(run.start, run.end):
            if i in drift_at:
                spans.append(f'<span class="drift" data-drift="{_esc(drift_at[i])}" '
                             f'title="drift: {_esc(drift_at[i])} at token {i}"></span>')
            spans.append(_token_span(s, i, decode(s.tokens[i]), trainer_lps))
    if spans:
        yield current, spans
