"""A real model learns: SmolLM2-135M-Instruct on TextArena games, the study's runs and report.

    make smollm2                                     # the model, converted once
    python -m train.study.real_model                 # every run below (resumable)
    python -m train.study.real_model --report-only   # aggregate what is there

Steps, in this order (each skipped when done, resumed when killed):

1. the starting point on each game: ``python -m train.evaluate`` of the converted model on
   `START_EPISODES` held-out episodes (``<runs>/start-<game>``);
2. the main comparison: ``guess-the-number`` with ``grpo`` and ``mpo`` at seeds 0, 1, 2
   (seed-major, so a stopped study has both presets at the same seeds);
3. the extras at one seed: a second game (``frozen-lake``: TextArena's 4x4 board with 3 holes,
   held out by layout), the third preset (``ppo``), and a third game (``secretary``: TextArena's
   Secretary-v0, five values shown one at a time, ``[accept]`` or ``[continue]``, a win only for
   accepting the largest; held out by the drawn values), first from the converted model, then
   from the last checkpoint of the guess-the-number run of the same preset and seed (a cell with
   ``after``: its start is that checkpoint, measured on the game's held-out split first).

Secretary was added after frozen-lake's run won no training episode (so every advantage was 0):
a valid move there is one of two words, a policy that ignores the values wins a fifth of its
games, and the best one (accept a value that is the largest so far and above a threshold that
falls as fewer values remain: 0.82, 0.78, 0.69, 0.5) wins 64%. From the converted model it won
no training episode either; the run after guess-the-number asks whether a model that has learned
to answer in brackets on one game learns another.

Every run is ``python -m train.run`` with `RUN_FLAGS` (one budget, one learning rate for
every preset: 3e-5, chosen on a grpo probe at seed 0; the critic presets keep the pretrained
default critic rate). The report (``--out``, default ``benchmarks/real_model/``): ``results.md``
(per game and preset: held-out success at the end and its area under the curve, the start
prepended as step 0, means over seeds with 95% bootstrap intervals; each run's own end with a
Wilson interval over its episodes; format errors over training; seconds and tokens/s per
phase), ``results.json`` and ``curves_<game>.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from train.core.metrics import read_metrics
from train.study.round1 import (
    HELDOUT,
    LOGGERS_HELP,
    check_held_out,
    check_study_loggers,
    child_env,
    compile_cache,
    finished_record,
    launch,
)
from train.study.stats import bootstrap_ci, mean_band, normalised_auc

__all__ = ["RUN_FLAGS", "Cell", "cells", "wilson", "run_figures", "summarise", "main"]

MODEL = "models/smollm2-135m-instruct"
# the starting point: 200 held-out episodes, as 4 evaluations (seeds 0-3) of 25 tasks x 2 samples
# (one evaluation is one batch: 200 rows of 1,024 tokens would hold a 9 GB cache)
START_SEEDS, START_EPISODES, START_K = (0, 1, 2, 3), 25, 2
TURN = ["--max-len", "1024", "--max-new-tokens", "48"]
RUN_FLAGS = [
    *TURN,
    "--steps", "10", "--prompts-per-step", "4", "--group-size", "4",
    "--lr", "3e-5", "--warmup-steps", "2", "--micro-batch-tokens", "4096", "--minibatches", "1",
    "--eval-every", "5", "--eval-episodes", "16", "--eval-k", "2", "--checkpoint-every", "2",
]  # fmt: skip
MAIN_GAME, MAIN_PRESETS, SEEDS = "guess-the-number", ("grpo", "mpo"), (0, 1, 2)
EXTRAS = (
    ("frozen-lake", "grpo", 0),
    ("guess-the-number", "ppo", 0),
    ("secretary", "grpo", 0),
    ("secretary", "grpo", 0, MAIN_GAME),
)
PHASES = ("rollout", "scoring", "update")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run: ``preset`` at ``seed`` on ``game``, from the converted model or, with ``after``,
    from the last checkpoint of the run of the same preset and seed on the game ``after``."""

    game: str
    preset: str
    seed: int
    after: str | None = None

    @property
    def name(self) -> str:
        """The report's row: the preset, or ``<preset> after <game>``."""
        return self.preset if self.after is None else f"{self.preset} after {self.after}"

    @property
    def source(self) -> Cell | None:
        """The run this one starts from (None: the converted model)."""
        return None if self.after is None else Cell(self.after, self.preset, self.seed)

    def run_dir(self, root: Path) -> Path:
        leaf = self.preset if self.after is None else f"{self.preset}-after-{self.after}"
        return Path(root) / self.game / leaf / f"seed{self.seed}"

    def start_dir(self, root: Path) -> Path:
        """Where the start of a cell with ``after`` is measured (its source's last checkpoint on
        this game's held-out split)."""
        return start_dir(root, self.game) / f"{self.preset}-after-{self.after}-seed{self.seed}"


