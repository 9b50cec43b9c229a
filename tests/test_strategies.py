"""Strategy metrics and scripted players of the TextArena games (envs/strategies.py): the metrics
on hand-made games, the reference players' success against their arithmetic, the metrics in the
trainer's figures, the format-only warm start's players, and the refusal of a warm start made for
another game or model."""

from __future__ import annotations

import json
import random

import pytest

import envs
from envs.rollout import EPISODE_FIGURES
from envs.strategies import (
    PLAYERS,
    STRATEGY_FIGURES,
    STRATEGY_FREE,
    FrozenLakeTracker,
    GuessTheNumberTracker,
    SecretaryTracker,
    play,
    secretary_threshold,
    success_rate,
)
from train import run, sft
from train.study.real_model import wilson


def test_guess_the_number_consistency_and_repeats_on_a_hand_made_game():
    tracker = GuessTheNumberTracker(1, 20)
    history = []
    for guess, hint in ((10, "higher"), (5, "higher"), (15, "lower"), (15, None)):
        tracker.move({"guess_history": list(history)}, f"[{guess}]")
        if hint:
            history.append((guess, hint))
    # allowed: 1-20 (10 inside), 11-20 (5 outside), 11-20 (15 inside), 11-14 (15 outside, again)
    figures = tracker.figures(won=False)
    assert figures == {"hint_consistency": 0.5, "repeat_rate": 0.25}
    tracker.move({"guess_history": history}, None)  # a format error is no guess
    assert tracker.figures(won=True)["turns_to_win"] == 5.0
    assert tracker.figures(won=True)["hint_consistency"] == 0.5


def test_a_player_following_the_hints_scores_one_and_one_ignoring_them_what_arithmetic_says():
    rng = random.Random(0)
    for player in ("bisection", "random_in_interval"):
        env = envs.make("guess-the-number", seed=3, split="test")
        fn = PLAYERS["GuessTheNumber"][player]
        env.reset()
        while True:
            result = env.step(fn(env, rng))
            if result.terminated or result.truncated:
                break
        assert result.info["success"] and result.info["hint_consistency"] == 1.0, player
        assert result.info["repeat_rate"] == 0.0
    # random distinct guesses of 1-20: the k-th guess (k >= 2) is inside the hinted interval with
    # probability E[interval size after k-1 hints] / (20 - (k-1)); over many games the mean
    # consistency lies strictly between 0 and 1 and the repeats are 0
    figures = []
    for seed in range(60):
        env = envs.make("guess-the-number", seed=seed)
        env.reset()
        while True:
            result = env.step(PLAYERS["GuessTheNumber"]["random_distinct"](env, rng))
            if result.terminated or result.truncated:
                break
        figures.append(result.info)
    consistency = sum(f["hint_consistency"] for f in figures) / len(figures)
    assert 0.3 < consistency < 0.9
    assert all(f["repeat_rate"] == 0.0 for f in figures)


def test_reference_lines_match_their_arithmetic():
    # GuessTheNumber-v0 (1-20, max_turns=10) checks its turn limit before counting the turn, so
    # it takes 11 guesses: 11 distinct random guesses of 20 numbers win 11/20 = 55% of games (not
    # 50%); the hinted-interval player and bisection always win
    rate, wins = success_rate("guess-the-number", "random_distinct", episodes=300)
    _, low, high = wilson(wins, 300)
    assert low < 11 / 20 < high
    assert success_rate("guess-the-number", "bisection", episodes=50)[0] == 1.0
    assert success_rate("frozen-lake", "shortest_path", episodes=50)[0] == 1.0
    first, _ = success_rate("secretary", "accept_first", episodes=300)
    best, _ = success_rate("secretary", "optimal_thresholds", episodes=300)
    assert best > first + 0.2  # the full-information optimum beats the first value by far
    with pytest.raises(ValueError, match="episodes: must be >= 1"):
        success_rate("guess-the-number", "bisection", episodes=0)


def test_secretary_thresholds_solve_their_equation():
    assert secretary_threshold(0) == 0.0
    assert secretary_threshold(1) == pytest.approx(0.5, abs=1e-9)  # (1/b - 1) = 1
    b = secretary_threshold(2)
    assert (1 / b - 1) + (1 / b**2 - 1) / 2 == pytest.approx(1.0, abs=1e-9)
    assert b == pytest.approx(0.6899, abs=1e-4)


def test_frozen_lake_counts_holes_walls_and_the_path_ratio():
    grid = [["P", " ", " "], [" ", "H", " "], [" ", " ", "G"]]
    tracker = FrozenLakeTracker(grid, (0, 0))
    assert tracker.shortest == 4
    tracker.move({"grid": grid, "player_pos": (0, 0)}, "[up]")  # off the grid
    tracker.move({"grid": grid, "player_pos": (0, 1)}, "[down]")  # into the hole
    tracker.move({"grid": grid, "player_pos": (0, 0)}, "[right]")
    tracker.move({"grid": grid, "player_pos": (0, 1)}, "[right]")
    figures = tracker.figures(won=True)
    assert figures["wall_moves"] == 0.25 and figures["hole_moves"] == 0.25
    assert figures["path_ratio"] == 1.0  # 4 moves over a shortest path of 4
    env = envs.make("frozen-lake", seed=1, split="test")
    assert play(env, PLAYERS["FrozenLake"]["shortest_path"], random.Random(0))


def test_secretary_reports_the_accepted_rank():
    tracker = SecretaryTracker()
    draws = [0.3, 0.9, 0.5, 0.1]
    tracker.move({"draws": draws, "current_idx": 1}, "[continue]")
    tracker.move({"draws": draws, "current_idx": 2}, "[continue]")
    tracker.move({"draws": draws, "current_idx": 3}, "[accept]")
    assert tracker.figures(won=False)["accepted_rank"] == 2.0


def test_the_strategy_figures_reach_the_trainers_metrics():
    assert set(STRATEGY_FIGURES) <= set(EPISODE_FIGURES)
    env = envs.make("guess-the-number", seed=0)
    assert play(env, PLAYERS["GuessTheNumber"]["bisection"], random.Random(0))


def test_the_format_only_warm_start_learns_strategy_free_demonstrations(tmp_path, capsys):
    for family, name in STRATEGY_FREE.items():
        assert name in PLAYERS[family]
    argv = [
        "--env", "guess-the-number", "--layers", "1", "--width", "32", "--heads", "2",
        "--kv-heads", "1", "--steps", "1", "--demos", "8", "--val-demos", "4",
        "--eval-episodes", "0", "--max-len", "1024", "--no-progress",
    ]  # fmt: skip
    bad = tmp_path / "bad"
    assert sft.main([*argv, "--demo-player", "bisect", "--run-dir", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "demo_player: 'bisect' is not a player of GuessTheNumber-v0" in err
    assert not bad.exists()
    warm = tmp_path / "warm"
    assert sft.main([*argv, "--demo-player", "random_distinct", "--run-dir", str(warm)]) == 0
    config = json.loads((warm / "config.json").read_text())
    assert config["sft"]["demo_player"] == "random_distinct"
    metrics = [json.loads(line) for line in (warm / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= metrics[0]["demo_success_rate"] <= 1.0

    # a run from this warm start on another game, or naming another model, is refused
    other = tmp_path / "other"
    tiny = ["--layers", "1", "--width", "32", "--heads", "2", "--kv-heads", "1", "--steps", "1"]
    assert run.main([*tiny, "--env", "secretary", "--init-from", str(warm),
                     "--run-dir", str(other)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "is a warm start made for --env guess-the-number, not --env secretary" in err
    assert not other.exists()
