"""What a newcomer hit: checks made before the first step, nothing lost when an evaluation fails
after training, evaluation progress and outputs that never overwrite, and the messages that name
the way out."""

from __future__ import annotations

import argparse
import json

import pytest

import envs
from tests.test_train import TINY
from train import evaluate, run, sft
from train.core.build import model_source
from train.core.config import TrainConfig
from train.core.evaluation import evaluate_set
from train.core.metrics import MetricsLog, read_metrics
from train.engine.sampler import Sampler

# -- environments that fail the way the newcomer's games did ---------------------------------------

BROKEN = {"on": False, "test_resets": 0}


class _Wrapped:
    """synthetic-nav with a held-out split that cannot draw (``no_test``) or that raises from its
    second draw on while ``BROKEN['on']`` (the first draw is the start-up check's)."""

    def __init__(self, mode, seed=0, split="train", **options):
        self.env = envs.make("synthetic-nav", seed=seed, split=split, **options)
        self.mode, self.split_name = mode, split

    def reset(self):
        if self.split_name == "test" and self.mode == "no_test":
            raise ValueError("split: this game drew no 'test' instance in 1000 draws")
        if self.split_name == "test" and self.mode == "flaky":
            BROKEN["test_resets"] += 1
            if BROKEN["on"] and BROKEN["test_resets"] > 1:
                raise RuntimeError("the evaluation's environment broke")
        return self.env.reset()

    def __getattr__(self, name):
        return getattr(self.env, name)


for _name, _mode in (("test-no-heldout", "no_test"), ("test-flaky-eval", "flaky")):
    if _name not in envs.list_envs():
        envs.register(_name, lambda _mode=_mode, **o: _Wrapped(_mode, **o))


def _nothing_written(path):
    return not path.exists() or not any(path.iterdir())


def test_a_run_without_a_held_out_split_is_refused_before_the_first_step(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*TINY, "--env", "test-no-heldout", "--eval-every", "1", "--run-dir", str(out)]
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert "--eval-split test" in err and "--eval-split train" in err
    assert _nothing_written(out)
    # the way out works: the training split for evaluation
    assert run.main([*argv, "--eval-split", "train", "--steps", "1", "--eval-episodes", "2"]) == 0
    assert "eval_train_success_rate" in read_metrics(out)[-1]


def test_sft_and_evaluate_refuse_the_same_environment_naming_their_flags(tmp_path, capsys):
    out = tmp_path / "sft"
    argv = ["--env", "test-no-heldout", "--layers", "1", "--width", "32", "--heads", "2",
            "--kv-heads", "1", "--max-len", "32", "--run-dir", str(out)]  # fmt: skip
    assert sft.main(argv) == 2
    assert "--eval-split train" in capsys.readouterr().err
    assert _nothing_written(out)
    model = tmp_path / "model"
    assert evaluate.main(["--run-dir", str(model), "--env", "test-no-heldout"]) == 2  # no run
    capsys.readouterr()
    assert run.main([*TINY, "--steps", "1", "--run-dir", str(model)]) == 0
    assert evaluate.main(["--run-dir", str(model), "--env", "test-no-heldout"]) == 2
    err = capsys.readouterr().err
    assert "--split test" in err and "--split train" in err


def test_an_evaluation_failing_after_training_loses_nothing_and_resume_ends(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*TINY, "--env", "test-flaky-eval", "--eval-every", "1", "--eval-episodes", "2",
            "--eval-k", "1", "--steps", "2", "--run-dir", str(out)]  # fmt: skip
    BROKEN.update(on=True, test_resets=0)
    try:
        assert run.main(argv) == 1
    finally:
        BROKEN["on"] = False
    err = capsys.readouterr().err.strip().splitlines()
    assert "evaluation after step 1 failed" in err[-1] and "--resume" in err[-1]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1]
    assert not any(k.startswith("eval_") for k in rows[0])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["1"]
    trace = (out / "errors" / "evaluation-step1.txt").read_text()
    assert "Traceback" in trace and "the evaluation's environment broke" in trace
    # resumed: the failed evaluation runs first, then the rest of the run
    assert run.main(["--resume", "--run-dir", str(out)]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("eval_heldout_success_rate" in r for r in rows)
    assert all("policy_loss" in r for r in rows)  # each line holds its step's own figures too


def test_metrics_log_amend_keeps_one_line_per_step_and_survives_resume(tmp_path):
    log = MetricsLog(tmp_path, start_step=0, progress=False, total=3)
    log.write({"step": 1, "loss": 1.0})
    log.amend({"eval_heldout_success_rate": 0.5})
    log.write({"step": 2, "loss": 0.5})
    log.close()
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 1.0, "eval_heldout_success_rate": 0.5},
        {"step": 2, "loss": 0.5},
    ]
    resumed = MetricsLog(tmp_path, start_step=2, progress=False, total=3)
    assert resumed.last() == {"step": 2, "loss": 0.5}
    resumed.amend({"eval_heldout_success_rate": 0.75})
    resumed.close()
    assert [len(r) for r in read_metrics(tmp_path)] == [3, 3]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="amend"):
        MetricsLog(tmp_path / "empty", start_step=0, progress=False, total=1).amend({})