def cells() -> list[Cell]:
    """The study's runs in the order they run: the main comparison seed by seed, then extras."""
    main = [Cell(MAIN_GAME, p, s) for s in SEEDS for p in MAIN_PRESETS]
    return main + [Cell(*extra) for extra in EXTRAS]


def games() -> list[str]:
    return list(dict.fromkeys(c.game for c in cells()))


def start_dir(root: Path, game: str) -> Path:
    return Path(root) / f"start-{game}"


def evaluate_start(game: str, root: Path, model: str) -> None:
    """``train.evaluate`` of the untrained model on ``game``'s held-out split, one evaluation a
    seed of `START_SEEDS` into ``start-<game>/seed<k>``, each skipped when done."""
    for seed in START_SEEDS:
        out = start_dir(root, game) / f"seed{seed}"
        _evaluate_held_out(["--model-path", model], game, seed, out, root, f"start of {game}")


def _evaluate_held_out(
    origin: list[str], game: str, seed: int, out: Path, root: Path, what: str
) -> None:
    """``train.evaluate`` of ``origin`` (``--model-path DIR`` or ``--run-dir DIR``) on
    `START_EPISODES` x `START_K` held-out episodes of ``game`` into ``out``, skipped
    when ``out`` has its metrics already."""
    if (out / "metrics.json").exists():
        return
    args = [
        *origin, "--env", game, "--episodes", str(START_EPISODES), "--k", str(START_K), *TURN,
        "--seed", str(seed), "--out", str(out),
    ]  # fmt: skip
    _evaluate(args, root, what)


def _evaluate(args: list[str], root: Path, what: str) -> None:
    """``python -m train.evaluate ARGS`` in a child with the study's compile cache; raises
    ``RuntimeError`` naming ``what`` with the child's stderr when it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "train.evaluate", *args],
        env=child_env(0, compile_cache(root)),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: train.evaluate exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")  # fmt: skip


def start_point(root: Path, game: str) -> dict[str, Any] | None:
    """The pooled starting point of ``game`` (success, format errors, episodes, Wilson
    interval), or None until every seed's evaluation is there."""
    return _pooled([start_dir(root, game) / f"seed{s}" / "metrics.json" for s in START_SEEDS])


def _pooled(files: list[Path]) -> dict[str, Any] | None:
    """Held-out evaluations (``metrics.json`` files of `START_EPISODES` x
    `START_K` episodes each) pooled into one start, or None until every file is there."""
    if not all(f.exists() for f in files):
        return None
    measured = [json.loads(f.read_text()) for f in files]
    episodes = START_EPISODES * START_K * len(measured)
    success = float(np.mean([m["eval_heldout_success_rate"] for m in measured]))
    errors = [m.get("eval_heldout_env_format_error_rate", np.nan) for m in measured]
    return {
        "success": success,
        "format_errors": float(np.mean(errors)),
        "episodes": episodes,
        "wilson": wilson(round(success * episodes), episodes),
    }


def run_cell(cell: Cell, root: Path, model: str, *, loggers: str | None = None) -> dict:
    """``train.run`` of ``cell`` (skipped when done, resumed when killed). A cell with ``after``
    first needs its source's run directory: the source is run here when it is not (a source
    recorded in the report but run elsewhere is run again, and its new run directory then wins
    over its record), and its start is measured; then the run starts from it (``--init-from``)."""
    source = cell.source
    if source is None:
        origin = ["--model-path", model]
    else:
        run_cell(source, root, model, loggers=loggers)
        evaluate_transfer_start(cell, root)
        origin = ["--init-from", str(source.run_dir(root))]
    args = [*origin, "--env", cell.game, "--preset", cell.preset, "--seed", str(cell.seed),
            *RUN_FLAGS]  # fmt: skip
    return launch(
        "train.run", args, cell.run_dir(root), dataclasses.asdict(cell),
        cache=compile_cache(root), loggers=loggers,
    )  # fmt: skip


