"""The trainer end to end on the tiny model: every preset, resume, NaN-guarded updates."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from mpo_jax import algorithms
from train import run
from train.config import TrainConfig, parse_args
from train.metrics import pass_at_k, read_metrics

TINY = [
    "--layers",
    "1",
    "--width",
    "32",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--prompts-per-step",
    "4",
    "--group-size",
    "2",
    "--max-len",
    "32",
    "--eval-every",
    "0",
    "--no-progress",
    "--minibatches",
    "2",
]


def flags(tmp_path, *extra):
    return [*TINY, "--run-dir", str(tmp_path), *extra]


@pytest.mark.parametrize("preset", sorted(algorithms.PRESETS))
def test_every_preset_completes_two_steps(preset, tmp_path):
    assert run.main(flags(tmp_path, "--preset", preset, "--steps", "2")) == 0
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for key in (
        "success_rate",
        "reward_mean",
        "turns_mean",
        "tokens",
        "policy_loss",
        "kl",
        "clip_frac",
        "entropy",
        "rollout_s",
        "scoring_s",
        "update_s",
    ):
        assert np.isfinite(rows[-1][key]), key
    if algorithms.get(preset).needs_critic:
        for key in ("value_loss", "explained_variance", "turn_variance_fraction"):
            assert np.isfinite(rows[-1][key]), key
    assert (tmp_path / "config.json").exists() and any((tmp_path / "tensorboard").iterdir())


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves({k: state[k] for k in ("actor", "critic")})]


def test_resumed_run_ends_where_an_uninterrupted_run_ends(tmp_path):
    whole = run.Trainer(parse_args(flags(tmp_path / "a", "--steps", "4")))
    assert run.main(flags(tmp_path / "a", "--steps", "4", "--checkpoint-every", "2")) == 0
    assert run.main(flags(tmp_path / "b", "--steps", "2", "--checkpoint-every", "2")) == 0
    assert (
        run.main(flags(tmp_path / "b", "--steps", "4", "--checkpoint-every", "2", "--resume")) == 0
    )
    from train.checkpoint import Checkpoints

    a = Checkpoints(tmp_path / "a" / "checkpoints").restore(whole.state)
    b = Checkpoints(tmp_path / "b" / "checkpoints").restore(whole.state)
    assert a["step"] == b["step"] == 4
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2, 3, 4]
    # A second start without --resume refuses to overwrite the run.
    assert run.main(flags(tmp_path / "b", "--steps", "4")) == 2


def test_a_nan_batch_is_skipped_without_touching_parameters(tmp_path):
    trainer = run.Trainer(parse_args(flags(tmp_path, "--steps", "1")))
    rollouts = trainer.rollout(0)
    batch = trainer.score(rollouts)
    credit = algorithms.compute_advantages(trainer.algo, batch)
    adv = np.array(credit.advantages)
    adv[np.nonzero(batch.loss_mask)[0][0], np.nonzero(batch.loss_mask)[1][0]] = np.nan
    before = leaves(trainer.state)
    metrics = trainer.update(batch, credit._replace(advantages=adv))
    assert metrics["skipped_updates"] >= 1
    after = leaves(trainer.state)
    # the actor's minibatch holding the NaN was skipped: some parameters are unchanged ...
    assert any(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    for x in after:  # ... and nothing became NaN
        assert np.all(np.isfinite(x))


@pytest.mark.slow
def test_sigkill_at_any_moment_then_resume_loses_nothing(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "train.run",
        *flags(tmp_path, "--steps", "6", "--checkpoint-every", "1"),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(read_metrics(tmp_path)) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert subprocess.run([*cmd, "--resume"], env=env, capture_output=True).returncode == 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_config_flags_files_and_errors(tmp_path):
    cfg = parse_args(
        [
            "--preset",
            "grpo",
            "--algo-set",
            "clip_high=0.28",
            "--env-set",
            "max_turns=6",
            "--lr",
            "3e-4",
            "--no-progress",
        ]
    )
    assert (cfg.preset, cfg.lr, cfg.progress) == ("grpo", 3e-4, False)
    assert cfg.algo_set == {"clip_high": 0.28} and cfg.env_set == {"max_turns": 6}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    again = parse_args(["--config", str(path), "--steps", "7"])
    assert again.algo_set == {"clip_high": 0.28} and again.steps == 7
    with pytest.raises(ValueError, match="not divisible"):
        TrainConfig(prompts_per_step=3, group_size=1, minibatches=2)
    with pytest.raises(SystemExit):
        parse_args(["--algo-set", "beta"])


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_plot_writes_a_png(tmp_path):
    from train import plot

    for name, shift in (("a", 0.0), ("b", 0.1)):
        d = tmp_path / name
        d.mkdir()
        rows = [
            {"step": s, "success_rate": 0.1 + shift + s / 100, "entropy": 1.0 / s}
            for s in range(1, 30)
        ]
        rows[-1]["eval_success_rate"] = 0.5
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "c.png"
    assert (
        plot.main(
            [
                str(tmp_path / "a"),
                str(tmp_path / "b"),
                "--out",
                str(out),
                "--metrics",
                "success_rate,eval_success_rate,entropy",
            ]
        )
        == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "missing")])


@pytest.mark.parametrize(
    "warmup, expected", [(0, [1, 1, 1]), (1, [1, 1, 1]), (4, [0.25, 0.5, 0.75, 1, 1])]
)
def test_warmup_moves_the_parameters_from_the_first_update(warmup, expected):
    import jax.numpy as jnp

    from train.learner import make_optimizer

    tx = make_optimizer(1.0, warmup=warmup, clip=1e9, weight_decay=0.0)
    state, steps = tx.init(jnp.zeros(1)), []
    for _ in expected:  # Adam's first moments of a constant gradient: the update is -lr
        update, state = tx.update(jnp.ones(1), state, jnp.zeros(1))
        steps.append(-float(update[0]))
    assert steps == pytest.approx(expected, rel=1e-4)


def test_the_entropy_bonus_reaches_the_actor_update(tmp_path):
    # --entropy-coef was once parsed and never passed on: the update ignored it.
    trainer = run.Trainer(parse_args(flags(tmp_path, "--steps", "1", "--entropy-coef", "0.25")))
    assert trainer.fns.entropy_coef == 0.25
    rollouts = trainer.rollout(0)
    batch = trainer.score(rollouts)
    credit = algorithms.compute_advantages(trainer.algo, batch)
    zero = credit._replace(advantages=np.zeros_like(np.asarray(credit.advantages)))
    before = leaves(trainer.state)[0]
    trainer.update(batch, zero)  # no advantage anywhere: only the entropy bonus moves the actor
    assert not np.array_equal(before, leaves(trainer.state)[0])
