"""A scripted policy with the sampler's interface: for tests and rollout-loop benchmarks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

__all__ = ["ScriptedGeneration", "ScriptedPolicy", "oracle_act"]


@dataclasses.dataclass
class ScriptedGeneration:
    tokens: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]


class ScriptedPolicy:
    """Writes ``act(row)`` (a text) for every active row, encoded by the codec.

    The stop token is appended when the codec has one (as a sampled turn would end); every token
    gets log-prob 0. ``start``/``extend`` only record the conversation (``self.history``).
    """

    def __init__(self, codec, act: Callable[[int], str]):
        self.codec = codec
        self.act = act
        self.history: list[list[int]] = []

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.history = [list(p) for p in prompts]

    def extend(self, rows) -> None:
        for i, r in enumerate(rows):
            if r:
                self.history[i] += list(r)

    def generate(self, *, max_new_tokens, active, stop_ids=(), **_) -> ScriptedGeneration:
        tokens = []
        for i, live in enumerate(active):
            ids = []
            if live:
                ids = self.codec.encode(self.act(i))[: max_new_tokens - len(stop_ids[:1])]
                ids += list(stop_ids[:1])
                self.history[i] += ids
            tokens.append(ids)
        return ScriptedGeneration(
            tokens, [[0.0] * len(t) for t in tokens], [bool(stop_ids)] * len(tokens)
        )


def oracle_act(env) -> Callable[[], str]:
    """The environment's scripted optimal next turn, as a function of nothing (call it after
    ``reset``): ``optimal_turn`` (synthetic), ``oracle_turn`` (bfcl), or the list of
    ``oracle_turns`` (search, tau2) played in order, then plain replies."""
    for name in ("optimal_turn", "oracle_turn"):
        if hasattr(env, name):
            return getattr(env, name)
    turns: list[str] | None = None

    def next_turn() -> str:
        nonlocal turns
        if turns is None:
            turns = list(env.oracle_turns())
        return turns.pop(0) if turns else "Done."

    return next_turn
