"""Search-R1 reward: exact match (or token F1) of the ``<answer>`` against the gold answers, plus a
format component for a well-formed final reply."""

from __future__ import annotations

import re
import string
from collections import Counter

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def extract_answer(reply: str) -> str | None:
    """The text of the reply's single ``<answer>...</answer>``; None if there is none or several."""
    found = ANSWER.findall(reply)
    return found[0].strip() if len(found) == 1 else None


def exact_match(prediction: str, golds: list[str]) -> float:
    return float(any(normalize_answer(prediction) == normalize_answer(g) for g in golds))


def f1(prediction: str, golds: list[str]) -> float:
    best = 0.0
    pred = normalize_answer(prediction).split()
    for gold in golds:
        ref = normalize_answer(gold).split()
        common = sum((Counter(pred) & Counter(ref)).values())
        if common:
            p, r = common / len(pred), common / len(ref)
            best = max(best, 2 * p * r / (p + r))
    return best


def score(final_reply: str, golds: list[str], *, metric: str = "em", format_weight: float = 0.2) -> float:
    """``format_weight`` for exactly one ``<answer>`` tag, plus ``1 - format_weight`` times EM or F1."""
    if metric not in ("em", "f1"):
        raise ValueError(f"metric must be 'em' or 'f1', got {metric!r}")
    if not 0 <= format_weight <= 1:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
    answer = extract_answer(final_reply)
    if answer is None:
        return 0.0
    correct = exact_match(answer, golds) if metric == "em" else f1(answer, golds)
    return format_weight + (1 - format_weight) * correct
