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
from train.core import trainer as trainer_module
from train.core.config import TrainConfig, parse_args
from train.core.metrics import pass_at_k, read_metrics

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
        "approx_kl",
        "ref_kl",
        "ratio_max",
        "clip_frac",
        "entropy",
        "rollout_s",
        "scoring_s",
        "update_s",
    ):
        assert np.isfinite(rows[-1][key]), key
    assert 0.0 <= rows[-1]["flat_group_frac"] <= 1.0
    if algorithms.get(preset).needs_critic:
        for key in ("value_loss", "explained_variance", "turn_variance_fraction"):
            assert np.isfinite(rows[-1][key]), key
    assert (tmp_path / "config.json").exists() and any((tmp_path / "tensorboard").iterdir())


def leaves(state):
    parts = {k: state[k] for k in ("actor", "critic") if k in state}
    return [np.asarray(x) for x in jax.tree.leaves(parts)]


def test_resumed_run_ends_where_an_uninterrupted_run_ends(tmp_path):
    whole = trainer_module.Trainer(parse_args(flags(tmp_path / "a", "--steps", "4")))
    assert run.main(flags(tmp_path / "a", "--steps", "4", "--checkpoint-every", "2")) == 0
    assert run.main(flags(tmp_path / "b", "--steps", "2", "--checkpoint-every", "2")) == 0
    assert (
        run.main(flags(tmp_path / "b", "--steps", "4", "--checkpoint-every", "2", "--resume")) == 0
    )
    from train.core.checkpoint import Checkpoints

    a = Checkpoints(tmp_path / "a" / "checkpoints").restore(whole.state)
    b = Checkpoints(tmp_path / "b" / "checkpoints").restore(whole.state)
    assert a["step"] == b["step"] == 4
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2, 3, 4]
    # A second start without --resume refuses to overwrite the run.
    assert run.main(flags(tmp_path / "b", "--steps", "4")) == 2


def test_a_nan_batch_is_skipped_without_touching_parameters(tmp_path):
    # one minibatch: the actor's only update sees the NaN
    trainer = trainer_module.Trainer(
        parse_args(flags(tmp_path, "--steps", "1", "--minibatches", "1"))
    )
    rollouts = trainer.rollout(0)
    batch, _ = trainer.score(rollouts)
    credit = algorithms.compute_advantages(trainer.algo, batch)
    adv = np.array(credit.advantages)
    adv[np.nonzero(batch.loss_mask)[0][0], np.nonzero(batch.loss_mask)[1][0]] = np.nan
    actor = lambda: [np.asarray(x) for x in jax.tree.leaves(trainer.state["actor"])]  # noqa: E731
    before = actor()
    metrics = trainer.update(batch, credit._replace(advantages=adv))
    assert metrics["skipped_updates"] == 1  # the actor's; the critic's targets are finite
    # the actor's update was skipped: every parameter is unchanged ...
    for x, y in zip(before, actor(), strict=True):
        np.testing.assert_array_equal(x, y)
    for x in leaves(trainer.state):  # ... and nothing became NaN
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
        rows[-1]["eval_heldout_success_rate"] = 0.5
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
                "success_rate,eval_heldout_success_rate,entropy",
            ]
        )
        == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "missing")])


@pytest.mark.parametrize(
    "warmup, per_step, expected",
    [
        (0, 1, [1, 1, 1]),
        (1, 1, [1, 1, 1]),
        (4, 1, [0.25, 0.5, 0.75, 1, 1]),
        # warmup counts training steps: two updates a step share the step's learning rate
        (2, 2, [0.5, 0.5, 1, 1, 1]),
        (3, 4, [1 / 3] * 4 + [2 / 3] * 4 + [1] * 2),
    ],
)
def test_warmup_moves_the_parameters_from_the_first_update(warmup, per_step, expected):
    import jax.numpy as jnp

    from train.core.learner import make_optimizer

    tx = make_optimizer(
        1.0, warmup_steps=warmup, updates_per_step=per_step, clip=1e9, weight_decay=0.0
    )
    state, steps = tx.init(jnp.zeros(1)), []
    for _ in expected:  # Adam's first moments of a constant gradient: the update is -lr
        update, state = tx.update(jnp.ones(1), state, jnp.zeros(1))
        steps.append(-float(update[0]))
    assert steps == pytest.approx(expected, rel=1e-4)