def evaluate_transfer_start(cell: Cell, root: Path) -> None:
    """The start of a cell with ``after``: ``train.evaluate`` of its source's last checkpoint on
    ``cell.game``'s held-out split, `START_EPISODES` x `START_K` episodes at seed 0
    (one evaluation, not the converted model's four: the source costs a run already)."""
    origin = ["--run-dir", str(cell.source.run_dir(root))]
    _evaluate_held_out(origin, cell.game, 0, cell.start_dir(root), root,
                       f"start of {cell.name} on {cell.game}")  # fmt: skip


def transfer_start(cell: Cell, root: Path) -> dict[str, Any] | None:
    """The measured start of a cell with ``after`` (as `start_point`), or None."""
    return _pooled([cell.start_dir(root) / "metrics.json"])


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float, float]:
    """(rate, low, high): the Wilson score interval of a success rate over ``n`` episodes."""
    if n <= 0:
        raise ValueError(f"n: need at least one episode, got {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, max(0.0, centre - half), min(1.0, centre + half)


def run_figures(rows: list[dict], start: float, eval_episodes: int) -> dict[str, Any]:
    """One run's figures from its ``metrics.jsonl`` rows: the held-out curve with the start as
    step 0, its end (with a Wilson interval over ``eval_episodes``) and normalised AUC, the
    training format-error curve, and each phase's median seconds and tokens/s a step."""
    steps = [0] + [r["step"] for r in rows if HELDOUT in r]
    values = [start] + [r[HELDOUT] for r in rows if HELDOUT in r]
    end = values[-1]
    out: dict[str, Any] = {
        "heldout_curve": [steps, values],
        "heldout_final": end,
        "heldout_final_wilson": wilson(round(end * eval_episodes), eval_episodes)[1:],
        "heldout_auc": normalised_auc(steps, values),
        "format_error_curve": [
            [r["step"] for r in rows if "env_format_error_rate" in r],
            [r["env_format_error_rate"] for r in rows if "env_format_error_rate" in r],
        ],
        "train_success_curve": [
            [r["step"] for r in rows if "success_rate" in r],
            [r["success_rate"] for r in rows if "success_rate" in r],
        ],
        "steps": max(r["step"] for r in rows),
    }
    for phase in PHASES:
        for unit in ("s", "tok_s"):
            key = f"{phase}_{unit}"
            measured = [r[key] for r in rows if key in r]
            if measured:
                out[key] = float(np.median(measured))
    return out


def recorded_start(recorded: dict[str, Any], game: str) -> dict[str, Any] | None:
    """``game``'s starting point as an earlier report (its ``results.json``) recorded it."""
    return recorded.get(game, {}).get("start")


def known_start(root: Path, recorded: dict[str, Any], game: str) -> dict[str, Any] | None:
    """``game``'s start measured under ``root``, else as ``recorded``, else None."""
    return start_point(root, game) or recorded_start(recorded, game)


def recorded_figures(recorded: dict[str, Any], cell: Cell) -> dict[str, Any] | None:
    """``cell``'s figures as an earlier report (its ``results.json``) recorded them, or None."""
    by_preset = recorded.get(cell.game, {}).get("presets", {}).get(cell.name, {})
    seeds = by_preset.get("seeds", {})
    return seeds.get(str(cell.seed), seeds.get(cell.seed))


def finished_figures(cell: Cell, root: Path, start: float) -> dict[str, Any] | None:
    """``cell``'s figures from its finished run directory under ``root``, or None."""
    run_dir = cell.run_dir(root)
    rows = read_metrics(run_dir)
    done = finished_record(run_dir)
    if done is None or not rows:
        return None
    config = json.loads((run_dir / "config.json").read_text())
    figures = run_figures(rows, start, config["eval_episodes"] * config["eval_k"])
    figures["wall_s"] = done["wall_s"]
    return figures


def summarise(
    root: Path, model: str = MODEL, recorded: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Per game: the start and, per preset (a row: `Cell.name`), every finished seed's
    figures and the mean and 95% bootstrap interval over seeds of the end and the AUC. A row
    that starts from another game's run has its own start (``start`` in each seed's figures):
    the held-out curve and the lift begin there.

    A run's figures come from its finished run directory under ``root`` or, where that is not
    here (run directories hold checkpoints and stay on the machine that ran them), from
    ``recorded``: the report an earlier study wrote (``results.json``), so the committed
    results carry over to a fresh clone instead of being lost at the next report. The start
    likewise."""
    recorded = recorded or {}
    results: dict[str, Any] = {}
    for game in games():
        start = known_start(root, recorded, game)
        if start is None:
            continue
        entry: dict[str, Any] = {"start": start, "presets": {}}
        for cell in (c for c in cells() if c.game == game):
            own_start = start if cell.after is None else transfer_start(cell, root)
            figures = (
                None if own_start is None else finished_figures(cell, root, own_start["success"])
            )
            if figures is not None and cell.after is not None:
                figures["start"] = own_start  # the row's own start: its source's checkpoint
            if figures is None:
                figures = recorded_figures(recorded, cell)
            if figures is None:
                continue
            entry["presets"].setdefault(cell.name, {"seeds": {}})["seeds"][cell.seed] = figures
        for by_preset in entry["presets"].values():
            runs = list(by_preset["seeds"].values())
            for name in ("heldout_final", "heldout_auc", "wall_s"):
                mean, low, high = bootstrap_ci([r[name] for r in runs])
                by_preset[name] = {"mean": mean, "low": low, "high": high, "n": len(runs)}
            curves = [r["heldout_curve"] for r in runs]
            if all(c[0] == curves[0][0] for c in curves):
                mean, low, high = mean_band([c[1] for c in curves])
                by_preset["curve"] = {
                    "steps": curves[0][0],
                    "mean": mean.tolist(),
                    "low": low.tolist(),
                    "high": high.tolist(),
                }
        results[game] = entry
    return results


def _pct(mean: float, low: float | None = None, high: float | None = None) -> str:
    """A rate in percent: whole points, one decimal under 1% (1 of 200 is 0.5, not 0)."""
    points = 100 * mean
    text = f"{points:.1f}" if 0 < abs(points) < 1 else f"{points:.0f}"
    return text if low is None else f"{text} [{100 * low:.0f}, {100 * high:.0f}]"


def _points(difference: float) -> str:
    """A difference of rates in signed points (``+48``, ``-3``, ``+0``)."""
    return f"{round(100 * difference):+d}"


def _phase(figures: dict, phase: str) -> str:
    seconds = figures.get(f"{phase}_s", float("nan"))
    return f"{seconds:.0f} ({figures.get(f'{phase}_tok_s', float('nan')):.0f})"


def markdown(results: dict[str, Any], exported: dict[str, Any] | None = None) -> str:
    lines = [
        "# A real model learns: results",
        "",
        "Written by `python -m train.study.real_model`. Held-out success in %, 95% intervals in "
        "brackets: over seeds (percentile bootstrap of the seeds' mean; with 3 seeds read it as "
        "their spread) for a preset, over episodes (Wilson) for the start and for one run. AUC = "
        "the held-out curve's mean over training, the start counted as step 0.",
        "",
        f"Every run: `python -m train.run --model-path {MODEL} --env GAME --preset PRESET "
        f"--seed SEED {' '.join(RUN_FLAGS)}`",
        "",
    ]
    for game, entry in results.items():
        start = entry["start"]
        lo, hi = start["wilson"][1:]
        lines += [
            f"## {game}",
            "",
            f"Start (untrained, {start['episodes']} held-out episodes): "
            f"{_pct(start['success'], lo, hi)}, format errors "
            f"{100 * start['format_errors']:.0f}% of turns.",
            "",
            "| preset | seeds | held-out end | lift over start (points) | held-out AUC "
            "| each seed's end [Wilson] | wall min a run |",
            "|---|---|---|---|---|---|---|",
        ]
        for preset, p in entry["presets"].items():
            end, auc = p["heldout_final"], p["heldout_auc"]
            row_start = float(
                np.mean([f.get("start", start)["success"] for f in p["seeds"].values()])
            )
            each = ", ".join(
                f"s{seed} {_pct(f['heldout_final'], *f['heldout_final_wilson'])}"
                for seed, f in sorted(p["seeds"].items())
            )
            lift = _points(end["mean"] - row_start)
            over_seeds = end["n"] > 1  # one seed: its own (Wilson) interval is in the row
            end_text = (
                _pct(end["mean"], end["low"], end["high"]) if over_seeds else _pct(end["mean"])
            )
            auc_text = (
                _pct(auc["mean"], auc["low"], auc["high"]) if over_seeds else _pct(auc["mean"])
            )
            lines.append(
                f"| {preset} | {end['n']} | {end_text} | {lift} | {auc_text} | {each} "
                f"| {p['wall_s']['mean'] / 60:.0f} |"
            )
        for preset, p in entry["presets"].items():
            for seed, f in sorted(p["seeds"].items()):
                if "start" in f:
                    own = f["start"]
                    lines += [
                        "",
                        f"`{preset}` seed {seed} starts from that run's last checkpoint, whose "
                        f"start here ({own['episodes']} held-out episodes) was "
                        f"{_pct(own['success'], *own['wilson'][1:])}, format errors "
                        f"{100 * own['format_errors']:.0f}% of turns: its lift and AUC are "
                        "counted from there.",
                    ]
        lines += ["", "Per run: training format errors (% of turns) by step, and phase costs.", ""]
        lines += [
            "| run | format errors by step | rollout s (tok/s) | scoring s (tok/s) "
            "| update s (tok/s) |",
            "|---|---|---|---|---|",
        ]
        for preset, p in entry["presets"].items():
            for seed, f in sorted(p["seeds"].items()):
                errors = " ".join(f"{100 * v:.0f}" for v in f["format_error_curve"][1])
                phases = " | ".join(_phase(f, ph) for ph in PHASES)
                lines.append(f"| {preset} s{seed} | {errors} | {phases} |")
        lines.append("")
    if exported is not None:
        lines += export_section(exported)
    return "\n".join(lines)


def export_section(exported: dict[str, Any]) -> list[str]:
    """The report's lines on an exported run (`export_run`'s record)."""
    run_end, export_end, c = exported["run_last_eval"], exported["export_eval"], exported["cell"]
    where = f" (`{exported['run']}`)" if "run" in exported else ""
    return [
        "## The best run, exported",
        "",
        f"`{c['preset']}` seed {c['seed']}{where} exported with `train.export` (float32) and "
        f"loaded with transformers: its logits equal the run's own to "
        f"{exported['logits_max_abs_diff']:.1e} (max abs) on a held-out prompt. "
        f"`train.evaluate` on the export, {exported['export_episodes']} held-out episodes: "
        f"{_pct(*export_end)}; the run's last evaluation: {_pct(*run_end)}. "
        + ("Within its interval." if exported["agrees"] else "Outside its interval."),
        "",
        f"    {exported['command']}",
        "",
    ]


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    from train.study import figures

    paths = []
    for game, entry in results.items():
        fig, axes = figures.panels()
        ax = axes[0][0]
        for preset, p in entry["presets"].items():
            c = p.get("curve")
            if c is not None:
                label = f"{preset} ({p['heldout_final']['n']} seeds)"
                figures.band(ax, c["steps"], c["mean"], c["low"], c["high"], label=label)
        ax.axhline(entry["start"]["success"], color="grey", ls="--", label="start")
        title = f"SmolLM2-135M-Instruct on {game}: held-out success"
        figures.rate_axes(ax, title, "held-out success rate")
        paths.append(figures.save(fig, out_dir / f"curves_{game}.png"))
    return paths


EXPORT_TASKS, EXPORT_K, EXPORT_SEED = 48, 2, 100  # 96 held-out episodes for the export's check


def best_run(results: dict[str, Any], game: str = MAIN_GAME, cell=Cell) -> tuple[Any, dict] | None:
    """The finished run of ``game`` with the highest held-out end (then AUC): (``cell(game,
    preset, seed)``, its figures). ``cell``: the study's cell type (round 2 passes its own)."""
    entry = results.get(game, {})
    runs = [
        (cell(game, preset, int(seed)), f)
        for preset, p in entry.get("presets", {}).items()
        for seed, f in p["seeds"].items()
    ]
    return max(runs, key=lambda r: (r[1]["heldout_final"], r[1]["heldout_auc"]), default=None)


