"""One- and two-hop questions generated from the corpus data, with a held-out split by answer country.

Kinds (each question carries the expert's search queries, so a scripted policy solves it through the
real search tool):

- ``capital`` (1 hop): "What is the capital of X?" — search ``capital of X``.
- ``country_of_capital`` (1 hop): "Which country has the capital C?" — search ``capital C``.
- ``neighbour_capital`` (2 hops): "What is the capital of the country that borders X and Y?" — search
  ``borders X and Y`` (the one country bordering both comes first), then ``capital of Z``.
- ``population_by_capital`` (2 hops): "What is the population of the country whose capital is C?" —
  search ``capital C``, then ``population of Z``.

A question is kept only when it has one answer (no shared capital, exactly one common neighbour) and every
expert query ranks the document it needs first under BM25: the questions are the ones the search tool
can answer. The split is by the country the answer is about (``country``), so a held-out answer is never
a training answer.
"""

from __future__ import annotations

import random
from collections import Counter
from functools import cache
from typing import Any

from examples.search_r1.corpus import countries

SPLIT_SEED = 7
HELD_OUT_FRACTION = 0.2
KINDS = ("capital", "country_of_capital", "neighbour_capital", "population_by_capital")
HOPS = {"capital": 1, "country_of_capital": 1, "neighbour_capital": 2, "population_by_capital": 2}


@cache
def held_out_countries() -> frozenset[str]:
    names = sorted(c.name for c in countries())
    random.Random(SPLIT_SEED).shuffle(names)
    return frozenset(names[: int(len(names) * HELD_OUT_FRACTION)])


def _candidates() -> list[dict[str, Any]]:
    """Every unambiguous question; ``evidence`` lists the (country, field) document each query needs."""
    data = countries()
    by_name = {c.name: c for c in data}
    capital_count = Counter(c.capital for c in data if c.capital)
    out: list[dict[str, Any]] = []

    def add(kind: str, key: str, country: str, question: str, answer: str,
            queries: list[str], evidence: list[tuple[str, str]]) -> None:
        out.append({"id": f"{kind}:{key}", "kind": kind, "question": question, "answers": [answer],
                    "country": country, "queries": queries, "evidence": evidence})

    for c in data:
        if not c.capital:
            continue
        add("capital", c.name, c.name, f"What is the capital of {c.name}?", c.capital,
            [f"capital of {c.name}"], [(c.name, "capital")])
        if capital_count[c.capital] == 1:
            add("country_of_capital", c.name, c.name, f"Which country has the capital {c.capital}?", c.name,
                [f"capital {c.capital}"], [(c.name, "capital")])
            if c.population:
                add("population_by_capital", c.name, c.name,
                    f"What is the population of the country whose capital is {c.capital}?", str(c.population),
                    [f"capital {c.capital}", f"population of {c.name}"], [(c.name, "capital"), (c.name, "population")])
    bordering: dict[str, set[str]] = {c.name: set(c.borders) for c in data}
    names = sorted(bordering)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            common = bordering[x] & bordering[y]
            if len(common) != 1:
                continue
            z = by_name[next(iter(common))]
            if z.capital:
                add("neighbour_capital", f"{x}+{y}", z.name,
                    f"What is the capital of the country that borders {x} and {y}?", z.capital,
                    [f"borders {x} and {y}", f"capital of {z.name}"], [(z.name, "borders"), (z.name, "capital")])
    return out


@cache
def all_questions() -> tuple[dict[str, Any], ...]:
    """Every question the data and the search tool support, each ``{"id", "kind", "question", "answers",
    "country", "queries", "evidence", "split"}``, in a fixed order."""
    from examples.search_r1.env import default_index

    index = default_index()
    held = held_out_countries()
    kept = []
    for q in _candidates():
        firsts = [index.search(query, k=1) for query in q["queries"]]
        if all(hits and (hits[0].country, hits[0].field) == need for hits, need in zip(firsts, q["evidence"], strict=True)):
            kept.append({**q, "split": "heldout" if q["country"] in held else "train"})
    return tuple(kept)


