"""Made-up countries: questions whose names no model can have memorised, with their own small corpus.

The tiny random-init model learns the ~250 real countries by heart faster than it learns to copy a name
from the question into its query and the answer out of the search result, so on held-out questions it
writes a remembered name ("capital of Nepal" -> ``search("capital of Netherland")``). A question about a
made-up country (``Lazasbu``, ``Civo``) can only be answered by copying. Each task carries its documents
(``docs``: the answer country's capital, population and neighbours, and its neighbours' documents, in the
real corpus's sentences), and ``SearchR1Env`` searches them with the same BM25 instead of the real index.
The held-out questions stay real; made-up ones go only to the warm-up and GRPO pools
(``make_questions(synthetic_share=...)``). The names come from a fixed seeded pool (``name_pool()``), so
the example's tokenizer can make each one token; every world assigns them afresh. A world may instead
name real countries and capitals in random relations (``names="real"``): copying learned on made-up names
did not carry over to real ones, whose tokens the held-out questions use.
"""

from __future__ import annotations

import random
from functools import cache, lru_cache
from typing import Any

from examples.search_r1.corpus import Country, Document, documents_of

CONSONANTS = "bcdfghjklmnprstvwz"
VOWELS = "aeiou"
KINDS = ("capital", "country_of_capital", "neighbour_capital", "population_by_capital")


def made_up_name(rng: random.Random) -> str:
    """Two or three consonant-vowel syllables (some closed), capitalised: ``Lazasbu``, ``Civo``."""
    syllables = rng.choice((2, 2, 3))
    return "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) + (rng.choice("nrlst") if rng.random() < 0.3 else "")
                   for _ in range(syllables)).capitalize()


POOL_SIZE = 1000
POOL_SEED = 19


@cache
def name_pool() -> tuple[str, ...]:
    """The made-up names every world draws from: ``POOL_SIZE`` distinct ones (seeded), none a real country
    or capital. A fixed pool, so a tokenizer can make each one token (``examples.search_r1.tokenizer``);
    each world assigns them at random, so no fact about them can be memorised."""
    from examples.search_r1.corpus import countries

    real = {c.name for c in countries()} | {c.capital for c in countries() if c.capital}
    rng = random.Random(POOL_SEED)
    names: dict[str, None] = {}
    while len(names) < POOL_SIZE:
        name = made_up_name(rng)
        if name not in real:
            names[name] = None
    return tuple(names)


NAME_SOURCES = ("made_up", "real", "both")


@cache
def real_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The real country names and the real capitals that are no country's name, sorted."""
    from examples.search_r1.corpus import countries

    names = sorted({c.name for c in countries()})
    return tuple(names), tuple(sorted({c.capital for c in countries() if c.capital} - set(names)))


def _draw_names(rng: random.Random, names: str) -> list[str]:
    """Seven country names and five capitals, all distinct. ``made_up``: from :func:`name_pool`; ``real``:
    real country names as countries and real capitals as capitals, assigned at random (so a world says
    "The capital of Nepal is Lima.": no fact about a real name can be memorised, and copying is learned on
    the very tokens the held-out questions name); ``both``: each world one or the other, at even odds."""
    if names not in NAME_SOURCES:
        raise ValueError(f"unknown name source {names!r}; known: {NAME_SOURCES}")
    if names == "both":
        names = rng.choice(("made_up", "real"))
    if names == "made_up":
        return rng.sample(name_pool(), 12)
    country_names, capitals = real_names()
    return rng.sample(country_names, 7) + rng.sample(capitals, 5)


def _world(rng: random.Random, names: str = "made_up") -> tuple[Country, list[Country]]:
    """The answer country ``z`` and its three neighbours x, y, w (each with one more neighbour of its own,
    so x and y share only z); every name distinct, drawn as ``names`` says (:func:`_draw_names`)."""
    z, x, y, w, x2, y2, w2, *capitals = _draw_names(rng, names)

    def country(name: str, capital: str, borders: list[str]) -> Country:
        return Country(name=name, code="", capital=capital, population=rng.randint(1_000, 99_999_999), area=None,
                       borders=tuple(sorted(borders)), region=None, subregion=None, languages=(), currencies=())

    zc = country(z, capitals[0], [x, y, w])
    return zc, [country(x, capitals[1], [z, x2]), country(y, capitals[2], [z, y2]), country(w, capitals[3], [z, w2])]


def synthetic_question(kind: str, rng: random.Random, key: str, names: str = "made_up") -> dict[str, Any]:
    """One ``kind`` question about a made-up world (names drawn as ``names`` says: :func:`_draw_names`),
    shaped like ``questions.all_questions()``'s, plus ``docs`` (``[country, field, text]`` rows) that
    ``SearchR1Env`` searches for this task."""
    if kind not in KINDS:
        raise ValueError(f"unknown question kind {kind!r}; known: {KINDS}")
    while True:
        z, neighbours = _world(rng, names)
        x, y = neighbours[0], neighbours[1]
        if kind == "capital":
            q = (f"What is the capital of {z.name}?", z.capital, [f"capital of {z.name}"], [(z.name, "capital")])
        elif kind == "country_of_capital":
            q = (f"Which country has the capital {z.capital}?", z.name, [f"capital {z.capital}"], [(z.name, "capital")])
        elif kind == "population_by_capital":
            q = (f"What is the population of the country whose capital is {z.capital}?", str(z.population),
                 [f"capital {z.capital}", f"population of {z.name}"], [(z.name, "capital"), (z.name, "population")])
        else:
            q = (f"What is the capital of the country that borders {x.name} and {y.name}?", z.capital,
                 [f"borders {x.name} and {y.name}", f"capital of {z.name}"], [(z.name, "borders"), (z.name, "capital")])
        question, answer, queries, evidence = q
        docs = tuple((c.name, f, text) for c in (z, *neighbours) for f, text in documents_of(c))
        index = task_index(docs)
        firsts = [index.search(query, k=1) for query in queries]
        if all(hits and (hits[0].country, hits[0].field) == need for hits, need in zip(firsts, evidence, strict=True)):
            return {"id": f"synthetic-{kind}:{key}", "kind": kind, "question": question, "answers": [answer],
                    "country": z.name, "queries": queries, "evidence": [list(e) for e in evidence],
                    "docs": [list(d) for d in docs], "synthetic": True}


@lru_cache(maxsize=4096)
def task_index(docs: tuple[tuple[str, str, str], ...]):
    """The BM25 index (same settings as the real one) over one made-up task's ``(country, field, text)``."""
    from examples.search_r1.search import SearchIndex

    return SearchIndex([Document(id=i, country=c, field=f, text=t) for i, (c, f, t) in enumerate(docs)])
