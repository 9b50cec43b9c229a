"""Multi-hop questions generated from the corpus's fact documents, with gold answers and evidence.

Each question is a chain of lookups whose every link is one document (the evidence), 2 to 4 hops:

- 2 hops, ``discovery``: element X's document names the country it was discovered in; that
  country's document holds the answer. ``producer``: the same through X's top producer.
- 3 hops, ``next``: X's document gives its atomic number Z; element Z+1's document names its
  country of discovery; that country's document holds the answer.
- 4 hops, ``sum``: the documents of X and Y give Z_X and Z_Y; element Z_X+Z_Y's document names a
  country; that country's document holds the answer.

The answer is a short attribute of the final country, one per chain: its capital, its currency
code, its subregion or its demonym. Questions name only X (and Y), never an intermediate entity,
so each hop must be retrieved. The question set is a pure function of the corpus; it is shuffled
with a fixed seed and split into ``train`` and ``test`` (the held-out fifth), one chain never in
both.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import string
from collections import Counter

from envs.search.corpus import Corpus, Country, Element, load_corpus
from envs.splits import SPLIT_SEED, split_indices

__all__ = ["Question", "make_questions", "questions", "normalize_answer", "exact_match", "f1_score"]


_ATTRIBUTES = {
    "capital": ("What is the capital of {c}?", lambda c: c.capital),
    "currency": (
        "What is the currency code of {c}?",
        lambda c: c.currencies[0] if c.currencies else "",
    ),
    "subregion": ("In which subregion of the world is {c}?", lambda c: c.subregion),
    "demonym": ("What is the demonym of the people of {c}?", lambda c: c.demonym),
}


@dataclasses.dataclass(frozen=True)
class Question:
    qid: str
    question: str
    answer: str
    evidence: tuple[str, ...]  # docids, in hop order
    hops: int
    kind: str


def _ask(attribute: str, country_phrase: str) -> str:
    template = _ATTRIBUTES[attribute][0]
    return template.format(c=country_phrase)


def _country_questions(kind, chain_docs, country: Country, phrase: str, key: str) -> list[Question]:
    out = []
    for attribute, (_, get) in _ATTRIBUTES.items():
        answer = get(country)
        if not answer:
            continue
        out.append(
            Question(
                qid=f"{kind}:{key}:{attribute}",
                question=_ask(attribute, phrase),
                answer=answer,
                evidence=tuple(chain_docs) + (country.docid,),
                hops=len(chain_docs) + 1,
                kind=kind,
            )
        )
    return out


def make_questions(corpus: Corpus) -> list[Question]:
    """Every question the corpus supports, in a fixed order."""
    out: list[Question] = []
    elements: dict[int, Element] = corpus.elements
    rng = random.Random(SPLIT_SEED)

    def pick(qs: list[Question]) -> list[Question]:
        # one attribute per chain (chosen by the seed), so that no chain is in both splits
        return [qs[rng.randrange(len(qs))]] if qs else []

    for z, e in sorted(elements.items()):
        if e.discovered_in:
            c = corpus.countries[e.discovered_in]
            phrase = f"the country where the chemical element {e.name.lower()} was discovered"
            out += pick(_country_questions("discovery", [e.docid], c, phrase, e.name))
        if e.top_producer:
            c = corpus.countries[e.top_producer]
            phrase = f"the country that is the top producer of {e.name.lower()}"
            out += pick(_country_questions("producer", [e.docid], c, phrase, e.name))
        nxt = elements.get(z + 1)
        if nxt is not None and nxt.discovered_in:
            c = corpus.countries[nxt.discovered_in]
            phrase = (
                "the country where the chemical element whose atomic number is one more than "
                f"that of {e.name.lower()} was discovered"
            )
            out += pick(_country_questions("next", [e.docid, nxt.docid], c, phrase, e.name))
    # 4 hops: pairs (X, Y) with Z_X < Z_Y whose sum is an element with a country of discovery;
    # a fixed sample keeps them from dominating the set.
    pairs = [
        (x, y)
        for x in sorted(elements)
        for y in sorted(elements)
        if x < y and x + y in elements and elements[x + y].discovered_in
    ]
    for x, y in sorted(rng.sample(pairs, min(len(pairs), 150))):
        ex, ey, target = elements[x], elements[y], elements[x + y]
        c = corpus.countries[target.discovered_in]
        phrase = (
            "the country where the chemical element whose atomic number is the sum of the atomic "
            f"numbers of {ex.name.lower()} and {ey.name.lower()} was discovered"
        )
        key = f"{ex.name}+{ey.name}"
        out += pick(_country_questions("sum", [ex.docid, ey.docid, target.docid], c, phrase, key))
    return out


@functools.lru_cache(maxsize=4)
def questions(split: str = "train") -> tuple[Question, ...]:
    """The ``train`` or ``test`` questions (``envs.splits``: a fixed-seed shuffle, 80/20)."""
    qs = make_questions(load_corpus())
    return tuple(qs[i] for i in split_indices(len(qs), split))


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


def f1_score(prediction: str, gold: str) -> float:
    """Token-level F1 between the normalised prediction and gold answer."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = Counter(p) & Counter(g)
    overlap = sum(common.values())
    if not p or not g:
        return float(p == g)
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(p), overlap / len(g)
    return 2 * precision * recall / (precision + recall)