def test_the_entropy_bonus_reaches_the_actor_update(tmp_path):
    # --entropy-coef was once parsed and never passed on: the update ignored it.
    trainer = trainer_module.Trainer(
        parse_args(flags(tmp_path, "--steps", "1", "--entropy-coef", "0.25"))
    )
    assert trainer.fns.entropy_coef == 0.25
    rollouts = trainer.rollout(0)
    batch, _ = trainer.score(rollouts)
    credit = algorithms.compute_advantages(trainer.algo, batch)
    zero = credit._replace(advantages=np.zeros_like(np.asarray(credit.advantages)))
    before = leaves(trainer.state)[0]
    trainer.update(batch, zero)  # no advantage anywhere: only the entropy bonus moves the actor
    assert not np.array_equal(before, leaves(trainer.state)[0])


# -- trust: resume, refused starts, held-out evaluation, truncation, start-up checks, metrics --


def _run_subprocess(args, **kw):
    cmd = [sys.executable, "-m", "train.run", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


def test_sigkilled_run_resumes_with_its_own_config_from_only_run_dir(tmp_path):
    # A non-default run (preset and lr), SIGKILLed after a checkpoint, resumed with nothing but
    # --resume --run-dir, ends with the parameters of an uninterrupted run of the same config.
    run_flags = ["--preset", "grpo", "--lr", "3e-4", "--steps", "8", "--checkpoint-every", "2"]
    killed = tmp_path / "killed"
    proc = _run_subprocess(flags(killed, *run_flags))
    deadline = time.time() + 240
    while time.time() < deadline and not (killed / "checkpoints" / "2").is_dir():
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    config_before = (killed / "config.json").read_bytes()
    assert json.loads(config_before)["preset"] == "grpo"
    resumed = _run_subprocess(["--resume", "--run-dir", str(killed)])
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()
    assert (killed / "config.json").read_bytes() == config_before
    assert [r["step"] for r in read_metrics(killed)] == list(range(1, 9))

    whole = tmp_path / "whole"
    assert run.main(flags(whole, *run_flags)) == 0
    from train.core.checkpoint import Checkpoints

    like = trainer_module.Trainer(parse_args(flags(tmp_path / "x", *run_flags))).state
    a = Checkpoints(whole / "checkpoints").restore(like)
    b = Checkpoints(killed / "checkpoints").restore(like)
    assert a["step"] == b["step"] == 8
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def test_resume_refuses_a_flag_that_differs_from_the_run_and_allows_the_listed_ones(tmp_path):
    assert run.main(flags(tmp_path, "--preset", "grpo", "--steps", "1")) == 0
    before = (tmp_path / "config.json").read_bytes()
    for bad, field in ((["--preset", "mpo"], "--preset='mpo'"), (["--lr", "0.5"], "--lr=0.5")):
        with pytest.raises(SystemExit, match=rf"--resume: {field} \(the run has"):
            parse_args(["--resume", "--run-dir", str(tmp_path), *bad])
    with pytest.raises(SystemExit, match="--algo-set"):
        parse_args(["--resume", "--run-dir", str(tmp_path), "--algo-set", "beta=0.1"])
    cfg = parse_args(["--resume", "--run-dir", str(tmp_path), "--steps", "3", "--no-progress"])
    assert (cfg.preset, cfg.steps, cfg.resume) == ("grpo", 3, True)
    assert parse_args(["--resume", "--run-dir", str(tmp_path), "--remat", "full"]).remat == "full"
    assert (tmp_path / "config.json").read_bytes() == before  # parsing writes nothing
    with pytest.raises(SystemExit, match="no run to resume"):
        parse_args(["--resume", "--run-dir", str(tmp_path / "none")])
    # a resume that extends the run records the new length, and nothing else changes
    assert run.main(["--resume", "--run-dir", str(tmp_path), "--steps", "2"]) == 0
    after = json.loads((tmp_path / "config.json").read_text())
    assert after == {**json.loads(before), "steps": 2}


def test_a_refused_start_writes_nothing(tmp_path):
    assert run.main(flags(tmp_path, "--preset", "grpo", "--steps", "1")) == 0
    snapshot = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert run.main(flags(tmp_path, "--preset", "mpo", "--steps", "1")) == 2
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == snapshot
    # a run killed before its first checkpoint is a run too
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "config.json").write_text("{}")
    assert run.main(flags(tmp_path / "only", "--steps", "1")) == 2
    assert (tmp_path / "only" / "config.json").read_text() == "{}"


def test_config_json_records_the_resolved_algorithm_and_length(tmp_path):
    assert (
        run.main(flags(tmp_path, "--preset", "mpo", "--algo-set", "beta=0.25", "--steps", "1")) == 0
    )
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["algorithm"]["multiscale"]["beta"] == 0.25
    assert stored["algorithm"]["estimator"] == "multiscale"
    assert stored["max_len"] == 32  # as given by TINY
    assert parse_args(["--config", str(tmp_path / "config.json")]).max_len == 32


