"""The reference lines of the real-model study: what scripted players score on each game's
held-out split, drawn beside every curve.

    python -m train.study.reference_lines [--episodes 400] [--out benchmarks/real_model]

Each player of `envs.strategies.PLAYERS` plays ``--episodes`` held-out games: the tasks an
evaluation at seed 0 draws (``EVAL_TASK_OFFSET``), so a line and an evaluation meet the same
target numbers, boards and value sequences. Success with its Wilson interval; written to
``reference_lines.json`` and ``reference_lines.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from envs.strategies import PLAYERS
from train.core.episodes import EVAL_TASK_OFFSET
from train.study.real_model import wilson

__all__ = ["GAMES", "reference_lines", "main"]

# the study's games (envs short names) -> their family in envs.strategies.PLAYERS
GAMES = {
    "guess-the-number": "GuessTheNumber",
    "frozen-lake": "FrozenLake",
    "secretary": "Secretary",
}


def reference_lines(episodes: int, games=tuple(GAMES)) -> dict[str, dict[str, dict]]:
    """``{game: {player: {"success", "low", "high", "episodes"}}}`` on the held-out split."""
    from envs.strategies import success_rate

    out: dict[str, dict[str, dict]] = {}
    for game in games:
        out[game] = {}
        for player in PLAYERS[GAMES[game]]:
            _, wins = success_rate(game, player, episodes=episodes, first_seed=EVAL_TASK_OFFSET)
            rate, low, high = wilson(wins, episodes)
            out[game][player] = {"success": rate, "low": low, "high": high, "episodes": episodes}
    return out


def markdown(lines: dict[str, dict[str, dict]]) -> str:
    rows = [
        "| game | player | held-out success | 95% interval | episodes |",
        "|---|---|---|---|---|",
    ]
    for game, players in lines.items():
        for player, f in players.items():
            rows.append(f"| {game} | {player} | {f['success']:.3f} | "
                        f"[{f['low']:.3f}, {f['high']:.3f}] | {f['episodes']} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.study.reference_lines", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--episodes", type=int, default=400, help="held-out games a player")
    parser.add_argument("--out", default="benchmarks/real_model", help="where the tables go")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        raise SystemExit(f"--episodes: must be >= 1, got {args.episodes}")
    started = time.perf_counter()
    lines = reference_lines(args.episodes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reference_lines.json").write_text(json.dumps(lines, indent=1) + "\n")
    text = markdown(lines)
    (out / "reference_lines.md").write_text(
        "# Reference lines: scripted players on the held-out split\n\n"
        f"`python -m train.study.reference_lines --episodes {args.episodes}`\n\n" + text
    )
    print(text, end="")
    print(f"wrote {out}/reference_lines.md and .json in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
