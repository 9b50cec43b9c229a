"""``search``: answer a multi-hop question by searching a closed corpus (a small BrowseComp-Plus).

Each episode is one question of `envs.search.questions` (drawn by the env's seed from the
``train`` or ``test`` split). Tools: ``search(query)`` returns the top 5 ``{docid, score,
snippet}`` by BM25; ``get_document(docid)`` returns a document's text. The agent ends the
episode by writing its answer inside ``<answer>...</answer>``; the reward is exact match after
SQuAD normalisation. ``info`` also logs token F1 and evidence recall (the fraction of the
question's evidence documents that appeared in the agent's search results or that it opened).
"""

from __future__ import annotations

import re

import numpy as np

from envs.base import Observation
from envs.chat import format_tool_call
from envs.search.index import SearchIndex, default_index
from envs.search.questions import Question, exact_match, f1_score, questions
from envs.tool_env import Response, ToolEnv
from envs.tool_env import exclude_tasks as exclude_tasks_
from envs.tools import Tool, ToolBox, ToolResult

__all__ = ["SearchEnv", "SYSTEM_PROMPT"]

SYSTEM_PROMPT = (
    "You answer questions by searching a closed collection of encyclopedia articles and fact "
    "sheets about countries and chemical elements. Each question needs several lookups: find "
    "one fact, then use it to find the next. Use the search tool to find documents and "
    "get_document to read one in full. When you know the answer, reply with it alone inside "
    "<answer></answer>, as short as possible (for example <answer>Paris</answer>)."
)

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class SearchEnv(ToolEnv):
    """Args: seed (which question), split ('train' | 'test'), max_turns, question (a fixed
    `Question`, overriding the draw), index (defaults to the cached corpus index),
    exclude_tasks (question ids never drawn)."""

    def __init__(
        self,
        *,
        seed: int = 0,
        split: str = "train",
        max_turns: int = 8,
        top_k: int = 5,
        question: Question | None = None,
        index: SearchIndex | None = None,
        exclude_tasks: list[str] | None = None,
    ):
        self.index = index or default_index()
        self.split = split
        self.pool = exclude_tasks_(questions(split), exclude_tasks, lambda q: q.qid)
        self.rng = np.random.default_rng(seed)
        self.fixed_question = question
        self.top_k = top_k
        toolbox = ToolBox(
            [
                Tool(
                    "search",
                    f"Search the collection; returns the top {top_k} documents as "
                    "{docid, score, snippet}.",
                    {
                        "type": "object",
                        "properties": {
                            "query": {"type": "string", "description": "the search query"}
                        },
                        "required": ["query"],
                    },
                    self._search,
                ),
                Tool(
                    "get_document",
                    "Return the full text of a document by its docid.",
                    {
                        "type": "object",
                        "properties": {
                            "docid": {"type": "string", "description": "a docid from search"}
                        },
                        "required": ["docid"],
                    },
                    self._get_document,
                ),
            ],
            max_arg_chars=500,
        )
        super().__init__(toolbox, max_turns=max_turns)
        self.question: Question | None = None
        self.retrieved: set[str] = set()

    # -- tools ------------------------------------------------------------------------------
    def _search(self, query: str) -> list[dict]:
        hits = self.index.search(query, k=self.top_k)
        self.retrieved.update(h.docid for h in hits)
        return [{"docid": h.docid, "score": h.score, "snippet": h.snippet} for h in hits]

    def _get_document(self, docid: str) -> str:
        text = self.index.document(docid)
        if text is None:
            raise KeyError(f"no document with docid {docid!r}")
        self.retrieved.add(docid)
        return text

    # -- the episode ------------------------------------------------------------------------
    def _task_id(self) -> str:
        return self.question.qid if self.question else "search"

    @property
    def gold_answer(self) -> str | None:
        return self.question.answer if self.question else None

    gold_answers = True

    def _task_key(self, task: Question) -> str:
        return task.qid

    def _first_messages(self, task: Question) -> list[dict]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task.question},
        ]

    def _start(self) -> list[dict]:
        self.question = self.fixed_question or self.pool[int(self.rng.integers(len(self.pool)))]
        self.retrieved = set()
        return self._first_messages(self.question)

    def evidence_recall(self) -> float:
        evidence = set(self.question.evidence)
        return len(evidence & self.retrieved) / len(evidence)

    def _respond(self, text: str, results: list[ToolResult]) -> Response:
        match = _ANSWER.search(text)
        info = {"evidence_recall": self.evidence_recall(), "hops": self.question.hops}
        if match is not None:
            prediction = match.group(1).strip()
            em = exact_match(prediction, self.question.answer)
            info.update(
                em=float(em), f1=f1_score(prediction, self.question.answer), prediction=prediction
            )
            return Response(Observation(), reward=float(em), terminated=True, success=em, info=info)
        if not results:
            hint = (
                "Error: no tool call and no <answer>; call a tool or give your final answer "
                "inside <answer></answer>."
            )
            return Response(Observation(user=hint), info={**info, "error": True})
        return Response(self.tool_observation(results), info=info)

    # -- a scripted agent, for tests and benchmarks -----------------------------------------
    def oracle_turns(self) -> list[str]:
        """The turns of an agent that knows the chain: open each evidence document, then answer."""
        turns = [format_tool_call("get_document", {"docid": d}) for d in self.question.evidence]
        return turns + [f"<answer>{self.question.answer}</answer>"]