def test_evaluation_is_held_out_and_fresh_under_their_own_names(tmp_path):
    trainer = trainer_module.Trainer(
        parse_args(flags(tmp_path, "--eval-episodes", "4", "--eval-k", "2"))
    )
    out = trainer.evaluate(1)
    assert set(out) == {
        f"eval_{name}_{what}"
        for name in ("heldout", "fresh")
        for what in ("success_rate", "pass@1", "pass@2", "env_tool_calls")
    }
    from train.core.episodes import EVAL_TASK_OFFSET, make_episodes

    def episodes(options, offset=0):
        return make_episodes(
            "synthetic-nav", seed=0, step=0, prompts=4, group=2, options=options, offset=offset
        )[0]

    held = episodes(trainer.eval_options, EVAL_TASK_OFFSET)
    assert {e.split for e in held} == {"test"}
    train_envs = episodes(trainer.env_options)
    assert {e.split for e in train_envs} == {"train"}


def test_truncated_rows_are_bootstrapped_with_the_critic_and_finished_rows_are_not(tmp_path):
    # a length budget shorter than the longest episode: some rows are cut (outcome unknown)
    cut_flags = ("--prompts-per-step", "32", "--max-len", "20")
    trainer = trainer_module.Trainer(parse_args(flags(tmp_path, *cut_flags)))
    # the value head starts at zero: move it so that the critic says something
    trainer.state["critic"] = jax.tree.map(lambda x: x + 0.05, trainer.state["critic"])
    rollouts = trainer.rollout(0)
    batch, _ = trainer.score(rollouts)
    assert batch.truncated.any() and (~batch.truncated).any()
    cut = np.array([e["length_cut"] for e in rollouts.episodes])
    np.testing.assert_array_equal(batch.truncated, cut)  # the turn budget's endings are final
    np.testing.assert_array_equal(batch.bootstrap_values[~batch.truncated], 0)
    # the bootstrap is the critic's value of the whole conversation (after its last token)
    from flax import nnx

    critic = nnx.merge(trainer.models.critic, trainer.state["critic"])
    for i in np.nonzero(batch.truncated)[0]:
        n = np.nonzero(batch.loss_mask[i])[0][-1] + 1  # up to the last action token
        expected = float(critic(batch.tokens[i : i + 1, :n])[0, n - 1])
        assert batch.bootstrap_values[i] == pytest.approx(expected, abs=1e-5)
    # and it reaches the credit: the same batch without bootstrap gives other advantages
    with_boot = trainer._credit(trainer.algo, batch).advantages
    no_boot = trainer._credit(trainer.algo, dataclasses.replace(batch, bootstrap_values=None))
    rows = batch.truncated
    assert not np.allclose(np.asarray(with_boot)[rows], np.asarray(no_boot.advantages)[rows])
    np.testing.assert_allclose(
        np.asarray(with_boot)[~rows], np.asarray(no_boot.advantages)[~rows], atol=1e-6
    )


def test_sizes_that_do_not_fit_the_mesh_are_refused_at_start_naming_the_flags():
    from train.core.config import check_mesh_fit

    cfg = TrainConfig(prompts_per_step=6, group_size=1, minibatches=2)  # micro-batches of 3 rows
    with pytest.raises(ValueError, match=r"3 rows .* 2 data-parallel devices .* --minibatches"):
        check_mesh_fit(cfg, 2)
    with pytest.raises(ValueError, match=r"3 rows .* --mesh"):
        TrainConfig(prompts_per_step=6, group_size=1, minibatches=2, mesh="2,1,1")
    with pytest.raises(ValueError, match="prompts_per_step: 6 tasks do not split over 4"):
        check_mesh_fit(TrainConfig(prompts_per_step=6, group_size=2, minibatches=1), 1, 4)
    with pytest.raises(ValueError, match="mesh: expected 'data,fsdp,tensor'"):
        TrainConfig(mesh="2,x,1")
    with pytest.raises(ValueError, match="eval_split: must be"):
        TrainConfig(eval_split="dev")


def test_the_length_budget_follows_the_environment_and_a_short_one_is_said(tmp_path, capsys):
    long_env = ["--env", "synthetic-nav-long"]
    base = flags(tmp_path / "a")
    i = base.index("--max-len")
    base = base[:i] + base[i + 2 :]  # the default: 0, from the environment
    trainer = trainer_module.Trainer(parse_args([*base, *long_env]))
    assert trainer.cfg.max_len == 79  # 5 + 8 turns x 4 words + 7 observations x 6 words
    assert "warning" not in capsys.readouterr().err
    short = trainer_module.Trainer(
        parse_args([*base, *long_env, "--max-len", "48", "--prompts-per-step", "8"])
    )
    err = capsys.readouterr().err
    assert "--max-len 48 cannot hold the longest episode of synthetic-nav-long (79 tokens)" in err
    metrics = trainer_module.rollout_metrics(short.rollout(0))
    assert metrics["length_cut_frac"] > 0
    assert metrics["truncated_frac"] == pytest.approx(
        metrics["length_cut_frac"] + metrics["turn_limit_frac"]
    )


