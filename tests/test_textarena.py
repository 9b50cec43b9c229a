"""TextArena's games as environments: the checks and fuzz every environment passes, held-out
instances apart from training ones, determinism, the package's pitfalls, refusals."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import envs
from envs.checks import check_environment, play_episode
from envs.textarena import NEEDS_NETWORK, TextArenaEnv, extract_move, instance_split


@pytest.mark.parametrize("name", ["guess-the-number", "frozen-lake"])
def test_games_pass_the_environment_checks(name):
    report = check_environment(lambda seed: envs.make(name, seed=seed), episodes=8)
    assert report["scripted_success"] == 1.0


@pytest.mark.parametrize("name", ["guess-the-number", "frozen-lake"])
def test_held_out_instances_are_never_drawn_in_training(name):
    train = set()
    for s in range(120):
        env = envs.make(name, seed=s, split="train")
        env.reset()
        train.add(env.task_id)
    test = set()
    for s in range(60):
        env = envs.make(name, seed=s, split="test")
        env.reset()
        test.add(env.task_id)
    assert test and train and not (train & test)
    assert all(instance_split(env.game_id, k) == "test" for k in test)


def test_guess_the_number_holds_out_target_numbers():
    targets = {"train": set(), "test": set()}
    for split in targets:
        for s in range(200):
            env = envs.make("guess-the-number", seed=s, split=split)
            env.reset()
            targets[split].add(env._game.state.game_state["game_number"])
    assert targets["train"] | targets["test"] == set(range(1, 21))
    assert not targets["train"] & targets["test"] and 1 <= len(targets["test"]) <= 8


def test_instances_follow_the_seed_and_leave_global_random_alone():
    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    random.seed(1234)
    got = [random.random()]
    a = envs.make("guess-the-number", seed=7)
    a.reset()
    a.step("[10]")
    got.append(random.random())
    b = envs.make("guess-the-number", seed=7)
    b.reset()
    got.append(random.random())
    assert got == expected  # no game touched the caller's random stream
    assert a.task_id == b.task_id
    assert envs.make("frozen-lake", seed=3).reset() == envs.make("frozen-lake", seed=3).reset()
    ids = set()
    for s in range(30):
        env = envs.make("guess-the-number", seed=s)
        env.reset()
        ids.add(env.task_id)
    assert len(ids) > 5  # seeds draw different instances


def test_a_second_reset_starts_clean():
    env = envs.make("guess-the-number", seed=2)
    env.reset()
    env.step("[3]")
    env.step("no move here")
    first = env.reset()
    assert "history" not in first[0]["content"].lower() or "appended below" in first[0]["content"]
    assert "[3]" not in first[0]["content"] and env.turns == 0 and env.format_errors == 0


def test_only_a_win_is_rewarded_and_partial_credit_is_logged_apart():
    env = envs.make("guess-the-number", seed=5)
    env.reset()
    target = env._game.state.game_state["game_number"]
    wrong = 1 if target != 1 else 2
    result = env.step(f"[{wrong}]")
    assert result.reward == 0 and not result.terminated
    result = play_episode(env, ["nope", "still no move"])  # two format errors end the game
    assert result.terminated and result.reward == 0.0 and result.info["success"] is False
    assert result.info["invalid_move"] == 1.0 and result.info["format_error_rate"] == 1.0
    assert "partial_credit" in result.info
    win = play_episode(env, lambda e: f"I say [{e._game.state.game_state['game_number']}]")
    assert win.reward == 1.0 and win.info["success"] and win.info["partial_credit"] == 0.0


def test_the_turn_cap_truncates():
    env = envs.make("guess-the-number", seed=4, max_turns=2, max_number=1000)
    env.reset()
    assert not env.step("[500]").truncated
    last = env.step("[501]")
    assert last.truncated and not last.terminated


@given(st.text(alphabet=st.characters(blacklist_characters="[]"), max_size=80))
def test_a_turn_without_brackets_is_a_format_error(text):
    assert extract_move(text) is None


@given(st.lists(st.text(alphabet="abc 0123456789", min_size=1, max_size=8), min_size=1, max_size=4))
def test_the_last_bracketed_move_counts(moves):
    text = " then ".join(f"[{m}]" for m in moves)
    expected = [m.strip() for m in moves if m.strip()]
    assert extract_move(text) == (f"[{expected[-1]}]" if expected else None)


def test_moves_are_read_robustly():
    assert extract_move("For example, [5]. My guess is [ 12 ].") == "[12]"
    assert extract_move("**[up]**") == "[up]"
    assert extract_move("[\n]") is None and extract_move("[]") is None
    assert extract_move("[" + "x" * 100 + "]") is None  # not a move: too long


@pytest.mark.parametrize(
    "game, why",
    [
        ("Wordle-v0", "nltk.download"),
        ("Hangman-v0", "nltk.download"),
        ("TwentyQuestions-v0", "hosted-LLM client"),
        ("ConnectFour-v0", "not a single-player game"),
        ("NoSuchGame-v9", "is not a TextArena game id"),
    ],
)
def test_games_that_cannot_run_here_are_refused_naming_why(game, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        TextArenaEnv(game=game)


def test_unknown_game_options_and_splits_are_named():
    with pytest.raises(
        ValueError, match=r"game_options: GuessTheNumber-v0 takes .*unknown: \['size'\]"
    ):
        envs.make("guess-the-number", size=3)
    with pytest.raises(ValueError, match="split: must be"):
        envs.make("guess-the-number", split="dev")
    with pytest.raises(ValueError, match="max_turns: must be >= 1, got 0"):
        envs.make("guess-the-number", max_turns=0)


def test_the_refusal_table_covers_every_game_that_reaches_for_the_network():
    """Read the installed package's game sources: every family that downloads NLTK data or
    builds a hosted-LLM client is in NEEDS_NETWORK (the pinned version's list, checked)."""
    import textarena

    root = Path(textarena.__file__).parent / "envs"
    needs = set()
    for folder in root.iterdir():
        source = "".join(p.read_text(errors="ignore") for p in folder.glob("*.py"))
        if folder.name != "utils" and re.search(
            r"EnglishDictionary\(|nltk\.download|words\.words\(\)|OpenRouter|OpenAI\(", source
        ):
            needs.add(folder.name)
    assert needs and needs <= set(NEEDS_NETWORK), sorted(needs - set(NEEDS_NETWORK))


def test_games_stepped_from_threads_play_as_they_would_alone():
    def play(seed):
        env = envs.make("frozen-lake", seed=seed)
        env.reset()
        return [env.step(env.optimal_turn()).observation.user for _ in range(3)], env.task_id

    alone = [play(s) for s in range(6)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(play, range(6)))
    assert together == alone
