"""TextArena's single-player games as environments: someone else's tasks, played in chat.

    env = envs.make("textarena", game="GuessTheNumber-v0", seed=3)      # any single-player id
    env = envs.make("guess-the-number", seed=3, max_number=20)          # a registered short name

TextArena (PyPI ``textarena``, MIT) ships 100+ text games. One episode is one game: the game's
prompt (and board, where it has one) is the first user message; each assistant turn is a move;
what the game says back (a hint, the new board, an invalid-move notice) is the next user message.

**History.** Each user message carries only what the game said since the last move. The
conversation itself is the history (the model's moves and every earlier reply are already in its
context, token for token), so TextArena's observation wrappers, which resend the whole history
every turn, are not used: they would grow the context quadratically, and they keep their history
across ``reset`` (one of the package's pitfalls, below).

**Moves.** TextArena wants moves in square brackets (``[7]``, ``[up]``).
[`extract_move`][envs.textarena.extract_move] takes the last bracketed span of the turn (models
restate the prompt's example, ``For example, [5]``, before their own move); a turn without one is a
*format error*, counted (``format_error_rate`` in the episode's figures) and passed to the game as
written, so that the game answers it as it would any invalid move.

**Reward.** 1 on a win, 0 otherwise. TextArena gives a loser partial credit (GuessTheNumber: how
close the last guess was; an invalid move: -1 or the progress so far); it is logged apart as
``partial_credit``, never rewarded, so success and reward mean the same thing on every game.

**Instances and the held-out split.** An episode's game is drawn from the environment's seed:
the game is reset with a private random state seeded from it, and the instance it produced (the
game's state at reset, e.g. the target number or the board layout) decides the split: an instance
whose hash falls in the held-out fifth (`envs.splits.SPLIT_SEED`) belongs to ``test``, the
rest to ``train``, and a seed whose instance is of the other split draws again (deterministically).
So held-out evaluation plays target numbers or board layouts training never saw, even though
seeds alone would repeat layouts.

**The package's pitfalls, handled.** ``reset(seed=...)`` reseeds Python's global ``random``, and
the games draw from it: here every call into a game runs with the episode's own random state,
swapped in and out under a lock (environments may be stepped from several threads), so no game
disturbs another or the caller. The observation wrappers keep history across ``reset``: not used.
Games that need the network are refused at construction, naming why (`NEEDS_NETWORK`): the
word games download NLTK's word lists at run time; TwentyQuestions, GuessWho and the debate-style
games build a hosted-LLM client. Multi-player games are refused too.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import inspect
import json
import random
import re
import threading
from typing import Any

from envs.base import Env, Observation, StepResult
from envs.chat import qwen3_chat_format
from envs.splits import SPLIT_SEED, check_split
from envs.strategies import game_family, tracker_for

__all__ = [
    "TextArenaEnv",
    "NEEDS_NETWORK",
    "SHORT_NAMES",
    "extract_move",
    "instance_split",
    "closest_single_player",
]

# TextArena game family (the folder of its env module) -> why it cannot run offline.
NEEDS_NETWORK = {
    **{
        family: "downloads NLTK's word lists at run time (nltk.download('words'))"
        for family in (
            "Codenames",
            "DontSayIt",
            "Hangman",
            "LetterAuction",
            "SpellingBee",
            "WordChains",
            "WordLadder",
            "WordSearch",
            "Wordle",
        )
    },
    **{
        family: "builds a hosted-LLM client (an API key and the network)"
        for family in ("Debate", "GuessWho", "ScenarioPlanning", "TwentyQuestions")
    },
}

# short name -> TextArena game id (the games this project reports on)
SHORT_NAMES = {
    "guess-the-number": "GuessTheNumber-v0",
    "frozen-lake": "FrozenLake-v0",
    "mastermind": "Mastermind-v0",
    "secretary": "Secretary-v0",
}

_BRACKETED = re.compile(r"\[([^\[\]\n]{1,64})\]")
_GAME_LOCK = threading.Lock()  # the games draw from Python's global random (see the docstring)
_MAX_DRAWS = 1000


def extract_move(text: str) -> str | None:
    """The turn's move: its last ``[...]`` span (one line, at most 64 characters, inner spaces
    stripped), as ``[move]``; None when the turn has none (a format error)."""
    moves = [m.strip() for m in _BRACKETED.findall(text)]
    moves = [m for m in moves if m]
    return f"[{moves[-1]}]" if moves else None


def instance_split(game: str, key: str) -> str:
    """``test`` for the held-out fifth of a game's instances (by the hash of their key), else
    ``train``."""
    digest = hashlib.sha256(f"{SPLIT_SEED}:{game}:{key}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "little") % 5 == 0 else "train"


def closest_single_player(game: str, n: int = 5) -> list[str]:
    """The TextArena ids closest to ``game`` (difflib, case-insensitive) that run here: offline
    single-player games; at most ``n``."""
    from textarena.envs.registration import ENV_REGISTRY

    lowered = {gid.lower(): gid for gid in ENV_REGISTRY}
    near = difflib.get_close_matches(game.lower(), list(lowered), n=4 * n, cutoff=0.5)
    out = []
    for key in near:
        gid = lowered[key]
        try:
            TextArenaEnv(game=gid)
        except Exception:  # multi-player, needs the network, or fails to build: not offered
            continue
        out.append(gid)
        if len(out) == n:
            break
    return out


def _family(spec) -> str:
    entry = spec.entry_point
    module = entry.split(":")[0] if isinstance(entry, str) else entry.__module__
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["textarena", "envs"] else module


def _game_class(spec):
    entry = spec.entry_point
    if not isinstance(entry, str):
        return entry
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)


def _json_key(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, default=lambda o: sorted(o) if isinstance(o, set) else repr(o)
    )


class TextArenaEnv(Env):
    """Args:
      seed: which instance (see the module docstring: drawn, then kept to ``split``).
      game: a TextArena game id (``GuessTheNumber-v0``) or a key of `SHORT_NAMES`.
      split: ``train`` or ``test`` (held-out instances), or ``all``.
      max_turns: assistant turns before the episode is cut (truncated: the game did not end);
        default twice the game's own turn limit (each invalid move may be retried once), or 40.
      turn_length: tokens a turn may take (the trainer's default ``--max-new-tokens``).
      **game_options: the game's own constructor arguments (``max_number=20``, ``size=4``...),
        checked against its signature.

    Raises ``ValueError`` naming the game for an unknown id, a multi-player game, a game that
    needs the network, or an option the game does not take.
    """

    chat_format = True
    eval_fresh = False  # training success is logged every step; evaluation plays held-out instances

    def __init__(
        self,
        *,
        seed: int = 0,
        game: str = "GuessTheNumber-v0",
        split: str = "train",
        max_turns: int | None = None,
        turn_length: int = 48,
        **game_options,
    ):
        from textarena.envs.registration import ENV_REGISTRY

        check_split(split)
        game = SHORT_NAMES.get(game, game)
        if game not in ENV_REGISTRY:
            close = closest_single_player(game)
            known = f"; the closest single-player ids: {', '.join(close)}" if close else ""
            raise ValueError(
                f"game: {game!r} is not a TextArena game id (e.g. GuessTheNumber-v0){known}"
            )
        spec = ENV_REGISTRY[game]
        family = _family(spec)
        if family in NEEDS_NETWORK:
            raise ValueError(f"game: {game} cannot run offline: it {NEEDS_NETWORK[family]}")
        self.game_id, self.split, self.codec = game, split, qwen3_chat_format()
        self.turn_length = int(turn_length)
        cls = _game_class(spec)
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
        unknown = sorted(set(game_options) - accepted)
        if unknown:
            raise ValueError(f"game_options: {game} takes {sorted(accepted)}; unknown: {unknown}")
        self._options = {**spec.kwargs, **game_options}
        self._make = lambda: cls(**self._options)
        self._draws = random.Random(f"{game}:{seed}")
        self._random = random.Random(0).getstate()
        self._game = None
        try:
            probe = self._call(self._new_game, random.Random(seed).getrandbits(64))
        except AssertionError as e:
            raise ValueError(f"game: {game} is not a single-player game ({e})") from e
        game_turns = getattr(getattr(probe, "state", None), "max_turns", None)
        if max_turns is None:
            max_turns = 2 * game_turns if game_turns else 40
        self.max_turns = int(max_turns)
        if self.max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {self.max_turns}")
        self._key: str | None = None
        self.turns = self.format_errors = 0
        self.done = False

    # -- the game, always under its own random state ----------------------------------------
    def _call(self, fn, *args):
        with _GAME_LOCK:
            outside = random.getstate()
            random.setstate(self._random)
            try:
                return fn(*args)
            finally:
                self._random = random.getstate()
                random.setstate(outside)

    def _new_game(self, instance_seed: int):
        random.seed(instance_seed)
        game = self._make()
        game.reset(num_players=1, seed=None)  # seed=None: TextArena would reseed global random
        return game

    def _state_json(self) -> str:
        """The game's state now as canonical JSON (at reset: the instance's key)."""
        return _json_key(self._game.state.game_state) if self._game else ""

    # -- the Env contract --------------------------------------------------------------------
    @property
    def task_id(self):
        return self._key

    @property
    def gold_answers(self) -> bool:
        """Whether every task has a gold answer (TRACE's): GuessTheNumber's target, as a move."""
        return game_family(self.game_id) == "GuessTheNumber"

    @property
    def gold_answer(self) -> str | None:
        """The move that wins now (GuessTheNumber: ``[target]``); None for the other games."""
        state = self._game.state.game_state if self._game else {}
        return f"[{state['game_number']}]" if "game_number" in state else None

    @property
    def state_key(self) -> str:
        """GiGPO's key: the game's state now (the hint history, the board)."""
        return f"{self._key}|{self._state_json()}"

    def reset(self) -> list[dict]:
        for _ in range(_MAX_DRAWS):
            self._game = self._call(self._new_game, self._draws.getrandbits(64))
            key = self._state_json()
            if self.split == "all" or instance_split(self.game_id, key) == self.split:
                break
        else:
            raise ValueError(
                f"split: {self.game_id} drew no {self.split!r} instance in {_MAX_DRAWS} draws "
                "(its instances repeat too little to hold one out)"
            )
        self._key = key
        self.turns = self.format_errors = 0
        self.done = False
        self._tracker = tracker_for(self.game_id, self._game.state.game_state, self._options)
        return [{"role": "user", "content": self._new_messages()}]

    def _new_messages(self) -> str:
        """What the game said since the last move (its own echo of the move left out)."""
        import textarena as ta

        _, messages = self._game.get_observation()
        said = [m for _, m, kind in messages if kind != ta.ObservationType.PLAYER_ACTION]
        return "\n\n".join(s.strip() for s in said if s and s.strip()) or "(the game says nothing)"

    def step(self, text: str) -> StepResult:
        if self._game is None or self.done:
            return StepResult(Observation(user="The game is over."), 0.0, True, False, {})
        self.turns += 1
        move = extract_move(text)
        self.format_errors += move is None
        played = move if move is not None else text[:500]
        info: dict[str, Any] = {"format_error": move is None}
        self._tracker.move(self._game.state.game_state, move)
        try:
            done, _ = self._call(self._game.step, played)
        except Exception as e:  # noqa: BLE001  (a game that raises ends its episode, not the run)
            self.done = True
            info.update(
                self._figures(), error=True, failure=f"the game raised {type(e).__name__}: {e}"
            )
            return StepResult(Observation(user="The game broke."), 0.0, False, True, info)
        if done:
            self.done = True
            rewards, game_info = self._game.close()
            credit = float((rewards or {}).get(0, 0.0))
            won = credit >= 1.0
            player = (game_info or {}).get(0, {})
            info.update(
                self._figures(won),
                success=won,
                partial_credit=0.0 if won else credit,
                invalid_move=float(bool(player.get("invalid_move"))),
                failure=None if won else str(player.get("reason", "")),
            )
            return StepResult(
                Observation(user=str(player.get("reason", ""))), float(won), True, False, info
            )
        info.update(self._figures(), success=False)
        truncated = self.turns >= self.max_turns
        self.done = truncated
        return StepResult(Observation(user=self._new_messages()), 0.0, False, truncated, info)

    def _figures(self, won: bool = False) -> dict[str, float]:
        """The format error rate and the strategy metrics (`envs.strategies`)."""
        return {
            "format_error_rate": self.format_errors / max(self.turns, 1),
            **self._tracker.figures(won),
        }

    # -- the trainer's oracle (check_environment), for the games that have one ---------------
    def optimal_turn(self) -> str:
        """The scripted best move of the games with a cheap solver (GuessTheNumber: bisect on
        the hints; FrozenLake: a shortest path around the holes)."""
        state = self._game.state.game_state
        if "game_number" in state:
            low, high = self._options.get("min_number", 1), self._options.get("max_number", 20)
            for guess, hint in state.get("guess_history", []):
                if hint == "higher":
                    low = max(low, guess + 1)
                else:
                    high = min(high, guess - 1)
            return f"My guess: [{(low + high) // 2}]"
        if "grid" in state:
            return f"[{_frozen_lake_move(state['grid'], state['player_pos'])}]"
        raise NotImplementedError(f"{self.game_id}: no scripted solver")


def _frozen_lake_move(grid, start) -> str:
    """The first move of a shortest path from ``start`` to the goal around the holes (BFS)."""
    from collections import deque

    size = len(grid)
    moves = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
    start = tuple(start)
    first = {start: None}
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        if grid[r][c] == "G":
            break
        for name, (dr, dc) in moves.items():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in first:
                if grid[nxt[0]][nxt[1]] != "H":
                    first[nxt] = first[(r, c)] or name
                    queue.append(nxt)
    return first[(r, c)] or "down"