def test_every_flag_has_a_help_string():
    from train.core.config import HELP, _parser

    text = _parser().format_help()
    for f in dataclasses.fields(TrainConfig):
        assert HELP.get(f.name), f.name
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
    for action in _parser()._actions:
        assert action.help, action.option_strings


def test_update_metrics_are_token_weighted_and_ratio_max_is_the_maximum():
    # two updates: 10 tokens with 1 clipped, 30 tokens with 9 clipped -> 10 / 40, not mean(0.1, 0.3)
    totals = {
        "updates": 2.0,
        "tokens": 40.0,
        "turns": 4.0,
        "clip_tokens": 10.0,
        "clip_turns": 1.0,
        "dual_clip_tokens": 2.0,
        "approx_kl_sum": 4.0,
        "entropy_sum": 80.0,
        "ratio_max": 3.5,
        "skipped_updates": 1.0,
        "policy_loss": 1.0,
    }
    out = trainer_module._summarise_updates(dict(totals))
    assert out["clip_frac"] == 0.25 and out["turn_clip_frac"] == 0.25
    assert out["dual_clip_frac"] == 0.05
    assert out["approx_kl"] == 0.1 and out["entropy"] == 2.0 and out["ratio_max"] == 3.5
    assert out["policy_loss"] == 0.5 and out["skipped_updates"] == 1


def test_a_step_logs_the_true_ratio_max_over_its_updates(tmp_path, monkeypatch):
    trainer = trainer_module.Trainer(parse_args(flags(tmp_path, "--minibatches", "2")))
    seen = []
    original = trainer._minibatch

    def spy(mb):
        out = original(mb)
        seen.append(out["ratio_max"])
        return out

    monkeypatch.setattr(trainer, "_minibatch", spy)
    metrics = trainer.step(0)
    assert len(seen) == 2 and metrics["ratio_max"] == max(seen)


def test_rollout_metrics_report_the_environments_own_figures():
    from envs.rollout import Rollouts

    episodes = [
        {"success": True, "reward": 1.0, "turns": 2, "tokens": 9, "truncated": False, "em": 1.0},
        {"success": False, "reward": 0.0, "turns": 3, "tokens": 9, "truncated": True, "em": 0.0,
         "f1": 0.5, "db_match": True},
        {"success": False, "reward": 0.0, "turns": 3, "tokens": 9, "truncated": True,
         "length_cut": True},
    ]  # fmt: skip
    batch = type("B", (), {"loss_mask": np.ones((3, 4), bool)})()
    out = trainer_module.rollout_metrics(Rollouts(batch, None, [], episodes, 0.0))
    assert out["env_em"] == 0.5 and out["env_f1"] == 0.5 and out["env_db_match"] == 1.0
    assert out["truncated_frac"] == pytest.approx(2 / 3)
    assert out["length_cut_frac"] == pytest.approx(1 / 3)


def test_evaluation_samples_from_a_stream_no_training_step_or_other_process_uses():
    def data(key):
        return tuple(np.asarray(jax.random.key_data(key)).tolist())

    train_keys = {
        data(trainer_module.sampling_key(s, trainer_module.TRAIN_STREAM, step, p))
        for s in (0, 126)
        for step in range(300)
        for p in range(3)
    }
    eval_keys = {
        data(trainer_module.sampling_key(s, trainer_module.EVAL_STREAM, step, p))
        for s in (0, 126)
        for step in range(0, 600, 100)
        for p in range(3)
    }
    assert len(train_keys) == 2 * 300 * 3 and len(eval_keys) == 2 * 6 * 3
    assert not train_keys & eval_keys


def test_validate_batches_checks_every_scored_batch(tmp_path, monkeypatch):
    trainer = trainer_module.Trainer(parse_args(flags(tmp_path, "--validate-batches")))
    seen = []
    monkeypatch.setattr(
        trainer_module, "validate", lambda batch, **kw: seen.append(kw["vocab_size"])
    )
    trainer.step(0)
    assert seen == [trainer.codec.vocab_size]
    # and a real scored batch passes the real check (every field, sampler_logp included)
    from mpo_jax.batch import validate

    batch, _ = trainer.score(trainer.rollout(1))
    assert batch.sampler_logp is not None and batch.old_logp is not None
    validate(batch, vocab_size=trainer.codec.vocab_size)
