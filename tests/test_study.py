"""The credit-assignment study: its arithmetic on made-up curves, and the runner at tiny size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from train.study import round1 as study
from train.study.stats import bootstrap_ci, mean_band, normalised_auc, steps_to_threshold


def test_normalised_auc_is_the_mean_height_of_the_curve():
    assert normalised_auc([0, 10], [0.0, 1.0]) == pytest.approx(0.5)  # a ramp
    assert normalised_auc([0, 1, 3], [0.2, 0.2, 0.2]) == pytest.approx(0.2)  # flat, uneven steps
    # a step up halfway through (trapezoid between 5 and 6)
    assert normalised_auc([0, 5, 6, 10], [0, 0, 1, 1]) == pytest.approx((0.5 + 4) / 10)
    assert normalised_auc([7], [0.3]) == 0.3
    with pytest.raises(ValueError, match="steps must increase"):
        normalised_auc([0, 0], [1, 1])
    with pytest.raises(ValueError, match="equal-length"):
        normalised_auc([0, 1], [1])


def test_steps_to_threshold_is_the_first_crossing():
    assert steps_to_threshold([20, 40, 60], [0.1, 0.5, 0.9], 0.5) == 40
    assert steps_to_threshold([20, 40, 60], [0.6, 0.1, 0.9], 0.5) == 20
    assert steps_to_threshold([20, 40], [0.1, 0.2], 0.5) is None


def test_bootstrap_ci_brackets_the_mean_and_shrinks_with_agreement():
    mean, low, high = bootstrap_ci([0.2, 0.4, 0.6])
    assert mean == pytest.approx(0.4) and 0.2 <= low < mean < high <= 0.6
    assert bootstrap_ci([0.5, 0.5, 0.5]) == pytest.approx((0.5, 0.5, 0.5))
    assert bootstrap_ci([0.7]) == (0.7, 0.7, 0.7)
    assert all(np.isnan(bootstrap_ci([None, float("nan")])))
    # coverage on a known distribution: the 95% interval of 30 normal samples holds the true mean
    # most of the time (percentile bootstrap: somewhat under 95% at small n)
    rng = np.random.default_rng(0)
    hits = 0
    for i in range(200):
        _, lo, hi = bootstrap_ci(rng.normal(1.0, 1.0, size=30), resamples=2000, seed=i)
        hits += lo <= 1.0 <= hi
    assert 0.85 <= hits / 200 <= 0.99, hits
    wide = bootstrap_ci([0.0, 1.0, 0.0, 1.0])
    narrow = bootstrap_ci([0.45, 0.55, 0.45, 0.55])
    assert wide[2] - wide[1] > narrow[2] - narrow[1]


def test_mean_band_per_step():
    mean, low, high = mean_band([[0.0, 1.0], [0.2, 1.0], [0.4, 1.0]])
    np.testing.assert_allclose(mean, [0.2, 1.0])
    assert low[0] < 0.2 < high[0] and low[1] == high[1] == 1.0
    with pytest.raises(ValueError, match=r"\[seeds, steps\]"):
        mean_band([0.1, 0.2])


def _fake_run(root, cell, curve, wall=10.0):
    d = cell.run_dir(root)
    d.mkdir(parents=True)
    rows = []
    for step, value in curve:
        rows.append({"step": step, "success_rate": value, "eval_heldout_success_rate": value,
                     "explained_variance": 0.5, "credit_corr": 0.3})  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "study.json").write_text(json.dumps({"wall_s": wall}))


def test_summarise_aggregates_seeds_and_skips_unfinished_runs(tmp_path):
    cells = study.grid(["synthetic-keydoor"], ["mpo", "grpo"], 3)
    for seed, top in enumerate((0.6, 0.8, 1.0)):
        _fake_run(tmp_path, study.Cell("synthetic-keydoor", "mpo", seed), [(10, 0.1), (20, top)])
    _fake_run(tmp_path, study.Cell("synthetic-keydoor", "grpo", 0), [(10, 0.1), (20, 0.2)])
    unfinished = study.Cell("synthetic-keydoor", "grpo", 1).run_dir(tmp_path)
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")  # no study.json
    results = study.summarise(tmp_path, cells)["synthetic-keydoor"]
    mpo = results["mpo"]["figures"]
    assert results["mpo"]["seeds"] == 3 and results["grpo"]["seeds"] == 1
    assert mpo["heldout_final"]["mean"] == pytest.approx(0.8)
    assert mpo["heldout_final"]["low"] < 0.8 < mpo["heldout_final"]["high"]
    assert mpo["heldout_auc"]["mean"] == pytest.approx(np.mean([0.35, 0.45, 0.55]))
    assert mpo["steps_to_threshold"] == {"reached": 3, "of": 3, "mean": 20.0}
    assert results["grpo"]["figures"]["steps_to_threshold"] == {"reached": 0, "of": 1}
    assert results["mpo"]["curves"]["heldout"]["steps"] == [10, 20]
    text = study.markdown(study.summarise(tmp_path, cells), "tiny", ["mpo", "grpo"])
    assert "| mpo | 80 [" in text and "| grpo | 20 |" in text


def test_the_study_runs_resumes_and_reports_at_tiny_size(tmp_path):
    args = ["--size", "tiny", "--envs", "synthetic-keydoor", "--variants", "mpo,grpo",
            "--seeds", "1", "--jobs", "2", "--runs", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert study.main(args) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    cells = data["results"]["synthetic-keydoor"]
    assert set(cells) == {"mpo", "grpo"}
    assert "heldout_final" in cells["mpo"]["figures"]
    assert (tmp_path / "out" / "curves_synthetic-keydoor.png").read_bytes()[:4] == b"\x89PNG"
    assert "## synthetic-keydoor" in (tmp_path / "out" / "results.md").read_text()
    # a second call skips the finished runs (their markers stay as they were)
    marker = tmp_path / "runs" / "synthetic-keydoor" / "mpo" / "seed0" / "study.json"
    before = marker.read_text()
    record = study.run_cell(study.Cell("synthetic-keydoor", "mpo", 0), tmp_path / "runs", "tiny")
    assert record["skipped"] and marker.read_text() == before
    with pytest.raises(SystemExit, match="unknown"):
        study.main([*args, "--variants", "nope"])
    # a report from fewer runs than the committed one (a fresh clone: no run directories) leaves
    # the committed report as it was; the same runs rewrite it
    report = (tmp_path / "out" / "results.md").read_text()
    (tmp_path / "empty").mkdir()
    fewer = [*args[:-4], "--runs", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="made from 2: it was left as it is"):
        study.main([*fewer, "--report-only"])
    assert (tmp_path / "out" / "results.md").read_text() == report
    assert study.main([*args, "--report-only"]) == 0


def test_child_runs_share_a_compilation_cache_unless_one_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    env = study.child_env(1, tmp_path / "cache")
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "cache")
    assert "intra_op_parallelism_threads=1" in env["XLA_FLAGS"]
    assert "JAX_COMPILATION_CACHE_DIR" not in study.child_env(0, None)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    assert study.child_env(0, tmp_path / "cache")["JAX_COMPILATION_CACHE_DIR"] == "/elsewhere"


def test_round2_ablations_are_paired_by_seed_with_a_verdict(tmp_path):
    from train.study import round2 as r2

    def fake(variant, seed, final, extra=None):
        cell = r2.Cell("synthetic-calls", "reuse", variant, seed)
        _fake_run(tmp_path, cell, [(5, 0.1), (10, final)])
        if extra:  # an update's movement figures on the last row
            path = cell.run_dir(tmp_path) / "metrics.jsonl"
            path.write_text(path.read_text() + json.dumps({"step": 11, **extra}) + "\n")

    # MPO beats the token ratio on every seed by 0.2 (seed-to-seed spread is large, the
    # difference is not); against beta 0 the differences straddle 0; one seed lacks its pair.
    for seed, base in enumerate((0.2, 0.5, 0.8)):
        fake("mpo", seed, base + 0.2, {"clip_frac": 0.1 * seed, "turn_log_ratio_abs_max": seed})
        fake("mpo_token_ratio", seed, base)
    for seed, final in enumerate((0.9, 0.2)):
        fake("mpo_beta0", seed, final)
    for seed, base in enumerate((0.2, 0.5, 0.8)):  # the mean turn ratio beats MPO by 0.1
        fake("mpo_turn_mean", seed, base + 0.3)
    variants = ["mpo", "mpo_token_ratio", "mpo_beta0", "mpo_turn_mean"]
    cells = r2.grid(["synthetic-calls"], ["reuse"], variants, 3)
    results = r2.summarise(tmp_path, cells)
    diffs = r2.ablations(results)["synthetic-calls/reuse"]
    token = diffs["turn ratio -> token ratio"]
    assert token["n"] == 3 and token["mean"] == pytest.approx(0.2)
    assert token["low"] == pytest.approx(0.2) and token["verdict"] == "reproduced"
    beta = diffs["beta -> 0"]
    assert beta["n"] == 2 and beta["pairs"] == pytest.approx([0.4 - 0.9, 0.7 - 0.2])
    assert beta["verdict"] == "within noise"
    # no claim of the paper's on the mean ratio: MPO ahead or behind, never "reversed"
    mean = diffs["turn ratio sum -> mean"]
    assert mean["mean"] == pytest.approx(-0.1) and mean["verdict"] == "MPO behind"
    figures = results["synthetic-calls/reuse"]["mpo"]["figures"]
    assert figures["clip_frac"]["mean"] == pytest.approx(0.1)
    assert figures["turn_log_ratio_abs_max"]["mean"] == pytest.approx(1.0)
    meta = {"command": "x", "rl_flags": [], "sft_flags": []}
    text = r2.markdown(results, r2.ablations(results), meta)
    assert (
        "| turn ratio -> token ratio (final) | 20 [20, 20] | +20, +20, +20 | reproduced |" in text
    )
    # a comparison the paper makes no claim on is shown only where both variants ran
    assert "turn ratio sum -> mean (final)" in text and "-> dual clip 3" not in text
    # the overview: final / AUC and seeds per variant; beta 0 ran two seeds
    assert "| variant | synthetic-calls, reuse |" in text
    assert "| mpo_beta0 | 55/" in text and "(2) |" in text


def test_round2_warm_starts_runs_each_regime_and_reports_at_tiny_size(tmp_path):
    from train.study import round2 as r2

    args = ["--size", "tiny", "--envs", "synthetic-calls", "--variants", "mpo",
            "--regimes", "reuse,stale2", "--seeds", "1", "--jobs", "2",
            "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]  # fmt: skip
    assert r2.main(args) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(data["results"]) == {"synthetic-calls/reuse", "synthetic-calls/stale2"}
    assert "held_out_loss" in data["meta"]["warm_starts"]["synthetic-calls"]
    reuse = data["results"]["synthetic-calls/reuse"]["mpo"]["figures"]
    assert {"heldout_final", "clip_frac", "turn_log_ratio_abs"} <= set(reuse)
    stale = data["results"]["synthetic-calls/stale2"]["mpo"]["figures"]
    assert "staleness_mean" in stale
    # every RL run started from the warm start, with the study's own learning rate
    run_dir = tmp_path / "runs" / "synthetic-calls" / "reuse" / "mpo" / "seed0"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["init_from"].endswith("warmstart") and config["lr"] == r2._RL["--lr"]
    assert config["epochs"] == 4 and config["minibatches"] == 4
    stale_dir = r2.Cell("synthetic-calls", "stale2", "mpo", 0).run_dir(tmp_path / "runs")
    stale = json.loads((stale_dir / "config.json").read_text())
    assert (stale["max_staleness"], stale["epochs"], stale["minibatches"]) == (2, 1, 2)
    assert (tmp_path / "out" / "curves_synthetic-calls_reuse.png").exists()
    with pytest.raises(SystemExit, match="unknown"):
        r2.main([*args, "--regimes", "nope"])
    (tmp_path / "empty").mkdir()
    fewer = [*args[:-4], "--runs", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="holds 0 finished runs"):
        r2.main([*fewer, "--report-only"])


def test_round2_variants_name_presets_and_fields_that_exist():
    from mpo_jax import algorithms
    from train.study import round2 as r2

    for variant, (preset, overrides) in r2.VARIANTS.items():
        # get() refuses a setting no family has; an override must change the preset
        algo = algorithms.get(preset, **overrides)
        assert (algo != algorithms.get(preset)) == bool(overrides), variant
    paired = [v for _, v in r2.ABLATION_PAIRS + r2.COMPARISON_PAIRS]
    assert set(paired) <= set(r2.VARIANTS)
    assert {v for _, panel in r2.PANELS for v in panel} == set(r2.VARIANTS)


def test_real_model_report_pools_the_start_and_summarises_seeds(tmp_path):
    from train.study import real_model

    p, lo, hi = real_model.wilson(2, 50)
    assert p == 0.04 and 0.005 < lo < 0.04 < hi < 0.14  # Wilson: asymmetric, inside [0, 1]
    assert real_model.wilson(0, 10)[1] == 0.0 and real_model.wilson(10, 10)[2] == 1.0
    with pytest.raises(ValueError, match="n"):
        real_model.wilson(0, 0)
    game = real_model.MAIN_GAME
    for seed, rate in zip(real_model.START_SEEDS, (0.04, 0.08, 0.0, 0.04), strict=True):
        out = real_model.start_dir(tmp_path, game) / f"seed{seed}"
        out.mkdir(parents=True)
        metrics = {"eval_heldout_success_rate": rate, "eval_heldout_env_format_error_rate": 0.8}
        (out / "metrics.json").write_text(json.dumps(metrics))
    finals = {0: 0.5, 1: 0.75, 2: 0.25}
    for seed, final in finals.items():
        run = real_model.Cell(game, "grpo", seed).run_dir(tmp_path)
        run.mkdir(parents=True)
        rows = [
            {"step": s, "success_rate": 0.1 * s, "env_format_error_rate": 1 / s, "rollout_s": 9}
            for s in range(1, 11)
        ]
        rows[4]["eval_heldout_success_rate"] = final / 2
        rows[9]["eval_heldout_success_rate"] = final
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "config.json").write_text(json.dumps({"eval_episodes": 16, "eval_k": 2}))
        (run / "study.json").write_text(json.dumps({"wall_s": 600.0}))
    unfinished = real_model.Cell(game, "mpo", 0).run_dir(tmp_path)  # no study.json: left out
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    results = real_model.summarise(tmp_path)
    entry = results[game]
    assert entry["start"]["success"] == pytest.approx(0.04) and entry["start"]["episodes"] == 200
    assert list(entry["presets"]) == ["grpo"]
    grpo = entry["presets"]["grpo"]
    assert grpo["heldout_final"]["mean"] == pytest.approx(0.5) and grpo["heldout_final"]["n"] == 3
    assert grpo["heldout_final"]["low"] <= 0.5 <= grpo["heldout_final"]["high"]
    seed0 = grpo["seeds"][0]
    assert seed0["heldout_curve"] == [[0, 5, 10], [pytest.approx(0.04), 0.25, 0.5]]
    # trapezoids over [0, 10] of (0.04, 0.25, 0.5): (0.145 * 5 + 0.375 * 5) / 10
    assert seed0["heldout_auc"] == pytest.approx(0.26)
    assert seed0["rollout_s"] == 9 and seed0["format_error_curve"][1][0] == 1.0
    text = real_model.markdown(results)
    assert "| grpo | 3 | 50 [" in text and "200 held-out episodes" in text
    assert "| +46 |" in text  # the lift: signed points over the start (4%)
    assert real_model._pct(0.005, 0.001, 0.028) == "0.5 [0, 3]"  # 1 of 200 is not 0
    assert real_model._pct(0.0) == "0" and real_model._points(-0.004) == "+0"
    # the best run is the highest end (seed 1 here); the export's check reads in the report
    cell, figures = real_model.best_run(results)
    assert cell == real_model.Cell(game, "grpo", 1) and figures["heldout_final"] == 0.75
    exported = {
        "cell": {"game": game, "preset": "grpo", "seed": 1},
        "run_last_eval": [0.75, 0.57, 0.87],
        "export_eval": [0.70, 0.60, 0.78],
        "export_episodes": 96,
        "logits_max_abs_diff": 1.5e-4,
        "agrees": True,
        "command": "python -m train.evaluate --model-path X",
    }
    text = real_model.markdown(results, exported)
    assert "## The best run, exported" in text and "70 [60, 78]" in text
    assert "Within its interval." in text and "python -m train.evaluate --model-path X" in text
    assert real_model.best_run({}) is None
    [png] = real_model.plot(results, tmp_path)
    assert png.name == f"curves_{game}.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_real_model_report_keeps_recorded_runs_and_the_study_skips_them(tmp_path, monkeypatch):
    """Run directories stay on the machine that ran them: a fresh clone's report keeps the
    committed results.json's runs (a finished run directory wins over its record), and the
    study neither reruns a recorded run nor re-evaluates a recorded start."""
    from train.study import real_model

    game = real_model.MAIN_GAME
    start = {"success": 0.02, "format_errors": 0.77, "episodes": 200, "wilson": [0.02, 0, 0.05]}

    def figures(end):
        rows = [{"step": 5, real_model.HELDOUT: end / 2, "env_format_error_rate": 0.5},
                {"step": 10, real_model.HELDOUT: end, "update_s": 9.0}]  # fmt: skip
        return rows, {**real_model.run_figures(rows, 0.02, 32), "wall_s": 60.0}

    recorded = {game: {"start": start, "presets": {"grpo": {"seeds": {
        "0": figures(0.5)[1], "1": figures(0.25)[1]}}}}}  # fmt: skip
    root = tmp_path / "runs"
    newer = real_model.Cell(game, "grpo", 1).run_dir(root)  # rerun here: it wins over its record
    newer.mkdir(parents=True)
    rows = figures(1.0)[0]
    (newer / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (newer / "config.json").write_text(json.dumps({"eval_episodes": 16, "eval_k": 2}))
    (newer / "study.json").write_text(json.dumps({"wall_s": 600.0}))
    results = real_model.summarise(root, recorded=json.loads(json.dumps(recorded)))
    grpo = results[game]["presets"]["grpo"]
    assert results[game]["start"] == start and sorted(grpo["seeds"]) == [0, 1]
    assert grpo["seeds"][0]["heldout_final"] == 0.5 and grpo["seeds"][1]["heldout_final"] == 1.0
    assert grpo["heldout_final"]["mean"] == pytest.approx(0.75)
    assert game not in real_model.summarise(root)  # no start here, none recorded: not reported
    with pytest.raises(SystemExit, match="not on this machine"):
        real_model.export_best(
            root, {game: {"presets": {"grpo": {"seeds": {0: grpo["seeds"][0]}}}}}, "m"
        )

    out, model = tmp_path / "report", tmp_path / "model"
    out.mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    (out / "results.json").write_text(json.dumps(recorded))
    ran, started = [], []
    monkeypatch.setattr(real_model, "evaluate_start", lambda g, *a: started.append(g))
    monkeypatch.setattr(
        real_model, "run_cell", lambda c, *a, **k: ran.append(c) or {"skipped": True}
    )
    monkeypatch.setattr(real_model, "plot", lambda *a: [])
    argv = ["--runs", str(tmp_path / "fresh"), "--out", str(out), "--model-path", str(model)]
    assert real_model.main(argv) == 0
    skipped = {real_model.Cell(game, "grpo", 0), real_model.Cell(game, "grpo", 1)}
    assert ran == [c for c in real_model.cells() if c not in skipped]
    assert game not in started and started  # the other game's start is still to measure
    kept = json.loads((out / "results.json").read_text())[game]["presets"]["grpo"]["seeds"]
    assert kept["0"]["heldout_final"] == 0.5 and kept["1"]["heldout_final"] == 0.25


def test_real_model_a_run_after_another_game_starts_from_its_source(tmp_path, monkeypatch):
    """A cell with ``after`` runs its source first (when its directory is not here), measures
    the source's last checkpoint on its own game as its start, starts from it (--init-from), and
    reports its lift from that start, not from the converted model's."""
    from train.study import real_model

    cell = next(c for c in real_model.cells() if c.after is not None)
    source = cell.source
    assert source == real_model.Cell(cell.after, cell.preset, cell.seed)
    assert cell.run_dir(tmp_path) != real_model.Cell(cell.game, cell.preset, cell.seed).run_dir(
        tmp_path
    )
    launched, evaluated = [], []

    def launch(module, args, run_dir, record, cache=None, loggers=None):
        launched.append((run_dir, args))
        return {"skipped": False, "wall_s": 1.0}

    def evaluate(args, root, what):
        evaluated.append(args)
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True)
        metrics = {"eval_heldout_success_rate": 0.2, "eval_heldout_env_format_error_rate": 0.1}
        (out / "metrics.json").write_text(json.dumps(metrics))

    monkeypatch.setattr(real_model, "launch", launch)
    monkeypatch.setattr(real_model, "_evaluate", evaluate)
    real_model.run_cell(cell, tmp_path, "model")
    assert [d for d, _ in launched] == [source.run_dir(tmp_path), cell.run_dir(tmp_path)]
    assert launched[0][1][:2] == ["--model-path", "model"]
    assert launched[1][1][:2] == ["--init-from", str(source.run_dir(tmp_path))]
    (args,) = evaluated
    assert args[args.index("--run-dir") + 1] == str(source.run_dir(tmp_path))
    assert args[args.index("--env") + 1] == cell.game
    own = real_model.transfer_start(cell, tmp_path)
    assert own["success"] == 0.2 and own["episodes"] == real_model.START_EPISODES * 2

    # the report: the converted model's start for the game, the row's own start for its lift
    for seed in real_model.START_SEEDS:
        out = real_model.start_dir(tmp_path, cell.game) / f"seed{seed}"
        out.mkdir(parents=True)
        metrics = {"eval_heldout_success_rate": 0.0, "eval_heldout_env_format_error_rate": 0.9}
        (out / "metrics.json").write_text(json.dumps(metrics))
    run = cell.run_dir(tmp_path)
    run.mkdir(parents=True)
    rows = [{"step": 5, real_model.HELDOUT: 0.4}, {"step": 10, real_model.HELDOUT: 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps({"eval_episodes": 16, "eval_k": 2}))
    (run / "study.json").write_text(json.dumps({"wall_s": 60.0}))
    entry = real_model.summarise(tmp_path)[cell.game]
    assert entry["start"]["success"] == 0.0
    row = entry["presets"][cell.name]["seeds"][cell.seed]
    assert row["heldout_curve"][1] == [0.2, 0.4, 0.5] and row["start"]["success"] == 0.2
    text = real_model.markdown({cell.game: entry})
    assert f"| {cell.name} | 1 | 50 | +30 |" in text  # lift 50 - 20, not 50 - 0
    assert "counted from there" in text
    # a later report on a fresh clone keeps the row and its start from results.json
    recorded = json.loads(json.dumps({cell.game: entry}))
    again = real_model.summarise(tmp_path / "fresh", recorded=recorded)[cell.game]
    assert again["presets"][cell.name]["seeds"][cell.seed]["start"]["success"] == 0.2
