"""Synthetic long-horizon tasks with a small word-level vocabulary, for CPU-sized runs.

Every task here has a finite set of instances (a navigation task's (start, goal) pairs, a key-door
task's (door, context) pairs), split by the shared seeded 80/20 split of `envs.splits`:
``split="train"`` draws only training instances, ``split="test"`` only the held-out ones, so the
trainer's held-out evaluation never sees a training instance. The task spaces are small, so a
held-out instance tests generalisation; ``eval_fresh = True`` asks the trainer to also evaluate
fresh episodes of the training split (the distribution it learns), under its own name.

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
(`SyntheticNav.optimal_turn`) always succeeds.

The credit-assignment study's tasks (each registered below):

* ``synthetic-nav-longturns``: long turns. 24 words a turn of which only the last acts, 6 turns.
  Token-level GAE's λ-decay runs over ~150 action tokens (0.95^24 ≈ 0.29 a turn), turn GAE's over
  6 turns. The scratch words come from a small vocabulary (``scratch_words``), so a random turn
  still ends on an exit often enough to give a random model signal.
* ``synthetic-keydoor``: a delayed consequence. The first turn picks a key (the first key word it
  writes; none if it writes none), irreversibly; ``distractors`` turns follow in which nothing the
  agent writes matters and the observations are random room words; after them the door opens iff
  the key is the one the prompt's door needs. Only turn 0 is decisive.
* ``synthetic-nav-noisy``: ``synthetic-nav`` with stochastic transitions: with probability
  ``slip`` a move goes through a random exit instead of the chosen one, so outcomes are noisy given
  the actions and variance reduction matters.

Each step's ``info["action_quality"]`` grades the turn's decision against the task's ground truth
(navigation: how much the chosen exit shortens the shortest path to the goal, -1, 0 or +1; key-door:
+1 for the right key, -1 for a wrong or no key on turn 0, 0 on the distractor turns). The trainer
correlates it with each estimator's advantage on the turn's decisive token (the turn's last token).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from envs.base import Env, Observation, StepResult
from envs.registry import register
from envs.splits import check_split, split_indices

__all__ = ["WordCodec", "SyntheticNav", "KeyDoor", "make_vocabulary"]

SPECIALS = ["<pad>", "<bos>", "<eot>", "<at>", "<goal>", "<invalid>"]
PROMPT_WORDS = 5  # "<bos> <at> rS <goal> rG" / "<bos> <goal> dJ <at> rX"


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
        self.end_of_turn: tuple[int, ...] = ()  # turns have a fixed length: nothing to close

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


class _WordTask(Env):
    """What the synthetic tasks share: a finite instance set split train/test, a seeded episode
    stream over the split's instances, fixed-length turns and observations (so the longest
    episode is known), and a word codec."""

    eval_fresh = True
    gold_answers = True  # the goal room, the door's key

    def __init__(self, *, seed: int, split: str, instances: list, codec: WordCodec):
        check_split(split)
        self.split = split
        self.pool = [instances[i] for i in sorted(split_indices(len(instances), split))]
        if not self.pool:
            raise ValueError(f"split: {split!r} holds no instance of {len(instances)}")
        self.codec = codec
        self.rng = np.random.default_rng(seed)
        self.instance = None

    def _draw(self):
        self.instance = self.pool[int(self.rng.integers(len(self.pool)))]
        return self.instance

    @property
    def task_id(self):
        return self.instance

    def max_episode_tokens(self, codec=None) -> int:
        """The longest episode in tokens: the prompt, every turn, an observation between turns."""
        turns, observations = self.max_turns * self.turn_length, (self.max_turns - 1) * self.obs_len
        return PROMPT_WORDS + turns + observations

    def _words(self, head: list[str], fill) -> str:
        """An observation of exactly ``obs_len`` words: ``head`` then ``fill(i)`` words."""
        words = head[: self.obs_len]
        words += [fill(i) for i in range(self.obs_len - len(words))]
        return " ".join(words)


class SyntheticNav(_WordTask):
    """Navigate a fixed hidden graph to a goal room (see the module docstring).

    Args:
      seed: the episode stream's seed (which instance, which slips).
      split: 'train' | 'test' | 'all': the (start, goal) pairs drawn from.
      rooms, exits: the graph (fixed by ``graph_seed``; every exit leads to another room).
      max_distance: goals are 1..max_distance moves from the start.
      max_turns: the turn budget.
      scratch: free words per turn before the exit word (turn length = scratch + 1).
      scratch_words: how many distinct scratch words the vocabulary has (default: ``scratch``).
      obs_len: observation length in words (the new room plus filler).
      slip: probability that a valid move goes through a random exit instead.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        split: str = "train",
        rooms: int = 12,
        exits: int = 4,
        max_distance: int = 3,
        max_turns: int = 5,
        scratch: int = 1,
        scratch_words: int | None = None,
        obs_len: int = 2,
        slip: float = 0.0,
        graph_seed: int = 1234,
    ):
        if max_turns < max_distance:
            raise ValueError(f"max_turns={max_turns} < max_distance={max_distance}: unsolvable")
        if obs_len < 2:
            raise ValueError(f"obs_len: must be >= 2 (a marker and the room), got {obs_len}")
        if not 0 <= slip < 1:
            raise ValueError(f"slip: must be in [0, 1), got {slip}")
        self.rooms, self.exits = rooms, exits
        self.max_distance, self.max_turns = max_distance, max_turns
        self.scratch, self.obs_len, self.slip = scratch, obs_len, slip
        self.turn_length = scratch + 1
        g = np.random.default_rng(graph_seed)
        self.graph = np.array(
            [
                [int(g.choice([r for r in range(rooms) if r != room])) for _ in range(exits)]
                for room in range(rooms)
            ]
        )
        self.distance = np.array([self._bfs(r) for r in range(rooms)])  # [from, to]
        pairs = [
            (s, t)
            for s in range(rooms)
            for t in range(rooms)
            if 1 <= self.distance[s, t] <= max_distance
        ]
        words = max(scratch_words or scratch, 1)
        super().__init__(
            seed=seed,
            split=split,
            instances=pairs,
            codec=WordCodec(make_vocabulary(rooms, exits, words)),
        )
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
        start, goal = self._draw()
        self.room, self.goal, self.turns = start, goal, 0
        return [{"role": "user", "content": f"<bos> <at> r{start} <goal> r{goal}"}]

    @property
    def state_key(self) -> tuple[int, int]:
        return (self.room, self.goal)

    @property
    def gold_answer(self) -> str:
        return f"r{self.goal}"

    def _parse_exit(self, text: str) -> int | None:
        words = text.split()
        action = words[-1] if words else ""
        if action.startswith("e") and action[1:].isdigit() and int(action[1:]) < self.exits:
            return int(action[1:])
        return None

    def step(self, text: str) -> StepResult:
        key = self.state_key
        exit_ = self._parse_exit(text)
        before = self.distance[self.room, self.goal]
        quality = 0.0
        if exit_ is not None:
            quality = float(before - self.distance[self.graph[self.room, exit_], self.goal])
            if self.slip and self.rng.random() < self.slip:
                exit_ = int(self.rng.integers(self.exits))
            self.room = int(self.graph[self.room, exit_])
        self.turns += 1
        success = self.room == self.goal
        truncated = not success and self.turns >= self.max_turns
        info = {
            "state_key": key,
            "success": success,
            "invalid_action": exit_ is None,
            "action_quality": quality,
            "gold_answer": self.gold_answer,
            "tool_calls": self.turns,
        }
        head = ["<invalid>" if exit_ is None else "<at>", f"r{self.room}"]
        obs = Observation(user=self._words(head, lambda i: f"o{i % 4}"))
        return StepResult(obs, float(success), success, truncated, info)

    def optimal_turn(self) -> str:
        """The scripted optimal policy: scratch words, then an exit on a shortest path."""
        best = min(
            range(self.exits), key=lambda e: self.distance[self.graph[self.room, e], self.goal]
        )
        return " ".join(["s0"] * self.scratch + [f"e{best}"])