def export_best(root: Path, results: dict[str, Any], model: str, *, game: str = MAIN_GAME,
                cell=Cell) -> dict[str, Any]:  # fmt: skip
    """`export_run` on the `best_run` of ``game``."""
    found = best_run(results, game, cell)
    if found is None:
        raise SystemExit(f"--export-best: no finished run of {game} yet")
    return export_run(root, *found)


def export_run(root: Path, cell, figures: dict[str, Any]) -> dict[str, Any]:
    """Exports ``cell``'s run (``train.export``, float32) to
    ``<runs>/export-<game>-<preset>-seed<k>`` (the run directory's parts under ``root`` joined by
    ``-``, so a later best run never reuses an earlier one's export), loads it with transformers
    and compares its logits with the run's own on one held-out prompt, then evaluates the export
    with ``train.evaluate`` on `EXPORT_TASKS` x `EXPORT_K` held-out episodes; ``agrees``: the
    export's rate lies within the run's last evaluation's Wilson interval. ``cell``: any study's
    (``game``, ``preset``, ``seed``, ``run_dir(root)``); ``figures``: its `run_figures`."""
    import jax.numpy as jnp
    import torch
    import transformers

    import envs
    from train import export
    from train.core.build import model_config, restore_model, run_codec, run_config

    run_dir = cell.run_dir(root)
    out = Path(root) / f"export-{'-'.join(run_dir.relative_to(root).parts)}"
    if not (run_dir / "config.json").exists():
        raise SystemExit(f"--export-best: the best run ({cell}) is recorded in the report, but "
                         f"its run directory {run_dir} is not on this machine")  # fmt: skip
    if not (out / "config.json").exists():
        export.export(run_dir, out, dtype="float32")
    cfg = run_config(run_dir)
    env = envs.make(cell.game, seed=0, split="test")
    codec = run_codec(cfg, env)
    ids = np.asarray([codec.prompt(env.reset(), env.tools)], np.int32)
    ours = np.asarray(restore_model(run_dir, model_config(cfg, codec))(jnp.asarray(ids)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    evaluated = out.parent / f"{out.name}-eval"
    args = [
        "--model-path", str(out), "--env", cell.game, "--episodes", str(EXPORT_TASKS),
        "--k", str(EXPORT_K), *TURN, "--seed", str(EXPORT_SEED), "--out", str(evaluated),
    ]  # fmt: skip
    if not (evaluated / "metrics.json").exists():
        _evaluate(args, root, "the export's evaluation")
    measured = json.loads((evaluated / "metrics.json").read_text())
    episodes = EXPORT_TASKS * EXPORT_K
    rate = measured["eval_heldout_success_rate"]
    low, high = figures["heldout_final_wilson"]
    return {
        "run": str(run_dir),
        "cell": {"game": cell.game, "preset": cell.preset, "seed": cell.seed},
        "run_last_eval": [figures["heldout_final"], low, high],
        "export_eval": list(wilson(round(rate * episodes), episodes)),
        "export_episodes": episodes,
        "logits_max_abs_diff": float(np.abs(ours - theirs).max()),
        "agrees": bool(low <= rate <= high),
        "command": f"python -m train.evaluate {' '.join(args)}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.study.real_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model-path", default=MODEL, help=f"the converted model ({MODEL})")
    parser.add_argument("--runs", default="runs/real-model", help="where the runs go")
    parser.add_argument("--out", default="benchmarks/real_model", help="where the report goes")
    parser.add_argument("--report-only", action="store_true", help="aggregate existing runs only")
    parser.add_argument(
        "--export-best", action="store_true", help="export the best run and check the export"
    )
    parser.add_argument("--loggers", help=LOGGERS_HELP)
    args = parser.parse_args(argv)
    root, out = Path(args.runs), Path(args.out)
    recorded = (
        json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    )
    if not args.report_only and not args.export_best:
        if not (Path(args.model_path) / "config.json").exists():
            raise SystemExit(f"--model-path: no converted model at {args.model_path}; run "
                             "`make smollm2` first")  # fmt: skip
        check_held_out(games(), flag="study")
        check_study_loggers(args.loggers)
        todo = cells()
        for n, cell in enumerate(todo, 1):
            if (
                known_start(root, recorded, cell.game) is None
            ):  # a game's start before its first run
                started = time.perf_counter()
                evaluate_start(cell.game, root, args.model_path)
                print(f"start of {cell.game}: {time.perf_counter() - started:.0f} s", flush=True)
            if finished_record(cell.run_dir(root)) is None and recorded_figures(recorded, cell):
                print(f"[{n}/{len(todo)}] {cell}: recorded in {out}/results.json", flush=True)
                continue
            record = run_cell(cell, root, args.model_path, loggers=args.loggers)
            state = "skipped (done)" if record["skipped"] else f"{record['wall_s']:.0f} s"
            print(f"[{n}/{len(todo)}] {cell}: {state}", flush=True)
    results = summarise(root, args.model_path, recorded)
    out.mkdir(parents=True, exist_ok=True)
    if args.export_best:
        check = export_best(root, results, args.model_path)
        (out / "export.json").write_text(json.dumps(check, indent=1) + "\n")
    exported = None
    if (out / "export.json").exists():
        exported = json.loads((out / "export.json").read_text())
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results, exported))
    plot(results, out)
    print(f"wrote {out}/results.md, results.json and curves_*.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
