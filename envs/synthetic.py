"""Synthetic long-horizon tasks with a small word-level vocabulary, for CPU-sized runs.

``synthetic-nav``: goal-conditioned navigation on a fixed hidden graph. The prompt names the room
the agent is in and the goal room; each turn the agent writes ``scratch`` free words and then one
exit word (the turn has a fixed length, so no stop token is needed); the environment moves it
through that exit and answers with the new room (padded with filler words to ``obs_len``). The
reward is 1 when the goal is reached within ``max_turns``, and comes only at the end.

Why it needs multi-turn credit: the reward arrives after up to ``max_turns`` moves, and a move
that leads away from the goal early fails the episode as surely as a late one, so credit must
travel back across turns; inside a turn only the last word acts, so the ``scratch`` words are pure
noise whose advantage should average out (what MAE's mean-centred trace is for). A uniformly
random policy succeeds sometimes (the goal is 1 to ``max_distance`` moves away, with more turns
than that), so a randomly initialised model gets a learning signal; the scripted BFS policy
(:meth:`SyntheticNav.optimal_turn`) always succeeds.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from envs.base import Env, Observation, StepResult
from envs.registry import register

__all__ = ["WordCodec", "SyntheticNav", "make_vocabulary"]

SPECIALS = ["<pad>", "<bos>", "<eot>", "<at>", "<goal>", "<invalid>"]


def make_vocabulary(rooms: int, exits: int, scratch: int, fillers: int = 4) -> list[str]:
    return (
        SPECIALS
        + [f"r{i}" for i in range(rooms)]
        + [f"e{i}" for i in range(exits)]
        + [f"s{i}" for i in range(scratch)]
        + [f"o{i}" for i in range(fillers)]
    )


class WordCodec:
    """Token ids <-> space-separated words of a fixed vocabulary (the synthetic tasks' codec)."""

    def __init__(self, vocabulary: list[str]):
        self.vocabulary = list(vocabulary)
        self.index = {w: i for i, w in enumerate(self.vocabulary)}
        self.stop_ids: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.index[w] for w in text.split()]
        except KeyError as e:
            raise ValueError(f"text: word {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids) -> str:
        return " ".join(self.vocabulary[i] if 0 <= i < len(self.vocabulary) else "?" for i in ids)

    def prompt(self, messages: list[dict], tools=None) -> list[int]:
        return self.encode(" ".join(m["content"] for m in messages))

    def observation(self, obs: Observation) -> list[int]:
        parts = list(obs.tool_responses) + ([obs.user] if obs.user else [])
        return self.encode(" ".join(parts))

    def turn_text(self, ids) -> str:
        return self.decode([i for i in ids if i not in self.stop_ids])


class SyntheticNav(Env):
    """Navigate a fixed hidden graph to a goal room (see the module docstring).

    Args:
      seed: the episode stream's seed (start and goal rooms).
      rooms, exits: the graph (fixed by ``graph_seed``; every exit leads to another room).
      max_distance: goals are 1..max_distance moves from the start.
      max_turns: the turn budget.
      scratch: free words per turn before the exit word (turn length = scratch + 1).
      obs_len: observation length in words (the new room plus filler).
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        rooms: int = 12,
        exits: int = 4,
        max_distance: int = 3,
        max_turns: int = 5,
        scratch: int = 1,
        obs_len: int = 2,
        graph_seed: int = 1234,
    ):
        if max_turns < max_distance:
            raise ValueError(f"max_turns={max_turns} < max_distance={max_distance}: unsolvable")
        if obs_len < 2:
            raise ValueError(f"obs_len: must be >= 2 (<at> and the room), got {obs_len}")
        self.rooms, self.exits = rooms, exits
        self.max_distance, self.max_turns = max_distance, max_turns
        self.scratch, self.obs_len = scratch, obs_len
        self.turn_length = scratch + 1
        self.codec = WordCodec(make_vocabulary(rooms, exits, max(scratch, 1)))
        g = np.random.default_rng(graph_seed)
        self.graph = np.array(
            [
                [int(g.choice([r for r in range(rooms) if r != room])) for _ in range(exits)]
                for room in range(rooms)
            ]
        )
        self.distance = np.array([self._bfs(r) for r in range(rooms)])  # [from, to]
        self.rng = np.random.default_rng(seed)
        self.room = self.goal = 0
        self.turns = 0

    def _bfs(self, start: int) -> list[int]:
        dist = [-1] * self.rooms
        dist[start] = 0
        queue = deque([start])
        while queue:
            r = queue.popleft()
            for nxt in self.graph[r]:
                if dist[nxt] < 0:
                    dist[nxt] = dist[r] + 1
                    queue.append(nxt)
        return dist

    def reset(self) -> list[dict]:
        while True:
            start, goal = (int(x) for x in self.rng.integers(0, self.rooms, size=2))
            if 1 <= self.distance[start, goal] <= self.max_distance:
                break
        self.room, self.goal, self.turns = start, goal, 0
        return [{"role": "user", "content": f"<bos> <at> r{start} <goal> r{goal}"}]

    @property
    def state_key(self) -> tuple[int, int]:
        return (self.room, self.goal)

    @property
    def gold_answer(self) -> str:
        return f"r{self.goal}"

    def _observe(self, invalid: bool) -> Observation:
        words = (["<invalid>"] if invalid else []) + ["<at>", f"r{self.room}"]
        fill = max(0, self.obs_len - len(words))
        words += [f"o{i % 4}" for i in range(fill)]
        return Observation(user=" ".join(words))

    def step(self, text: str) -> StepResult:
        key = self.state_key
        words = text.split()
        action = words[-1] if words else ""
        invalid = not (
            action.startswith("e") and action[1:].isdigit() and int(action[1:]) < self.exits
        )
        if not invalid:
            self.room = int(self.graph[self.room, int(action[1:])])
        self.turns += 1
        success = self.room == self.goal
        truncated = not success and self.turns >= self.max_turns
        info = {
            "state_key": key,
            "success": success,
            "invalid_action": invalid,
            "gold_answer": self.gold_answer,
            "tool_calls": self.turns,
        }
        return StepResult(self._observe(invalid), float(success), success, truncated, info)

    def optimal_turn(self) -> str:
        """The scripted optimal policy: scratch words, then an exit on a shortest path."""
        best = min(
            range(self.exits), key=lambda e: self.distance[self.graph[self.room, e], self.goal]
        )
        return " ".join(["s0"] * self.scratch + [f"e{best}"])


register("synthetic-nav", SyntheticNav)
register(
    "synthetic-nav-long",
    lambda seed=0, **kw: SyntheticNav(
        seed=seed,
        **{"rooms": 24, "max_distance": 5, "max_turns": 8, "scratch": 3, "obs_len": 6, **kw},
    ),
)
