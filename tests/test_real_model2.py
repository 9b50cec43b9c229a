"""Round 2 of the real-model study (train/study/real_model2.py) with its runs faked: the order
(warm start, its measurement, then the RL cells seed-major and paired), resuming without
rerunning what finished, and the report's paired MPO - GRPO difference and reference lines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from train.study import real_model2
from train.study.real_model import best_run
from train.study.real_model2 import GAMES, Cell, cells, paired_difference

FINAL = {"mpo": [0.9, 0.8, 0.85, 0.95], "grpo": [0.6, 0.7, 0.65, 0.6], "turn_ppo": [0.7, 0.7],
         "mpo_trace": [0.8, 0.9]}  # fmt: skip
RATE = {"3e-5": 1.0, "1e-4": 0.5}  # the fake runs' ends scale with the rate


def test_cells_run_seed_major_with_mpo_and_grpo_paired_first():
    order = cells(("guess-the-number",))
    assert order[:4] == [Cell("guess-the-number", p, s) for s in (0,) for p in
                         ("mpo", "grpo", "turn_ppo", "mpo_trace")]  # fmt: skip
    assert [c.preset for c in order if c.seed == 3] == ["mpo", "grpo"]
    assert len(order) == sum(GAMES["guess-the-number"]["presets"].values())


def test_the_paired_difference_is_over_the_seeds_both_finished():
    a = {"0": {"x": 0.9}, "1": {"x": 0.8}, "2": {"x": 0.7}}
    b = {"0": {"x": 0.5}, "1": {"x": 0.6}}
    d = paired_difference(a, b, "x")
    assert d["n"] == 2 and np.allclose(d["each"], [0.4, 0.2])
    assert d["low"] <= d["mean"] == np.mean([0.4, 0.2]) <= d["high"]
    assert paired_difference(a, {}, "x") is None


def test_a_mean_curve_is_over_the_steps_every_seed_reached():
    curves = [[[5, 10, 15], [0.2, 0.4, 0.6]], [[5, 10], [0.4, 0.6]]]
    assert real_model2.mean_curve(curves) == ([5, 10], [pytest.approx(0.3), pytest.approx(0.5)])
    assert real_model2.mean_curve([curves[0], None]) is None  # a seed without the metric
    assert real_model2.mean_curve([[[5], [0.1]], [[10], [0.2]]]) is None  # no common step


def test_both_panels_of_a_games_curves_share_the_training_steps(tmp_path, monkeypatch):
    """Success is measured from step 0 (the warm start) and the strategy metric from the first
    evaluation: the panels still show the same steps, so a point lines up with its neighbour."""
    figures = []
    monkeypatch.setattr("train.study.figures.save", lambda fig, path: figures.append(fig))
    seed = {"heldout_curve": [[0, 5, 10], [0.5, 0.6, 0.7]],
            "heldout_metric_curve": [[5, 10], [0.4, 0.5]]}  # fmt: skip
    warm = {"success": 0.5, "hint_consistency": 0.45}
    results = {"guess-the-number": {"warm_start": warm, "presets": {"mpo": {"seeds": {"0": seed}}}}}
    real_model2.plot(results, {}, tmp_path)
    success, strategy = figures[0].axes[:2]
    assert success.get_xlim() == strategy.get_xlim() and success.get_xlim()[0] < 0.5


def test_a_warm_start_that_never_wins_reports_its_path_ratio_as_not_measured(tmp_path):
    """FrozenLake's path_ratio is over won episodes: a warm start with no win has none (n/a, not
    nan), and its line still gives the shares of moves into holes and off the grid."""
    for seed in real_model2.WARM_SEEDS:
        path = real_model2._warm_eval(tmp_path, "frozen-lake", seed)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"eval_heldout_success_rate": 0.0,
                                    "eval_heldout_env_format_error_rate": 0.0,
                                    "eval_heldout_env_hole_moves": 0.2 + 0.1 * (seed % 2),
                                    "eval_heldout_env_wall_moves": 0.05}))  # fmt: skip
    warm = real_model2.warm_point(tmp_path, "frozen-lake")
    assert warm["path_ratio"] is None and warm["hole_moves"] == pytest.approx(0.25)
    text = real_model2._metric_text(warm, "frozen-lake")
    assert text == "path_ratio n/a; hole_moves 0.25; wall_moves 0.05"
    assert real_model2._metric_text(warm, "frozen-lake", only=True) == "n/a"


def _fake_runs(monkeypatch, calls):
    """A fake `launch`: a run's held-out success at step s is its end * s / 20 (evaluations every
    5 steps up to ``--steps``); a killed or extended run resumes with ``resume_flags``."""

    def launch(module, args, run_dir, record, cache=None, loggers=None, resume_flags=None):
        calls.append((module, Path(run_dir)))
        run_dir = Path(run_dir)
        if (run_dir / "study.json").exists():
            return {"skipped": True}
        run_dir.mkdir(parents=True, exist_ok=True)
        if module == "train.run":
            flags = resume_flags if (run_dir / "config.json").exists() else args
            steps = int(flags[flags.index("--steps") + 1])
            final = FINAL[record["preset"]][record["seed"]] * RATE[record["lr"]]
            rows = [{"step": s, "success_rate": 0.5, "env_format_error_rate": 0.0,
                     "env_hint_consistency": 0.8, "eval_heldout_success_rate": final * s / 20,
                     "eval_heldout_env_hint_consistency": 0.9,
                     "eval_heldout_env_format_error_rate": 0.01}
                    for s in range(5, steps + 1, 5)]  # fmt: skip
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            steps = 40
        config = {"eval_episodes": 25, "eval_k": 2, "steps": steps}
        (run_dir / "config.json").write_text(json.dumps(config))
        (run_dir / "study.json").write_text(json.dumps({"wall_s": 60.0}))
        return {"skipped": False, "wall_s": 60.0}

    def evaluate(origin, game, seed, out, root, what):  # as the real one: skipped when there
        if (out / "metrics.json").exists():
            return
        _write_evaluation(calls, out, success=0.54)

    monkeypatch.setattr(real_model2, "launch", launch)
    monkeypatch.setattr(real_model2, "_evaluate_held_out", evaluate)


def _write_evaluation(calls, out: Path, *, success: float) -> None:
    """A fake held-out evaluation into ``out``: ``success``, 2% format errors, 0.45 consistency."""
    calls.append(("train.evaluate", Path(out)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({
        "eval_heldout_success_rate": success, "eval_heldout_env_format_error_rate": 0.02,
        "eval_heldout_env_hint_consistency": 0.45}))  # fmt: skip


def _study(tmp_path, monkeypatch, calls, lines) -> tuple[list[str], Path]:
    """(argv, report folder) of a study on faked runs, a model folder and reference ``lines``."""
    _fake_runs(monkeypatch, calls)
    model, out = tmp_path / "model", tmp_path / "report"
    model.mkdir()
    out.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "reference_lines.json").write_text(json.dumps(lines))  # beside the report
    argv = ["--model-path", str(model), "--runs", str(tmp_path / "runs"), "--out", str(out),
            "--games", "guess-the-number"]  # fmt: skip
    return argv, out


def test_the_study_runs_in_order_resumes_and_reports(tmp_path, monkeypatch):
    calls = []
    lines = {"guess-the-number": {"random_distinct": {"success": 0.55, "low": 0.5, "high": 0.6,
                                                      "episodes": 400}}}  # fmt: skip
    argv, out = _study(tmp_path, monkeypatch, calls, lines)
    for preset in ("mpo", "grpo"):  # an earlier rate's finished pair: reported in its own table
        cell = Cell("guess-the-number", preset, 0, "1e-4")
        real_model2.launch("train.run", ["--steps", "20"], cell.run_dir(tmp_path / "runs"),
                           dataclasses.asdict(cell))  # fmt: skip
    calls.clear()
    assert real_model2.main(argv) == 0
    modules = [m for m, _ in calls]
    assert modules[0] == "train.sft" and modules[1:5] == ["train.evaluate"] * 4
    assert modules[5:] == ["train.run"] * 12
    results = json.loads((out / "results.json").read_text())
    entry = results["guess-the-number"]
    assert entry["warm_start"]["success"] == 0.54 and entry["warm_start"]["episodes"] == 200
    lift = entry["presets"]["mpo"]["lift_same_tasks"]  # over the warm start's 0.54, seed by seed
    assert lift["n"] == 4 and np.isclose(lift["mean"], np.mean(FINAL["mpo"]) - 0.54)
    diff = entry["mpo_minus_grpo"]["heldout_final"]
    assert diff["n"] == 4
    assert np.isclose(diff["mean"], np.mean(np.subtract(FINAL["mpo"], FINAL["grpo"])))
    text = (out / "results.md").read_text()
    assert "scripted `random_distinct` | 55 [50, 60]" in text
    assert "MPO - GRPO, paired by seed (4 seeds)" in text
    assert (out / "curves_guess-the-number.png").exists()
    # the strategy metric by step, from the held-out evaluations (0.9), not the rollouts (0.8)
    assert "| mpo | 0.90 | 0.90 | 0.90 | 0.90 |" in text
    earlier = entry["earlier"]["1e-4"]
    assert set(earlier["presets"]) == {"mpo", "grpo"}
    assert np.isclose(earlier["mpo_minus_grpo"]["heldout_final"]["mean"], (0.9 - 0.6) * 0.5)
    assert "At `--lr 1e-4`" in text and "| mpo @ 1e-4 | 0.90 | 0.90 | 0.90 | 0.90 |" in text
    assert "paired by seed (1 seed): held-out end +15 (one seed) points" in text  # no interval

    cell, best = best_run(results, real_model2.EXPORTED_GAME, Cell)
    ends = {(p, int(k)): f["heldout_final"] for p, e in entry["presets"].items()
            for k, f in e["seeds"].items()}  # fmt: skip
    assert best["heldout_final"] == max(ends.values()) == ends[(cell.preset, cell.seed)]
    assert best_run({}, real_model2.EXPORTED_GAME, Cell) is None
    exported = {"cell": {"game": cell.game, "preset": cell.preset, "seed": cell.seed},
                "run_last_eval": [0.6, 0.46, 0.72], "export_eval": [0.58, 0.48, 0.67],
                "export_episodes": 96, "logits_max_abs_diff": 2e-5, "agrees": True,
                "command": "python -m train.evaluate --model-path E"}  # fmt: skip
    (out / "export.json").write_text(json.dumps(exported))  # an export's record joins the report
    assert real_model2.main([*argv, "--report-only"]) == 0
    assert "## The best run, exported" in (out / "results.md").read_text()
    (out / "export.json").unlink()
    with pytest.raises(SystemExit, match="not on this machine"):  # recorded, not here: refused
        real_model2.main([*argv[:3], str(tmp_path / "elsewhere"), *argv[4:], "--export-best"])

    calls.clear()  # a second call reruns nothing: every step is skipped as done
    assert real_model2.main(argv) == 0
    assert [m for m, _ in calls if m == "train.evaluate"] == []
    assert json.loads((out / "results.json").read_text()) == results


def test_the_probe_is_the_first_steps_of_each_rates_mpo_seed0_and_the_study_extends_it(
    tmp_path, monkeypatch, capsys
):
    assert real_model2.with_flags(["--lr", "1e-4", "--steps", "20"], lr="3e-5", steps="10") == [
        "--lr", "3e-5", "--steps", "10"]  # fmt: skip
    calls = []
    argv, out = _study(tmp_path, monkeypatch, calls, {})
    assert real_model2.main([*argv, "--lr-probe"]) == 0
    probed = [d for m, d in calls if m == "train.run"]
    runs = tmp_path / "runs" / "guess-the-number"
    assert probed == [runs / f"lr{lr}" / "mpo" / "seed0" for lr in real_model2.LR_PROBE]
    results = json.loads((out / "results.json").read_text())["guess-the-number"]
    probe = results["lr_probe"]
    assert np.isclose(probe["1e-4"]["lift_same_tasks"], 0.9 * 0.5 / 2 - 0.54)  # seed 0's tasks
    assert "| 1e-4 | 5: 11, 10: 22 | -32 | 1% |" in (out / "results.md").read_text()
    assert results["presets"] == {} and "earlier" not in results  # a probe is not a study run
    capsys.readouterr()
    assert real_model2.main([*argv, "--lr-probe"]) == 0  # done: every rate is skipped
    assert capsys.readouterr().out.count("skipped (done)") == len(real_model2.LR_PROBE)

    calls.clear()  # the study: the chosen rate's probe run is resumed to the full budget
    assert real_model2.main(argv) == 0
    assert [d for m, d in calls if m == "train.run"][0] == runs / f"lr{real_model2.STUDY_LR}" / (
        "mpo/seed0")  # fmt: skip
    results = json.loads((out / "results.json").read_text())["guess-the-number"]
    mpo0 = results["presets"]["mpo"]["seeds"]["0"]
    assert mpo0["heldout_curve"][0] == [0, 5, 10, 15, 20] and np.isclose(mpo0["heldout_final"], 0.9)
    assert results["lr_probe"] == probe  # the probe still reads the first 10 steps


def test_the_study_runs_only_the_chosen_presets_and_seeds(tmp_path, monkeypatch):
    calls = []
    argv, out = _study(tmp_path, monkeypatch, calls, {})
    assert real_model2.main([*argv, "--presets", "mpo,grpo", "--seeds", "1"]) == 0
    runs = tmp_path / "runs" / "guess-the-number" / f"lr{real_model2.STUDY_LR}"
    assert [d for m, d in calls if m == "train.run"] == [runs / "mpo/seed1", runs / "grpo/seed1"]
    pair = json.loads((out / "results.json").read_text())["guess-the-number"]["mpo_minus_grpo"]
    assert pair["heldout_final"]["each"] == [pytest.approx(FINAL["mpo"][1] - FINAL["grpo"][1])]
    assert real_model2.main([*argv, "--presets", "mpo,grpo", "--seeds", "0"]) == 0
    text = (out / "results.md").read_text()  # two seeds: a range, not an interval
    assert "paired by seed (2 seeds): held-out end +20 (two seeds: +10 to +30) points" in text
    for bad, says in ((["--presets", "mpo,ppo"], r"--presets: unknown \['ppo'\]"),
                      (["--seeds", "0,-1"], "--seeds: '0,-1' must be")):  # fmt: skip
        with pytest.raises(SystemExit, match=says):
            real_model2.main([*argv, *bad])


def test_a_warm_start_keeps_only_each_layers_input_and_resumes_so(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(real_model2, "launch", lambda *a, **kw: seen.update(args=a[1], **kw))
    real_model2.make_warm_start("frozen-lake", tmp_path, "model")
    assert seen["resume_flags"] == ["--remat", "full"]
    assert seen["args"][seen["args"].index("--remat") + 1] == "full"


def test_a_recorded_warm_start_is_checked_on_one_seed_and_remeasured_where_it_differs(
    tmp_path, monkeypatch, capsys
):
    calls = []
    argv, out = _study(tmp_path, monkeypatch, calls, {})
    one_cell = [*argv, "--presets", "mpo", "--seeds", "0"]
    assert real_model2.main(one_cell) == 0  # nothing recorded: every seed measured
    assert [m for m, _ in calls].count("train.evaluate") == 4
    record = json.loads((out / "results.json").read_text())["guess-the-number"]["warm_start"]
    assert record["each_metric"] == {str(s): 0.45 for s in real_model2.WARM_SEEDS}

    def on_a_fresh_machine(runs: str) -> list[str]:
        calls.clear()
        assert real_model2.main([*one_cell[:3], str(tmp_path / runs), *one_cell[4:]]) == 0
        return [str(d.relative_to(tmp_path / runs)) for m, d in calls if m == "train.evaluate"]

    # the same warm start made again elsewhere: seed 0 is measured, equals the record, and the
    # record stands for the rest
    assert on_a_fresh_machine("runs2") == ["guess-the-number/warmstart-eval/seed0"]
    assert "matches its record on seed 0's tasks" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["guess-the-number"]["warm_start"] == (
        record
    )

    # one that differs (success 0.56 where the record says 0.54): said, and every seed measured
    def differs(origin, game, seed, out_dir, root, what):
        _write_evaluation(calls, out_dir, success=0.56)

    monkeypatch.setattr(real_model2, "_evaluate_held_out", differs)
    assert len(on_a_fresh_machine("runs3")) == 4
    err = capsys.readouterr().err
    assert "warning: the warm start of guess-the-number differs from its record on seed 0" in err
    assert "(0.56, 0.45) against (0.54, 0.45)" in err
    warm = json.loads((out / "results.json").read_text())["guess-the-number"]["warm_start"]
    assert warm["success"] == 0.56  # the new measurement replaces the record
