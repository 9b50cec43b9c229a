"""The BM25 index of the search corpus (``bm25s``), built once and cached on disk.

The cache lives in ``$MPO_JAX_CACHE`` (default ``~/.cache/mpo-jax``), in a folder named by the
corpus fingerprint and the bm25s version, so a changed corpus or library builds a new index
instead of reading a stale one. A build writes into a temporary folder and renames it into place,
so a killed build never leaves a half-written index behind.

Tokenisation: lower case, bm25s's English stop words, no stemming. Scoring: bm25s's defaults
(Lucene's BM25, k1 = 1.5, b = 0.75).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
from pathlib import Path

import bm25s

from envs.search.corpus import Corpus, load_corpus

__all__ = [
    "SearchHit",
    "SearchIndex",
    "cache_root",
    "build_index",
    "load_index",
    "default_index",
    "index_files",
]


def cache_root() -> Path:
    return Path(os.environ.get("MPO_JAX_CACHE", Path.home() / ".cache" / "mpo-jax"))


@dataclasses.dataclass(frozen=True)
class SearchHit:
    docid: str
    score: float
    snippet: str


def _tokenizer() -> bm25s.tokenization.Tokenizer:
    return bm25s.tokenization.Tokenizer(lower=True, stopwords="en", stemmer=None)


class SearchIndex:
    """BM25 over ``corpus``: `search` (top k hits with snippets) and `document`."""

    def __init__(self, corpus: Corpus, retriever: bm25s.BM25, tokenizer, folder: Path | None):
        self.corpus = corpus
        self.retriever = retriever
        self.tokenizer = tokenizer
        self.folder = folder
        self.docids = [d.docid for d in corpus.documents]

    def search(self, query: str, k: int = 5, snippet_chars: int = 240) -> list[SearchHit]:
        """The ``k`` best documents for ``query`` (none when no query word is in the corpus)."""
        ids = self.tokenizer.tokenize(
            [query], update_vocab=False, return_as="ids", show_progress=False
        )
        if not ids[0] or all(i == self.tokenizer.word_to_id.get("") for i in ids[0]):
            return []
        k = min(k, len(self.docids))
        docs, scores = self.retriever.retrieve(ids, k=k, show_progress=False, n_threads=1)
        hits = []
        for i, s in zip(docs[0], scores[0], strict=True):
            if s <= 0:
                continue
            doc = self.corpus.documents[int(i)]
            text = doc.text if len(doc.text) <= snippet_chars else doc.text[:snippet_chars] + "..."
            hits.append(SearchHit(doc.docid, round(float(s), 3), text))
        return hits

    def document(self, docid: str) -> str | None:
        doc = self.corpus.by_id.get(docid)
        return None if doc is None else f"{doc.title}\n\n{doc.text}"


def _index_folder(corpus: Corpus, root: Path) -> Path:
    """Keyed by the corpus, bm25s's version and its JSON writer (orjson when installed: the same
    index in other bytes), so that a folder is always what a rebuild here would write."""
    from bm25s.utils import json_functions

    writer = "orjson" if json_functions.ORJSON_AVAILABLE else "json"
    return root / f"search-bm25-{corpus.fingerprint()[:16]}-bm25s-{bm25s.__version__}-{writer}"


def build_index(corpus: Corpus, folder: Path) -> SearchIndex:
    """Builds the index of ``corpus`` and writes it to ``folder`` (replacing what is there)."""
    tokenizer = _tokenizer()
    ids = tokenizer.tokenize(
        [f"{d.title}\n{d.text}" for d in corpus.documents],
        update_vocab=True,
        return_as="ids",
        show_progress=False,
    )
    retriever = bm25s.BM25()
    retriever.index(ids, show_progress=False)
    # Indexed by token ids, its vocabulary maps int -> int. bm25s writes it with orjson when that is
    # installed (trackio, tensordict bring it), which refuses int keys; the json module writes them
    # as strings, which is what bm25s reads back either way.
    retriever.vocab_dict = {str(k): v for k, v in retriever.vocab_dict.items()}
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        retriever.save(str(tmp), show_progress=False)
        tokenizer.save_vocab(str(tmp))
        tokenizer.save_stopwords(str(tmp))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return SearchIndex(corpus, retriever, tokenizer, folder)


def load_index(corpus: Corpus, folder: Path) -> SearchIndex:
    retriever = bm25s.BM25.load(str(folder), load_corpus=False)
    tokenizer = _tokenizer()
    tokenizer.load_vocab(str(folder))
    tokenizer.load_stopwords(str(folder))
    n = retriever.scores["num_docs"] if isinstance(retriever.scores, dict) else None
    if n is not None and int(n) != len(corpus.documents):
        raise ValueError(
            f"{folder}: the index has {n} documents, the corpus {len(corpus.documents)}"
        )
    return SearchIndex(corpus, retriever, tokenizer, Path(folder))


@functools.lru_cache(maxsize=1)
def default_index() -> SearchIndex:
    """The corpus's index, loaded from the cache or built into it (once per process)."""
    corpus = load_corpus()
    folder = _index_folder(corpus, cache_root())
    if folder.exists():
        try:
            return load_index(corpus, folder)
        except (OSError, ValueError, KeyError):
            pass  # unreadable cache: rebuild it
    try:
        return build_index(corpus, folder)
    except OSError:  # a read-only home: cache in the temporary directory instead
        return build_index(corpus, _index_folder(corpus, Path(tempfile.gettempdir()) / "mpo-jax"))


def index_files(folder: Path) -> dict[str, bytes]:
    """Every file of a saved index, by name (for comparing two builds)."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