# -- evaluation: progress, and outputs that never overwrite ----------------------------------------


def _args(**kw):
    base = dict(out=None, run_dir=None, model_path="models/m", split="train")
    return argparse.Namespace(**{**base, **kw})


def test_evaluation_folders_name_the_game_and_never_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    hanoi = TrainConfig(env="textarena", env_set={"game": "TowerOfHanoi-v0"})
    mines = TrainConfig(env="textarena", env_set={"game": "Minesweeper-v0"})
    a = evaluate.output_folder(_args(), hanoi, 0)
    b = evaluate.output_folder(_args(), mines, 0)
    assert a.name == "m-textarena-TowerOfHanoi-v0-train" and a != b
    a.mkdir(parents=True)
    (a / "metrics.json").write_text("{}")
    again = evaluate.output_folder(_args(), hanoi, 0)
    assert again.name == "m-textarena-TowerOfHanoi-v0-train-2"
    assert "writing to" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--out: .* already holds an evaluation"):
        evaluate.output_folder(_args(out=str(a)), hanoi, 0)
    named = evaluate.output_folder(_args(model_path=None, run_dir="runs/x"), hanoi, 7)
    assert named.as_posix() == "runs/x/evaluations/step7-textarena-TowerOfHanoi-v0-train"


def test_evaluation_shows_episodes_done_and_success_so_far(capsys):
    from train.core.build import initial_actor, model_config, run_codec

    cfg = TrainConfig(layers=1, width=32, heads=2, kv_heads=1, max_len=32)
    probe = envs.make(cfg.env, seed=0)
    codec = run_codec(cfg, probe)
    model = initial_actor(cfg, model_config(cfg, codec))
    common = dict(env=cfg.env, options={"split": "test"}, codec=codec, seed=0, episodes=3, k=2,
                  max_len=32, max_new_tokens=8, temperature=1.0, key=0)  # fmt: skip
    sampler = Sampler(model, capacity=32)
    quiet, _ = evaluate_set("heldout", sampler=sampler, **common)
    assert capsys.readouterr().err == ""
    shown, _ = evaluate_set("heldout", sampler=sampler, progress=True, **common)
    err = capsys.readouterr().err
    assert "eval heldout" in err and "6/6" in err and "success=" in err
    assert shown == quiet  # the bar changes nothing that is measured


# -- messages -------------------------------------------------------------------------------------


def test_a_missing_smollm2_folder_names_make_smollm2(tmp_path):
    with pytest.raises(ValueError, match="does not exist; `make smollm2` converts"):
        model_source(TrainConfig(model_path=str(tmp_path / "smollm2-135m-instruct")))
    with pytest.raises(ValueError, match="does not exist$"):
        model_source(TrainConfig(model_path=str(tmp_path / "other")))
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="has no config.json$"):
        model_source(TrainConfig(model_path=str(tmp_path / "other")))


def test_a_misspelt_textarena_game_lists_the_closest_single_player_ids():
    with pytest.raises(ValueError, match="closest single-player ids: .*GuessTheNumber-v0"):
        envs.make("textarena", game="GuessTheNumbr-v0")
    with pytest.raises(ValueError) as refused:
        envs.make("textarena", game="FrozenLak-v0")
    offered = str(refused.value).split("ids: ")[1].split(", ")
    assert "FrozenLake-v0" in offered
    for gid in offered:  # every id offered runs here
        envs.make("textarena", game=gid)


def test_the_readme_output_folders_are_ignored():
    from pathlib import Path

    ignored = Path(__file__).parents[1].joinpath(".gitignore").read_text().split()
    for folder in ("evaluations/", "exported/", "runs/", "models/"):
        assert folder in ignored, folder
    json.dumps(ignored)
