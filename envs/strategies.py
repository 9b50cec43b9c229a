"""What a player of a TextArena game does, not only whether it wins: strategy metrics, and the
scripted players whose success draws the reference lines.

**Metrics** (one tracker an episode, fed every move before the game applies it; its figures join
the episode's info at the end, so the trainer logs them every step and every evaluation as
``env_<name>`` / ``eval_<split>_env_<name>``):

- GuessTheNumber: ``hint_consistency``, the share of number guesses inside the interval the hints
  so far allow (a player following the hints scores 1.0); ``repeat_rate``, the share of guesses
  repeating an earlier one.
- FrozenLake: ``hole_moves`` and ``wall_moves``, the share of moves into a hole or off the grid;
  ``path_ratio``, moves taken over the shortest path's length (won episodes).
- Secretary: ``accepted_rank``, the rank of the value kept among all the episode's values (1 = the
  best).
- Every game: ``turns_to_win`` (won episodes).

**Players** (`PLAYERS`; each ``player(env, rng) -> text`` is one turn, read off the game's
state): GuessTheNumber ``random_distinct`` (a number not guessed yet, hints ignored),
``random_in_interval`` (uniform inside the interval the hints allow), ``bisection``; FrozenLake
``random_valid`` (a move that stays on the grid), ``shortest_path``; Secretary ``accept_first``,
``accept_random`` (accepts each value with probability 1/N), ``optimal_thresholds`` (the
full-information optimum for uniform values: accept the best value so far when it exceeds the
threshold of the number of values left, Gilbert and Mosteller 1966). Strategy-free players
(`STRATEGY_FREE`) write the game's exact move format and use nothing earlier turns revealed:
their demonstrations teach the format alone (``python -m train.sft --demo-player``).
"""

from __future__ import annotations

import functools
import random
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = [
    "PLAYERS",
    "STRATEGY_FREE",
    "STRATEGY_FIGURES",
    "game_family",
    "tracker_for",
    "secretary_threshold",
    "play",
    "success_rate",
]

STRATEGY_FIGURES = (
    "hint_consistency",
    "repeat_rate",
    "hole_moves",
    "wall_moves",
    "path_ratio",
    "accepted_rank",
    "turns_to_win",
)
_MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def game_family(game_id: str) -> str:
    """``GuessTheNumber-v0`` -> ``GuessTheNumber``."""
    return game_id.split("-v")[0]


# -- trackers: the metrics of one episode ------------------------------------------------------


class _Tracker:
    """Counts moves; `figures` adds ``turns_to_win``."""

    def __init__(self):
        self.moves = 0

    def move(self, state: dict, move: str | None) -> None:
        self.moves += 1

    def figures(self, won: bool) -> dict[str, float]:
        return {"turns_to_win": float(self.moves)} if won else {}


class GuessTheNumberTracker(_Tracker):
    def __init__(self, low: int, high: int):
        super().__init__()
        self.low, self.high = low, high
        self.guesses = self.consistent = self.repeats = 0
        self.seen: set[int] = set()

    def move(self, state: dict, move: str | None) -> None:
        super().move(state, move)
        guess = _number(move)
        if guess is None:
            return
        low, high = self.low, self.high
        for earlier, hint in state.get("guess_history", []):
            if hint == "higher":
                low = max(low, earlier + 1)
            else:
                high = min(high, earlier - 1)
        self.guesses += 1
        self.consistent += low <= guess <= high
        self.repeats += guess in self.seen
        self.seen.add(guess)

    def figures(self, won: bool) -> dict[str, float]:
        out = super().figures(won)
        if self.guesses:
            out["hint_consistency"] = self.consistent / self.guesses
            out["repeat_rate"] = self.repeats / self.guesses
        return out


class FrozenLakeTracker(_Tracker):
    def __init__(self, grid, start):
        super().__init__()
        self.shortest = _shortest_path(grid, tuple(start))
        self.holes = self.walls = 0

    def move(self, state: dict, move: str | None) -> None:
        super().move(state, move)
        name = (move or "").strip("[] ").lower()
        if name not in _MOVES:
            return
        grid, (r, c) = state["grid"], state["player_pos"]
        nr, nc = r + _MOVES[name][0], c + _MOVES[name][1]
        if not (0 <= nr < len(grid) and 0 <= nc < len(grid)):
            self.walls += 1
        elif grid[nr][nc] == "H":
            self.holes += 1

    def figures(self, won: bool) -> dict[str, float]:
        out = super().figures(won)
        if self.moves:
            out["hole_moves"] = self.holes / self.moves
            out["wall_moves"] = self.walls / self.moves
        if won and self.shortest:
            out["path_ratio"] = self.moves / self.shortest
        return out


class SecretaryTracker(_Tracker):
    def __init__(self):
        super().__init__()
        self.accepted: int | None = None
        self.draws: list[float] = []

    def move(self, state: dict, move: str | None) -> None:
        super().move(state, move)
        self.draws = list(state["draws"])
        shown = state["current_idx"] - 1
        last = shown >= len(self.draws) - 1
        if (move or "").strip().lower() == "[accept]" or (last and move is not None):
            self.accepted = shown

    def figures(self, won: bool) -> dict[str, float]:
        out = super().figures(won)
        if self.accepted is not None and self.draws:
            value = self.draws[self.accepted]
            out["accepted_rank"] = float(1 + sum(d > value for d in self.draws))
        return out


