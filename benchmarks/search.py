"""BM25 search latency on the full search corpus (bm25s), as the ``search`` tool runs it.

    python benchmarks/search.py [--reps 3]

Two query sets: the questions themselves (long, natural language) and short entity queries (the
``chemical element X`` / ``X country capital`` form an agent writes for one hop). Each query is
one ``SearchIndex.search`` call (tokenise, score, top 5, snippets), single-threaded, as the tool
calls it. Baseline in the same run: the same queries in one batched bm25s ``retrieve`` call, per
query (what a batched tool server could reach). Also timed: building the index from scratch and
loading it from the on-disk cache.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from envs.search.corpus import load_corpus
from envs.search.index import _index_folder, build_index, cache_root, load_index
from envs.search.questions import questions


def _percentiles(ms: list[float]) -> str:
    a = np.asarray(ms)
    return f"{np.median(a):.2f} | {np.percentile(a, 90):.2f} | {np.percentile(a, 99):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    t0 = time.perf_counter()
    corpus = load_corpus()
    t_corpus = time.perf_counter() - t0
    builds = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            t0 = time.perf_counter()
            build_index(corpus, Path(tmp) / f"i{rep}")
            builds.append(time.perf_counter() - t0)
    folder = _index_folder(corpus, cache_root())
    if not folder.exists():
        build_index(corpus, folder)
    loads = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        index = load_index(corpus, folder)
        loads.append(time.perf_counter() - t0)
    print(
        f"corpus: {len(corpus.documents):,} documents, read in {t_corpus:.2f} s; index build "
        f"{statistics.median(builds):.2f} s, load from cache {statistics.median(loads):.2f} s "
        f"(medians of {args.reps})\n"
    )
    qs = questions("all")
    long_queries = [q.question for q in qs]
    short_queries = []
    for q in qs:
        for docid in q.evidence:
            doc = corpus.by_id[docid]
            element = docid.startswith("element/")
            short_queries.append(
                f"chemical element {doc.title}" if element else f"{doc.title} country capital"
            )
    print(
        "| queries | n | search ms: median | p90 | p99 | queries/s | batched ms/query "
        "| single / batched |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, queries in (("questions", long_queries), ("entity", short_queries)):
        for q in queries[:20]:  # warm-up
            index.search(q)
        ms = []
        for _ in range(args.reps):
            for q in queries:
                t0 = time.perf_counter()
                index.search(q)
                ms.append((time.perf_counter() - t0) * 1e3)
        batched = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            ids = index.tokenizer.tokenize(
                queries, update_vocab=False, return_as="ids", show_progress=False
            )
            index.retriever.retrieve(ids, k=5, show_progress=False, n_threads=1)
            batched.append((time.perf_counter() - t0) * 1e3 / len(queries))
        single = statistics.median(ms)
        per_batched = statistics.median(batched)
        print(
            f"| {label} | {len(queries)} | {_percentiles(ms)} | {1e3 / single:,.0f} | "
            f"{per_batched:.3f} | {single / per_batched:.1f}x |"
        )


if __name__ == "__main__":
    main()
