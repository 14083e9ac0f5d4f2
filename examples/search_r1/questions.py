"""Single- and multi-hop questions generated from the corpus data, with a held-out split by country.

Kinds: ``capital`` ("What is the capital of X?", 1 hop); ``population_by_capital`` ("What is the
population of the country whose capital is Y?", 2 hops); ``largest_neighbour`` ("Which neighbour of X
has the largest area?", 1 + one search per neighbour). Every question carries the expert's search
queries, so a scripted policy can solve it through the real search tool.
"""

from __future__ import annotations

import random
from collections import Counter
from functools import cache
from typing import Any

from examples.search_r1.corpus import countries

SPLIT_SEED = 7
HELD_OUT_FRACTION = 0.2
KINDS = ("capital", "population_by_capital", "largest_neighbour")


@cache
def held_out_countries() -> frozenset[str]:
    names = sorted(c.name for c in countries())
    random.Random(SPLIT_SEED).shuffle(names)
    return frozenset(names[: int(len(names) * HELD_OUT_FRACTION)])


@cache
def all_questions() -> tuple[dict[str, Any], ...]:
    """Every question the data supports, each ``{"id", "kind", "question", "answers", "country",
    "queries", "split"}``; ambiguous ones (a capital shared by two countries, a tie in area) are left out."""
    data = countries()
    by_name = {c.name: c for c in data}
    capital_count = Counter(c.capital for c in data if c.capital)
    held = held_out_countries()
    out: list[dict[str, Any]] = []

    def add(kind: str, country: str, question: str, answer: str, queries: list[str]) -> None:
        out.append({"id": f"{kind}:{country}", "kind": kind, "question": question, "answers": [answer],
                    "country": country, "queries": queries, "split": "heldout" if country in held else "train"})

    for c in data:
        if c.capital:
            add("capital", c.name, f"What is the capital of {c.name}?", c.capital, [f"capital of {c.name}"])
        if c.capital and c.population and capital_count[c.capital] == 1:
            add("population_by_capital", c.name,
                f"What is the population of the country whose capital is {c.capital}?", str(c.population),
                [f"capital is {c.capital}", f"population of {c.name}"])
        neighbours = [by_name[n] for n in c.borders if by_name[n].area]
        if len(neighbours) >= 2:
            areas = sorted((n.area for n in neighbours), reverse=True)
            if areas[0] != areas[1]:
                largest = max(neighbours, key=lambda n: n.area)
                add("largest_neighbour", c.name, f"Which neighbour of {c.name} has the largest area?",
                    largest.name, [f"neighbours of {c.name}"] + [f"area of {n.name}" for n in neighbours])
    return tuple(out)


def make_questions(n: int | None = None, *, split: str = "train", kinds: tuple[str, ...] = KINDS,
                   seed: int = 0) -> list[dict[str, Any]]:
    """``n`` questions of ``kinds`` from ``split`` (``"train"`` or ``"heldout"``; disjoint by country),
    shuffled by ``seed``; all of them when ``n`` is None."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown question kinds {sorted(unknown)}; known: {KINDS}")
    pool = [q for q in all_questions() if q["split"] == split and q["kind"] in kinds]
    random.Random(seed).shuffle(pool)
    return pool if n is None else pool[:n]