def tracker_for(game_id: str, state: dict, options: dict[str, Any]) -> _Tracker:
    """The metrics tracker of a game at reset (its state then, its constructor options)."""
    family = game_family(game_id)
    if family == "GuessTheNumber":
        return GuessTheNumberTracker(options.get("min_number", 1), options.get("max_number", 20))
    if family == "FrozenLake":
        return FrozenLakeTracker(state["grid"], state["player_pos"])
    if family == "Secretary":
        return SecretaryTracker()
    return _Tracker()


def _number(move: str | None) -> int | None:
    try:
        return int((move or "").strip("[] "))
    except ValueError:
        return None


def _shortest_path(grid, start) -> int | None:
    """Moves of a shortest path from ``start`` to the goal around the holes (BFS); None if none."""
    size = len(grid)
    seen = {start: 0}
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        if grid[r][c] == "G":
            return seen[(r, c)]
        for dr, dc in _MOVES.values():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in seen:
                if grid[nxt[0]][nxt[1]] != "H":
                    seen[nxt] = seen[(r, c)] + 1
                    queue.append(nxt)
    return None


# -- players: one turn each, read off the game's state ------------------------------------------

Player = Callable[[Any, random.Random], str]


def _interval(env) -> tuple[int, int, set[int]]:
    state = env._game.state.game_state
    low, high = env._options.get("min_number", 1), env._options.get("max_number", 20)
    guessed = {g for g, _ in state.get("guess_history", [])}
    for guess, hint in state.get("guess_history", []):
        if hint == "higher":
            low = max(low, guess + 1)
        else:
            high = min(high, guess - 1)
    return low, high, guessed


def random_distinct(env, rng: random.Random) -> str:
    low, high = env._options.get("min_number", 1), env._options.get("max_number", 20)
    _, _, guessed = _interval(env)
    left = [n for n in range(low, high + 1) if n not in guessed] or [low]
    return f"[{rng.choice(left)}]"


def random_in_interval(env, rng: random.Random) -> str:
    low, high, guessed = _interval(env)
    left = [n for n in range(low, high + 1) if n not in guessed] or [low]
    return f"[{rng.choice(left)}]"


def bisection(env, rng: random.Random) -> str:
    low, high, _ = _interval(env)
    return f"[{(low + high) // 2}]"


def random_valid(env, rng: random.Random) -> str:
    state = env._game.state.game_state
    r, c = state["player_pos"]
    size = len(state["grid"])
    legal = [m for m, (dr, dc) in _MOVES.items() if 0 <= r + dr < size and 0 <= c + dc < size]
    return f"[{rng.choice(legal)}]"


def shortest_path(env, rng: random.Random) -> str:
    return env.optimal_turn()


def accept_first(env, rng: random.Random) -> str:
    return "[accept]"


def accept_random(env, rng: random.Random) -> str:
    n = len(env._game.state.game_state["draws"])
    return "[accept]" if rng.random() < 1 / n else "[continue]"


@functools.cache
def secretary_threshold(left: int) -> float:
    """The full-information threshold b with ``left`` values still to come (uniform values):
    ``Σ_{j=1}^{left} (b^{-j} - 1) / j = 1`` (Gilbert and Mosteller 1966); 0 when none are left."""
    if left <= 0:
        return 0.0
    lo, hi = 1e-12, 1.0
    for _ in range(100):
        b = (lo + hi) / 2
        total = sum((b**-j - 1) / j for j in range(1, left + 1))
        lo, hi = (b, hi) if total > 1 else (lo, b)
    return (lo + hi) / 2


def optimal_thresholds(env, rng: random.Random) -> str:
    state = env._game.state.game_state
    draws, shown = state["draws"], state["current_idx"] - 1
    value = draws[shown]
    best_so_far = value >= max(draws[: shown + 1])
    left = len(draws) - shown - 1
    return "[accept]" if best_so_far and value >= secretary_threshold(left) else "[continue]"


PLAYERS: dict[str, dict[str, Player]] = {
    "GuessTheNumber": {
        "random_distinct": random_distinct,
        "random_in_interval": random_in_interval,
        "bisection": bisection,
    },
    "FrozenLake": {"random_valid": random_valid, "shortest_path": shortest_path},
    "Secretary": {
        "accept_first": accept_first,
        "accept_random": accept_random,
        "optimal_thresholds": optimal_thresholds,
    },
}
# the players that use nothing earlier turns revealed: a warm start on them teaches the format
STRATEGY_FREE = {
    "GuessTheNumber": "random_distinct",
    "FrozenLake": "random_valid",
    "Secretary": "accept_random",
}


def play(env, player: Player, rng: random.Random) -> bool:
    """One episode of ``env`` (reset here) by ``player``; whether it won."""
    env.reset()
    while True:
        result = env.step(f"My move: {player(env, rng)}")
        if result.terminated or result.truncated:
            return bool(result.info.get("success", False))


def success_rate(game: str, player: str, *, episodes: int, split: str = "test",
                 first_seed: int = 0, **options) -> tuple[float, int]:  # fmt: skip
    """(wins / episodes, wins) of a named player on ``episodes`` games of ``split``, environment
    seeds ``first_seed + i`` (an evaluation's tasks: ``train.core.episodes.EVAL_TASK_OFFSET + seed
    * 1_000_003``; intervals: [`wilson`][train.study.real_model.wilson])."""
    import envs

    if episodes < 1:
        raise ValueError(f"episodes: must be >= 1, got {episodes}")
    rng = random.Random(f"{player}:{first_seed}")
    fn, wins = None, 0
    for i in range(episodes):
        env = envs.make(game, seed=first_seed + i, split=split, **options)
        fn = fn or PLAYERS[game_family(env.game_id)][player]  # the first game names the family
        wins += play(env, fn, rng)
    return wins / episodes, wins