@cache
def held_out_question_ids() -> frozenset[str]:
    """A seeded ``HELD_OUT_FRACTION`` of each kind's questions (the ``holdout="question"`` split)."""
    held = []
    for kind in KINDS:
        ids = sorted(q["id"] for q in all_questions() if q["kind"] == kind)
        random.Random(f"{SPLIT_SEED}-{kind}").shuffle(ids)
        held += ids[: int(len(ids) * HELD_OUT_FRACTION)]
    return frozenset(held)


@cache
def warmup_question_ids(share: float) -> frozenset[str]:
    """A seeded ``share`` of each kind's non-held-out questions (the ``holdout="question"`` warm-up pool)."""
    held = held_out_question_ids()
    out = []
    for kind in KINDS:
        ids = sorted(q["id"] for q in all_questions() if q["kind"] == kind and q["id"] not in held)
        random.Random(f"{SPLIT_SEED}-warmup-{kind}").shuffle(ids)
        out += ids[: round(len(ids) * share)]
    return frozenset(out)


def make_questions(n: int | None = None, *, split: str = "train", kinds: tuple[str, ...] | list[str] = KINDS,
                   seed: int = 0, holdout: str = "country", warmup_share: float | None = None,
                   warmup_kinds: tuple[str, ...] | list[str] | None = None, warmup_synthetic: float = 0.0,
                   train_synthetic: float = 0.0, train_search_credit: float = 0.0,
                   synthetic_names: str = "made_up") -> list[dict[str, Any]]:
    """Questions of ``kinds`` from ``split`` (``"train"``, ``"warmup"`` or ``"heldout"``).

    ``holdout="country"``: the splits are disjoint by answer country (a held-out answer is never a training
    answer). ``holdout="question"``: a seeded fifth of each kind's questions is held out, and the countries
    they name also occur in training questions (a held-out question is a new combination).

    ``warmup_share`` (``holdout="question"`` only): this seeded share of each kind's other questions is the
    ``"warmup"`` split (the supervised warm-up's chats) and the rest is ``"train"`` (GRPO's), so GRPO
    works on questions the warm-up never showed: the model cannot recall their answers, only find them
    with its searches, as on held-out questions. None: ``"warmup"`` is the same pool as ``"train"``.
    ``warmup_kinds`` (with ``warmup_share``): the ``"warmup"`` split's kinds instead of ``kinds``; a kind
    only there gives the warm-up all its non-held-out questions (more names to copy in more places,
    none of them a held-out or GRPO question).

    ``warmup_synthetic`` / ``train_synthetic``: that seeded share of the ``"warmup"`` / ``"train"`` questions
    (with ``n``) is replaced by a question of the same kind about made-up countries
    (``examples.search_r1.synthetic``), new for every seed: names no model can have memorised, so only
    copying answers them. Held-out questions are always real. ``synthetic_names`` (``made_up``, ``real``
    or ``both``): where those worlds' names come from (``synthetic._draw_names``; ``real`` puts real names
    in random relations).

    ``train_search_credit`` w: every ``"train"`` question carries ``search_credit`` w, so ``SearchR1Env``
    rewards GRPO's episodes w times the share of the expert's documents their searches ranked first, on
    top of exact match (held-out and warm-up questions never carry it: ``eval_accuracy`` stays exact match).

    ``n`` None: all of them, shuffled by ``seed``. Otherwise ``n`` questions taking the kinds in turn, each
    kind's questions in a ``seed``-shuffled order that visits the answer countries in turn and starts over
    when used up — so every kind is equally frequent however many questions it has, no country dominates
    (China borders 14 countries: 75 two-hop questions), and ``n`` may exceed the pool."""
    if split not in ("train", "warmup", "heldout"):
        raise ValueError(f"split must be 'train', 'warmup' or 'heldout', got {split!r}")
    kinds = tuple(kinds)
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"unknown question kinds {sorted(unknown)}; known: {KINDS}")
    if holdout not in ("country", "question"):
        raise ValueError(f"holdout must be 'country' or 'question', got {holdout!r}")
    if warmup_share is not None and (holdout != "question" or not 0 < warmup_share < 1):
        raise ValueError(f"warmup_share needs holdout='question' and 0 < share < 1, got {warmup_share!r} "
                         f"with holdout={holdout!r}")
    for name, share in (("warmup_synthetic", warmup_synthetic), ("train_synthetic", train_synthetic)):
        if not 0 <= share <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {share!r}")
    from examples.search_r1.synthetic import NAME_SOURCES

    if synthetic_names not in NAME_SOURCES:
        raise ValueError(f"synthetic_names must be one of {NAME_SOURCES}, got {synthetic_names!r}")
    if train_search_credit < 0:
        raise ValueError(f"train_search_credit must be >= 0, got {train_search_credit!r}")
    if warmup_kinds is not None:
        if warmup_share is None:
            raise ValueError("warmup_kinds needs warmup_share")
        unknown = set(warmup_kinds) - set(KINDS)
        if unknown or not warmup_kinds:
            raise ValueError(f"unknown warm-up question kinds {sorted(unknown)}; known: {KINDS}")
    grpo_kinds = kinds
    if split == "warmup" and warmup_kinds is not None:
        kinds = tuple(warmup_kinds)
    rng = random.Random(seed)
    if warmup_share is None and split == "warmup":
        split = "train"
    if holdout == "country":
        pool = [q for q in all_questions() if q["split"] == split and q["kind"] in kinds]
    else:
        held = held_out_question_ids()
        warm = warmup_question_ids(warmup_share) if warmup_share is not None else frozenset()
        pool = [{**q, "split": "heldout" if q["id"] in held else
                 "warmup" if q["id"] in warm or (warmup_share is not None and q["kind"] not in grpo_kinds) else "train"}
                for q in all_questions() if q["kind"] in kinds]
        pool = [q for q in pool if q["split"] == split]
    if split == "train" and train_search_credit:
        pool = [{**q, "search_credit": train_search_credit} for q in pool]
    if n is None:
        rng.shuffle(pool)
        return pool
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    per_kind = {k: _round_robin([q for q in pool if q["kind"] == k], rng) for k in kinds}
    for k, qs in per_kind.items():
        if not qs:
            raise ValueError(f"no {split} questions of kind {k!r}")
    order = list(kinds)
    rng.shuffle(order)  # which kind comes first varies with the seed
    out = [per_kind[order[i % len(order)]][(i // len(order)) % len(per_kind[order[i % len(order)]])]
           for i in range(n)]
    share = {"warmup": warmup_synthetic, "train": train_synthetic}.get(split, 0.0)
    if share > 0:
        from examples.search_r1.synthetic import synthetic_question

        made_up = random.Random(f"{seed}-synthetic-{split}")
        out = [synthetic_question(q["kind"], made_up, f"{split}-{seed}-{i}", synthetic_names) if made_up.random() < share else q
               for i, q in enumerate(out)]
        if split == "train" and train_search_credit:
            out = [{**q, "search_credit": train_search_credit} for q in out]
    return out


def _round_robin(questions: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """``questions`` shuffled, then reordered so that their answer countries take turns."""
    rng.shuffle(questions)
    seen: Counter[str] = Counter()
    ranked = []
    for q in questions:
        ranked.append((seen[q["country"]], len(ranked), q))
        seen[q["country"]] += 1
    return [q for _, _, q in sorted(ranked, key=lambda r: r[:2])]


# The run's warm-up asks for this split (agentrl.run.data.FunctionTasks.warmup): with ``warmup_share`` set,
# its chats and GRPO's questions are disjoint; without it "warmup" means "train".
make_questions.warmup_split = "warmup"