class KeyDoor(_WordTask):
    """Pick the door's key on the first turn; the door opens after ``distractors`` more turns.

    Args:
      seed: the episode stream's seed (instance and observation noise).
      split: 'train' | 'test' | 'all': the (door, context room) pairs drawn from.
      keys: how many keys (and doors); door j needs key j.
      contexts: how many context rooms the prompt may name (irrelevant to the outcome).
      distractors: turns after the choice in which nothing matters (max_turns = distractors + 1).
      turn_length: words a turn; the first key word of turn 0 is the pick.
      obs_len: observation length in words.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        split: str = "train",
        keys: int = 4,
        contexts: int = 6,
        distractors: int = 5,
        turn_length: int = 4,
        obs_len: int = 3,
    ):
        if keys < 2 or contexts < 1 or distractors < 1 or turn_length < 1 or obs_len < 2:
            raise ValueError(
                "keydoor: need keys >= 2, contexts >= 1, distractors >= 1, turn_length >= 1, "
                f"obs_len >= 2; got {keys}, {contexts}, {distractors}, {turn_length}, {obs_len}"
            )
        self.keys, self.contexts = keys, contexts
        self.max_turns = distractors + 1
        self.turn_length, self.obs_len = turn_length, obs_len
        vocabulary = (
            SPECIALS
            + [f"d{i}" for i in range(keys)]
            + [f"k{i}" for i in range(keys)]
            + [f"r{i}" for i in range(contexts)]
            + [f"s{i}" for i in range(4)]
            + [f"o{i}" for i in range(4)]
        )
        instances = [(d, c) for d in range(keys) for c in range(contexts)]
        super().__init__(seed=seed, split=split, instances=instances, codec=WordCodec(vocabulary))
        self.door = self.context = 0
        self.held: int | None = None
        self.turns = 0

    def reset(self) -> list[dict]:
        self.door, self.context = self._draw()
        self.held, self.turns = None, 0
        return [{"role": "user", "content": f"<bos> <goal> d{self.door} <at> r{self.context}"}]

    @property
    def state_key(self) -> tuple:
        return (self.door, self.context, self.held, self.turns)

    @property
    def gold_answer(self) -> str:
        return f"k{self.door}"

    def _first_key(self, text: str) -> int | None:
        for w in text.split():
            if w.startswith("k") and w[1:].isdigit() and int(w[1:]) < self.keys:
                return int(w[1:])
        return None

    def step(self, text: str) -> StepResult:
        key = self.state_key
        quality = 0.0
        if self.turns == 0:
            self.held = self._first_key(text)
            quality = 1.0 if self.held == self.door else -1.0
        self.turns += 1
        done = self.turns >= self.max_turns
        success = done and self.held == self.door
        info = {
            "state_key": key,
            "success": success,
            "action_quality": quality,
            "gold_answer": self.gold_answer,
            "tool_calls": self.turns,
        }
        head = ["<at>", "<invalid>" if self.held is None else f"k{self.held}"]
        noise = lambda i: f"r{int(self.rng.integers(self.contexts))}"  # noqa: E731
        obs = Observation(user=self._words(head, noise))
        return StepResult(obs, float(success), done, False, info)

    def optimal_turn(self) -> str:
        """The scripted optimal policy: the door's key on turn 0, scratch words after."""
        last = f"k{self.door}" if self.turns == 0 else "s0"
        return " ".join(["s0"] * (self.turn_length - 1) + [last])


register("synthetic-nav", SyntheticNav)
register(
    "synthetic-nav-long",
    lambda seed=0, **kw: SyntheticNav(
        seed=seed,
        **{"rooms": 24, "max_distance": 5, "max_turns": 8, "scratch": 3, "obs_len": 6, **kw},
    ),
)
register(
    "synthetic-nav-longturns",
    lambda seed=0, **kw: SyntheticNav(
        seed=seed, **{"max_turns": 6, "scratch": 23, "scratch_words": 4, **kw}
    ),
)
register(
    "synthetic-nav-noisy",
    lambda seed=0, **kw: SyntheticNav(seed=seed, **{"slip": 0.25, "max_turns": 8, **kw}),
)
register("synthetic-keydoor", KeyDoor)
