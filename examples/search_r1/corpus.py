"""The offline corpus: one short document per (country, field), built from the ``countryinfo`` package."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Country:
    name: str
    code: str  # ISO alpha-3
    capital: str | None
    population: int | None
    area: int | None  # square kilometres
    borders: tuple[str, ...]  # neighbour names
    region: str | None
    subregion: str | None
    languages: tuple[str, ...]  # ISO 639-1 codes as countryinfo ships them
    currencies: tuple[str, ...]


@dataclass(frozen=True)
class Document:
    id: int
    country: str
    field: str
    text: str


@cache
def countries() -> tuple[Country, ...]:
    """Every country countryinfo knows, sorted by name, neighbours resolved from codes to names."""
    import countryinfo

    infos = [c.info() for c in countryinfo.all_countries()]
    by_code = {i["ISO"]["alpha3"]: i["name"] for i in infos if i.get("ISO", {}).get("alpha3")}
    out = []
    for i in infos:
        capital = i.get("capital") or None
        if isinstance(capital, list):  # the data has one capital as a one-element list
            capital = capital[0] if capital else None
        out.append(Country(
            name=i["name"],
            code=i.get("ISO", {}).get("alpha3", ""),
            capital=capital,
            population=i.get("population") or None,
            area=int(i["area"]) if i.get("area") else None,
            borders=tuple(sorted(by_code[c] for c in i.get("borders") or [] if c in by_code)),
            region=i.get("region") or None,
            subregion=i.get("subregion") or None,
            languages=tuple(i.get("languages") or []),
            currencies=tuple(i.get("currencies") or []),
        ))
    return tuple(sorted(out, key=lambda c: c.name))


def documents_of(country: Country) -> list[tuple[str, str]]:
    """(field, text) documents of one country; fields countryinfo lacks are skipped."""
    c = country
    docs = []
    if c.capital:
        docs.append(("capital", f"The capital of {c.name} is {c.capital}."))
    if c.population:
        docs.append(("population", f"The population of {c.name} is {c.population}."))
    if c.area:
        docs.append(("area", f"The area of {c.name} is {c.area} square kilometres."))
    if c.borders:
        # The country first, so a reader of a clipped snippet still sees whose neighbours these are.
        docs.append(("borders", f"{c.name} borders {', '.join(c.borders)}."))
    if c.region:
        where = f"{c.subregion}, {c.region}" if c.subregion and c.subregion != c.region else c.region
        docs.append(("region", f"{c.name} is in {where}."))
    if c.languages:
        docs.append(("languages", f"Languages of {c.name} (ISO codes): {', '.join(c.languages)}."))
    if c.currencies:
        docs.append(("currencies", f"Currencies of {c.name}: {', '.join(c.currencies)}."))
    return docs


@cache
def build_corpus() -> tuple[Document, ...]:
    """All documents, ids in a fixed order (country name, then field)."""
    docs = []
    for country in countries():
        for field_name, text in documents_of(country):
            docs.append(Document(id=len(docs), country=country.name, field=field_name, text=text))
    return tuple(docs)
