"""Round 2 of the real-model study: does SmolLM2 learn to use what the game tells it?

    make smollm2                                       # the model, converted once
    python -m train.study.real_model2                  # every step below (resumable)
    python -m train.study.real_model2 --report-only    # aggregate what is there
    python -m train.study.real_model2 --export-best    # export the best run, evaluate the export
    python -m train.study.real_model2 --lr-probe       # mpo seed 0 for 10 steps at each rate
    python -m train.study.real_model2 --presets mpo,grpo --seeds 1   # only those cells

Round 1 (`train.study.real_model`) lifted SmolLM2-135M-Instruct on GuessTheNumber mostly by
teaching it the move format. Here every RL run starts from a **format-only warm start**, so what
RL adds above it is strategy learned across turns. Steps, each skipped when done and resumed
when killed:

1. the reference lines of every game (`train.study.reference_lines`), once;
2. per game, the warm start: ``python -m train.sft --demo-player P`` on demonstrations of a
   strategy-free scripted player in the game's exact format (GuessTheNumber ``random_distinct``,
   FrozenLake ``random_valid``; `SFT_FLAGS`), LoRA adapters on the converted model;
3. its measurement like round 1's start: ``train.evaluate`` of the warm start on 200 held-out
   episodes (4 seeds of 25 tasks x 2 samples): success, format errors, hint consistency;
4. the RL cells (`cells`), each ``python -m train.run --init-from WARMSTART`` with
   `RL_FLAGS` (one budget and one learning rate, `STUDY_LR`, for every preset; LoRA), in
   ``<runs>/<game>/lr<rate>/<preset>/seed<k>``: GuessTheNumber ``mpo``
   and ``grpo`` at seeds 0-3, seed-major and paired (a seed draws the same training games for
   both), then ``turn_ppo`` and ``mpo_trace`` (TRACE's gold answer: the target as a move; its
   reference: the frozen warm start) at seeds 0-1, then FrozenLake ``mpo`` and ``grpo`` at 0-1.

The learning rate was chosen by ``--lr-probe``: mpo at seed 0 for `PROBE_STEPS` steps at each
rate of `LR_PROBE`. The probe at a rate is the first `PROBE_STEPS` steps of that rate's mpo seed-0
cell (the rate is constant after a 2-step warmup, so a 10-step run is the first half of a 20-step
one): the study's run at the chosen rate resumes the probe's run to the full budget, and a rate
whose mpo seed-0 run exists is probed for free. The runs of an earlier study rate
(`EARLIER_LRS`) are kept and reported in their own table.

The report (``--out``, default ``benchmarks/real_model/round2``): ``results.md`` and
``results.json`` (per game: round 1's untrained start, the warm start, each preset's held-out end
and AUC with intervals over seeds, the paired MPO - GRPO difference with its interval, the
strategy metric by step and format errors at the end, seconds a step by phase) and
``curves_<game>.png`` (held-out success with the reference lines; the strategy metric). Finished
runs' figures are kept in ``results.json``, so a later report on a machine without the run
directories keeps them. ``--export-best``: the best GuessTheNumber run exported and its export
evaluated (round 1's `train.study.real_model.export_best`), recorded in ``export.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from train.core.metrics import read_metrics
from train.study.real_model import (
    MODEL,
    PHASES,
    TURN,
    _evaluate_held_out,
    _pct,
    _pooled,
    export_best,
    export_section,
    run_figures,
)
from train.study.round1 import (
    LOGGERS_HELP,
    check_held_out,
    check_study_loggers,
    compile_cache,
    finished_record,
    launch,
)
from train.study.stats import bootstrap_ci

__all__ = ["GAMES", "SFT_FLAGS", "RL_FLAGS", "Cell", "cells", "paired_difference", "main"]

# game -> its strategy-free demonstration player, and its presets with their seeds (in order)
GAMES: dict[str, dict[str, Any]] = {
    "guess-the-number": {
        "demo_player": "random_distinct",
        "presets": {"mpo": 4, "grpo": 4, "turn_ppo": 2, "mpo_trace": 2},
        "metric": "hint_consistency",
    },
    "frozen-lake": {
        "demo_player": "random_valid",
        "presets": {"mpo": 2, "grpo": 2},
        "metric": "path_ratio",  # over won episodes: n/a while nothing wins
        "also": ("hole_moves", "wall_moves"),  # shares of moves: the report's warm-start line
    },
}
LORA = ["--lora-rank", "16", "--lora-alpha", "32"]
# the warm start's memory: each decoder layer keeps only its input for the backward pass (one
# update of 8 rows of 1024 tokens: 1.1 GiB of temporaries against 13 GiB keeping everything,
# benchmarks/sft_memory.py); a resumed warm start takes it too (it changes no gradient)
SFT_MEMORY = ["--remat", "full"]
# the warm start: 256 demonstration games (about 100 assistant tokens each), 40 steps of 8
SFT_FLAGS = [
    *TURN, *LORA, "--lr", "2e-4", "--demos", "256", "--val-demos", "32", "--batch-size", "8",
    "--steps", "40", "--eval-every", "0", "--checkpoint-every", "20", *SFT_MEMORY,
]  # fmt: skip
# the learning rate of every RL run, chosen by the probe (mpo seed 0, 10 steps; GuessTheNumber):
# 3e-5 ended 14 points over the warm start on the same tasks, 1e-4 2 points under it
STUDY_LR = "3e-5"
EARLIER_LRS = ("1e-4",)  # the first budget's rate, before the probe: its runs stay in the report
# one RL budget for every preset: 20 steps of 16 episodes (4 tasks x 4), held-out evaluations of
# 50 episodes every 5 steps
BUDGET_STEPS = 20
RL_FLAGS = [
    *TURN, *LORA, "--lr", STUDY_LR, "--warmup-steps", "2",
    "--steps", str(BUDGET_STEPS), "--prompts-per-step", "4", "--group-size", "4",
    "--micro-batch-tokens", "4096", "--minibatches", "1",
    "--eval-every", "5", "--eval-episodes", "25", "--eval-k", "2", "--checkpoint-every", "2",
]  # fmt: skip
# the scripted player whose strategy metric is exactly 1.0, drawn on the metric's panel
METRIC_IDEAL = {"hint_consistency": "every guess inside the hints", "path_ratio": "shortest path"}
# the learning-rate probe (``--lr-probe``): mpo at seed 0, 10 steps of the RL budget, per rate
LR_PROBE = ("3e-5", "1e-4")
PROBE_STEPS = 10
EXPORTED_GAME = "guess-the-number"  # --export-best: the best run of this game
WARM_SEEDS = (0, 1, 2, 3)  # the warm start's 200 held-out episodes: 4 x 25 tasks x 2 samples
HELDOUT = "eval_heldout_success_rate"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One RL run: ``preset`` at ``seed`` on ``game`` at learning rate ``lr``."""

    game: str
    preset: str
    seed: int
    lr: str = STUDY_LR

    def run_dir(self, root: Path) -> Path:
        return Path(root) / self.game / f"lr{self.lr}" / self.preset / f"seed{self.seed}"


def warm_dir(root: Path, game: str) -> Path:
    return Path(root) / game / "warmstart"


def cells(games: tuple[str, ...] = tuple(GAMES), lr: str = STUDY_LR) -> list[Cell]:
    """The RL runs at ``lr`` in the order they run: per game, seed-major over its presets (mpo
    and grpo first), so a stopped study holds both of a pair."""
    out = []
    for game in games:
        presets = GAMES[game]["presets"]
        for seed in range(max(presets.values())):
            out += [Cell(game, p, seed, lr) for p, n in presets.items() if seed < n]
    return out


# -- the steps -------------------------------------------------------------------------------


def make_warm_start(game: str, root: Path, model: str, loggers: str | None = None) -> dict:
    player = GAMES[game]["demo_player"]
    args = ["--model-path", model, "--env", game, "--demo-player", player, *SFT_FLAGS,
            "--no-progress"]  # fmt: skip
    return launch("train.sft", args, warm_dir(root, game), {"game": game, "warm_start": player},
                  cache=compile_cache(root), loggers=loggers, resume_flags=SFT_MEMORY)  # fmt: skip


def _warm_eval(root: Path, game: str, seed: int) -> Path:
    """The warm start's held-out evaluation on seed ``seed``'s tasks (its ``metrics.json``)."""
    return Path(root) / game / "warmstart-eval" / f"seed{seed}" / "metrics.json"


def measure_warm_start(game: str, root: Path, recorded: dict[str, Any] | None = None) -> None:
    """The warm start's held-out evaluation on each seed of `WARM_SEEDS`. A warm start is
    deterministic (one re-made on a fresh machine matched its record in every digit), so where the
    report has recorded one (``recorded``, with ``each`` and ``each_metric``) only the first seed
    is evaluated and compared: equal in success and in the strategy metric, the other seeds are
    the record's; different, every seed is evaluated and the new figures replace the record."""
    origin = ["--run-dir", str(warm_dir(root, game))]

    def evaluate(seed: int) -> None:
        out = _warm_eval(root, game, seed).parent
        _evaluate_held_out(origin, game, seed, out, root, f"the warm start of {game}")

    first, *rest = WARM_SEEDS
    evaluate(first)
    recheck = recorded is not None and "each_metric" in recorded  # older records: every seed
    if recheck and not _warm_eval(root, game, rest[0]).exists():
        if _matches_record(game, root, first, recorded):
            print(f"the warm start of {game} matches its record on seed {first}'s tasks: "
                  "the other seeds' figures are the record's", flush=True)  # fmt: skip
            return
    for seed in rest:
        evaluate(seed)


def _matches_record(game: str, root: Path, seed: int, recorded: dict[str, Any]) -> bool:
    """Whether the evaluation on ``seed``'s tasks equals ``recorded``'s, success and metric; a
    difference is said on stderr (runs recorded from the old warm start are not paired with it)."""
    measured = json.loads(_warm_eval(root, game, seed).read_text())
    metric = GAMES[game]["metric"]
    now = (measured[HELDOUT], measured.get(f"eval_heldout_env_{metric}"))
    before = (recorded["each"].get(str(seed)), recorded["each_metric"].get(str(seed)))
    if now != before:
        print(f"warning: the warm start of {game} differs from its record on seed {seed}'s "
              f"tasks (success, {metric}: {now} against {before}): every seed is evaluated",
              file=sys.stderr, flush=True)  # fmt: skip
    return now == before


def warm_point(root: Path, game: str) -> dict[str, Any] | None:
    """The warm start's pooled held-out figures (as round 1's start), with the strategy metric
    and ``each``: its success on each seed's tasks (a run at seed ``s`` evaluates the same 25
    held-out tasks, so its end is paired with ``each[s]``)."""
    files = [_warm_eval(root, game, s) for s in WARM_SEEDS]
    pooled = _pooled(files)
    if pooled is not None:
        measured = [json.loads(f.read_text()) for f in files]
        key = f"eval_heldout_env_{GAMES[game]['metric']}"
        values = [m[key] for m in measured if m.get(key) is not None and np.isfinite(m[key])]
        pooled[GAMES[game]["metric"]] = float(np.mean(values)) if values else None
        for extra in GAMES[game].get("also", ()):
            got = [m.get(f"eval_heldout_env_{extra}") for m in measured]
            pooled[extra] = float(np.mean(got)) if None not in got else None
        pooled["each"] = {str(s): m[HELDOUT] for s, m in zip(WARM_SEEDS, measured, strict=True)}
        pooled["each_metric"] = {
            str(s): m.get(key) for s, m in zip(WARM_SEEDS, measured, strict=True)
        }
    return pooled


def run_cell(
    cell: Cell, root: Path, model: str, loggers: str | None = None, *, steps: int = BUDGET_STEPS
) -> dict:
    """``train.run`` from the warm start with `RL_FLAGS` at the cell's rate for ``steps`` steps
    (skipped when done, resumed when killed). A run that finished fewer steps (the probe's) is
    resumed to ``steps``: its checkpoint is the same run's state at its last step."""
    run_dir = cell.run_dir(root)
    if finished_record(run_dir) is not None and _config_steps(run_dir) < steps:
        (run_dir / "study.json").unlink()  # not finished at this budget: resumed below
    args = ["--init-from", str(warm_dir(root, cell.game)), "--model-path", model,
            "--env", cell.game, "--preset", cell.preset, "--seed", str(cell.seed),
            *with_flags(RL_FLAGS, lr=cell.lr, steps=str(steps))]  # fmt: skip
    return launch("train.run", args, run_dir, dataclasses.asdict(cell), cache=compile_cache(root),
                  loggers=loggers, resume_flags=["--steps", str(steps)])  # fmt: skip


def with_flags(flags: list[str], **values: str) -> list[str]:
    """``flags`` with the values of ``--name`` replaced (``lr="3e-5"`` -> ``--lr 3e-5``)."""
    out = list(flags)
    for name, value in values.items():
        out[out.index(f"--{name.replace('_', '-')}") + 1] = value
    return out


def probe_cell(game: str, lr: str) -> Cell:
    """The probe at ``lr``: the first `PROBE_STEPS` steps of mpo seed 0 at that rate."""
    return Cell(game, "mpo", 0, lr)


def _config_steps(run_dir: Path) -> int:
    return int(json.loads((run_dir / "config.json").read_text()).get("steps", 0))


def probe_figures(root: Path, game: str, warm: dict[str, Any]) -> dict[str, dict]:
    """Each probed rate's held-out curve up to `PROBE_STEPS`, its evaluation there over the warm
    start on the same tasks (seed 0's) and its format errors there."""
    out = {}
    for lr in LR_PROBE:
        run_dir = probe_cell(game, lr).run_dir(root)
        rows = [r for r in read_metrics(run_dir) if HELDOUT in r and r["step"] <= PROBE_STEPS]
        if not rows or rows[-1]["step"] != PROBE_STEPS:
            continue
        out[lr] = {
            "heldout_curve": [[r["step"] for r in rows], [r[HELDOUT] for r in rows]],
            "lift_same_tasks": rows[-1][HELDOUT] - warm["each"]["0"] if "each" in warm else None,
            "format_errors": rows[-1].get("eval_heldout_env_format_error_rate"),
        }
    return out


# -- the report ------------------------------------------------------------------------------


def cell_figures(cell: Cell, root: Path, warm: dict[str, Any]) -> dict[str, Any] | None:
    """A run's figures once it finished the budget (round 1's `run_figures`, from the warm
    start), plus the strategy metric and format errors of its last held-out evaluation."""
    run_dir = cell.run_dir(root)
    rows, done = read_metrics(run_dir), finished_record(run_dir)
    if done is None or not rows:
        return None
    config = json.loads((run_dir / "config.json").read_text())
    if config.get("steps", 0) < BUDGET_STEPS:
        return None  # finished as the probe only
    figures = run_figures(rows, warm["success"], config["eval_episodes"] * config["eval_k"])
    last = [r for r in rows if HELDOUT in r][-1]
    metric = GAMES[cell.game]["metric"]
    figures[metric] = last.get(f"eval_heldout_env_{metric}")
    figures["format_errors"] = last.get("eval_heldout_env_format_error_rate")
    figures["lr"] = cell.lr
    for name, key in (("metric_curve", f"env_{metric}"),
                      ("heldout_metric_curve", f"eval_heldout_env_{metric}")):  # fmt: skip
        figures[name] = [[r["step"] for r in rows if key in r], [r[key] for r in rows if key in r]]
    # the steps' own seconds (evaluations apart), summed from the metrics: right for a run
    # resumed after a kill too, whose last invocation's wall time covers only its last steps
    phases = ("rollout_s", "scoring_s", "credit_s", "update_s")
    figures["wall_s"] = float(sum(r.get(k, 0.0) for r in rows for k in phases))
    return figures


def paired_difference(a: dict[str, dict], b: dict[str, dict], key: str) -> dict[str, Any] | None:
    """Seed-paired ``a - b`` of ``key`` over the seeds both finished: mean and 95% bootstrap
    interval of the per-seed differences (the same seed drew the same training games)."""
    seeds = sorted(set(a) & set(b), key=int)
    if not seeds:
        return None
    diffs = [a[s][key] - b[s][key] for s in seeds]
    mean, low, high = bootstrap_ci(diffs)
    return {"mean": mean, "low": low, "high": high, "n": len(seeds), "each": diffs}


def rate_figures(
    root: Path, game: str, lr: str, warm: dict[str, Any], recorded: dict[str, Any]
) -> dict[str, Any]:
    """The finished runs of ``game`` at ``lr`` (from ``recorded``, the report's earlier figures,
    where a run directory is not here): per preset each seed's figures with their end over the
    warm start on the same tasks, the means with intervals over seeds, and the seed-paired
    MPO - GRPO difference when both ran."""
    presets: dict[str, Any] = {}
    for cell in cells((game,), lr):
        figures = cell_figures(cell, root, warm)
        if figures is None:
            seeds = recorded.get("presets", {}).get(cell.preset, {}).get("seeds", {})
            figures = seeds.get(str(cell.seed))
            if figures is not None and figures.get("lr") != lr:
                figures = None  # recorded at another rate (a report from before the rate moved)
        if figures is not None:
            presets.setdefault(cell.preset, {"seeds": {}})["seeds"][str(cell.seed)] = figures
    for p in presets.values():
        for seed, f in p["seeds"].items():  # the end over the warm start on the same tasks
            if seed in warm.get("each", {}):
                f["lift_same_tasks"] = f["heldout_final"] - warm["each"][seed]
        for key in ("heldout_final", "heldout_auc", "wall_s", "lift_same_tasks"):
            values = [f[key] for f in p["seeds"].values() if key in f]
            if values:
                mean, low, high = bootstrap_ci(values)
                p[key] = {"mean": mean, "low": low, "high": high, "n": len(values)}
    out: dict[str, Any] = {"presets": presets}
    if "mpo" in presets and "grpo" in presets:
        out["mpo_minus_grpo"] = {
            key: paired_difference(presets["mpo"]["seeds"], presets["grpo"]["seeds"], key)
            for key in ("heldout_final", "heldout_auc")
        }
    return out


def summarise(root: Path, recorded: dict[str, Any], round1: dict[str, Any]) -> dict[str, Any]:
    """Per game: round 1's start, the warm start, the runs at `STUDY_LR` (``presets``,
    ``mpo_minus_grpo``), those at `EARLIER_LRS` (``earlier``) and the probe (``lr_probe``)."""
    results: dict[str, Any] = {}
    for game in GAMES:
        before = recorded.get(game, {})
        warm = warm_point(root, game) or before.get("warm_start")
        if warm is None:
            continue
        entry: dict[str, Any] = {"start": round1.get(game, {}).get("start"), "warm_start": warm}
        entry.update(rate_figures(root, game, STUDY_LR, warm, before))
        earlier = {
            lr: rate_figures(root, game, lr, warm, before.get("earlier", {}).get(lr, {}))
            for lr in EARLIER_LRS
        }
        earlier = {lr: e for lr, e in earlier.items() if e["presets"]}
        if earlier:
            entry["earlier"] = earlier
        probe = probe_figures(root, game, warm) or before.get("lr_probe")
        if probe:
            entry["lr_probe"] = probe
        results[game] = entry
    return results


def _metric_text(warm: dict[str, Any], game: str, *, only: bool = False) -> str:
    """The warm start's strategy metric (``n/a`` where no episode defines it, e.g. path_ratio
    without a win): its value alone when ``only``, else named, with the game's other policy
    metrics (``also``)."""
    metric = GAMES[game]["metric"]

    def value(key: str) -> str:
        return "n/a" if warm.get(key) is None else f"{warm[key]:.2f}"

    if only:
        return value(metric)
    return "; ".join(f"{k} {value(k)}" for k in (metric, *GAMES[game].get("also", ())))


def labelled(entry: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(row label, preset figures) of a game's runs: the study rate's by preset name, an
    earlier rate's as ``<preset> @ <lr>``."""
    rows = list(entry["presets"].items())
    for lr, e in entry.get("earlier", {}).items():
        rows += [(f"{preset} @ {lr}", p) for preset, p in e["presets"].items()]
    return rows


def preset_table(rate: dict[str, Any], metric: str) -> list[str]:
    """The report's table of one rate's presets, and its paired MPO - GRPO line."""
    out = [
        f"| preset | seeds | held-out end | end - warm start, same tasks | held-out AUC "
        f"| {metric} at the end | format errors | each seed's end | min of steps a run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if not rate["presets"]:
        out.append("| (no RL run has finished yet) | | | | | | | | |")
    for preset, p in rate["presets"].items():
        end, auc = p["heldout_final"], p["heldout_auc"]
        each = ", ".join(
            f"s{s} {_pct(f['heldout_final'], *f['heldout_final_wilson'])}"
            for s, f in sorted(p["seeds"].items())
        )
        metric_end = np.nanmean([f.get(metric) or np.nan for f in p["seeds"].values()])
        errors = [f.get("format_errors") for f in p["seeds"].values()]
        errors = np.nanmean([np.nan if e is None else e for e in errors])
        lift = p.get("lift_same_tasks")
        out.append(
            f"| {preset} | {end['n']} | {_over_seeds(end)} | {_over_seeds(lift, signed=True)} "
            f"| {_over_seeds(auc)} | {metric_end:.2f} "
            f"| {100 * errors:.0f}% | {each} | {p['wall_s']['mean'] / 60:.0f} |"
        )
    diff = rate.get("mpo_minus_grpo")
    if diff and diff["heldout_final"]:
        d, a = diff["heldout_final"], diff["heldout_auc"]
        out += [
            "",
            f"MPO - GRPO, paired by seed ({d['n']} seed{'s' if d['n'] > 1 else ''}): held-out "
            f"end {_over_seeds(d, signed=True)} points, AUC {_over_seeds(a, signed=True)}.",
        ]
    return out


def markdown(results: dict[str, Any], lines: dict[str, Any], exported: dict | None = None) -> str:
    out = [
        "# Round 2: does the real model use what the game tells it?",
        "",
        "Written by `python -m train.study.real_model2`. Held-out success in %, 95% intervals in "
        "brackets: Wilson over episodes for the start and the warm start, bootstrap over seeds "
        "for a preset's mean, and over the seed-paired differences for MPO - GRPO (over two "
        "seeds that is only their range, printed as one: *a to b*). A run at "
        "seed s is evaluated on the same 25 held-out tasks as the warm start's seed-s "
        "evaluation: *end - warm start, same tasks* is paired on tasks (the samples differ).",
        "",
        f"Warm start: `python -m train.sft --model-path {MODEL} --env GAME --demo-player PLAYER "
        f"{' '.join(SFT_FLAGS)}`",
        "",
        f"Every run: `python -m train.run --init-from WARMSTART --model-path {MODEL} --env GAME "
        f"--preset PRESET --seed SEED {' '.join(RL_FLAGS)}`",
        "",
    ]
    for game, entry in results.items():
        metric = GAMES[game]["metric"]
        warm, start = entry["warm_start"], entry.get("start")
        out += [f"## {game}", "", "| reference | held-out success |", "|---|---|"]
        for player, f in lines.get(game, {}).items():
            out.append(f"| scripted `{player}` | {_pct(f['success'], f['low'], f['high'])} |")
        if start:
            out.append(
                f"| untrained SmolLM2 (round 1) | {_pct(start['success'], *start['wilson'][1:])} |"
            )
        out += [
            f"| format-only warm start ({warm['episodes']} episodes) "
            f"| {_pct(warm['success'], *warm['wilson'][1:])}; format errors "
            f"{100 * warm['format_errors']:.0f}% of turns; {_metric_text(warm, game)} |",
            "",
            f"At `--lr {STUDY_LR}`, the probe's choice:",
            "",
            *preset_table(entry, metric),
        ]
        for lr, earlier in entry.get("earlier", {}).items():
            out += ["", f"At `--lr {lr}`, the first budget's rate (run before the probe; "
                    "every other flag the same):", "", *preset_table(earlier, metric)]  # fmt: skip
        if entry.get("lr_probe"):
            out += ["", f"Learning-rate probe: mpo, seed 0, the first {PROBE_STEPS} steps of the "
                    "budget above at each rate (`--lr-probe`):", "",
                    "| --lr | held-out by step | end - warm start, same tasks | format errors |",
                    "|---|---|---|---|"]  # fmt: skip
            for lr, f in entry["lr_probe"].items():
                steps, rates = f["heldout_curve"]
                curve = ", ".join(f"{s}: {100 * v:.0f}" for s, v in zip(steps, rates, strict=True))
                lift = f["lift_same_tasks"]
                lift = "" if lift is None else f"{100 * lift:+.0f}"
                err = f["format_errors"]
                err = "" if err is None else f"{100 * err:.0f}%"
                out.append(f"| {lr} | {curve} | {lift} | {err} |")
        by_step = {p: mean_curve([f.get("heldout_metric_curve") for f in e["seeds"].values()])
                   for p, e in labelled(entry)}  # fmt: skip
        steps = sorted({s for c in by_step.values() if c for s in c[0]})
        if steps:
            out += ["", f"Held-out {metric} by step (mean over seeds; warm start "
                    f"{_metric_text(warm, game, only=True)}):", "",
                    f"| preset | {' | '.join(f'step {s}' for s in steps)} |",
                    f"|---|{'---|' * len(steps)}"]  # fmt: skip
            for preset, c in by_step.items():
                value = dict(zip(*c, strict=True)) if c else {}
                row = " | ".join(f"{value[s]:.2f}" if s in value else "" for s in steps)
                out.append(f"| {preset} | {row} |")
        out += ["", "| run | rollout s | scoring s | update s |", "|---|---|---|---|"]
        for preset, p in labelled(entry):
            for seed, f in sorted(p["seeds"].items()):
                cost = " | ".join(f"{f.get(f'{ph}_s', float('nan')):.0f}" for ph in PHASES)
                out.append(f"| {preset} s{seed} | {cost} |")
        out.append("")
    if exported is not None:
        out += export_section(exported)
    return "\n".join(out)


def mean_curve(curves: list[list[list[float]] | None]) -> tuple[list, list] | None:
    """The seeds' mean ([steps, values] each) over the steps every seed reached; None when a
    seed has no curve or they share no step."""
    if not curves or any(not c or not c[0] for c in curves):
        return None
    steps = sorted(set.intersection(*(set(c[0]) for c in curves)))
    if not steps:
        return None
    at = [dict(zip(*c, strict=True)) for c in curves]
    return steps, [float(np.mean([a[s] for a in at])) for s in steps]


def plot(results: dict[str, Any], lines: dict[str, Any], out_dir: Path) -> None:
    """Per game, two panels: held-out success with the reference lines and the warm start, and
    the game's strategy metric in the same held-out evaluations (each preset's mean over seeds)."""
    from train.study.figures import band, panels, rate_axes, save

    for game, entry in results.items():
        metric, warm = GAMES[game]["metric"], entry["warm_start"]
        fig, [[success, strategy]] = panels(1, 2, sharex=True)  # the same steps on both
        for preset, p in labelled(entry):
            seeds = list(p["seeds"].values())
            for ax, key in ((success, "heldout_curve"), (strategy, "heldout_metric_curve")):
                curve = mean_curve([f.get(key) for f in seeds])
                if curve:
                    n = len(seeds)
                    band(ax, *curve, label=f"{preset} ({n} seed{'s' if n > 1 else ''})")
        at: dict[float, list[str]] = {}  # players on the same line share one label
        for player, f in lines.get(game, {}).items():
            at.setdefault(f["success"], []).append(player)
        for rate, players in at.items():
            success.axhline(rate, ls=":", lw=1, color="grey")
            success.text(0, rate, f" {', '.join(players)}", fontsize=7, color="grey",
                         va="top" if rate > 0.9 else "bottom")  # fmt: skip
        success.axhline(warm["success"], color="black", ls="--", label="warm start")
        if warm.get(metric) is not None:
            strategy.axhline(warm[metric], color="black", ls="--", label="warm start")
        strategy.axhline(1.0, ls=":", lw=1, color="grey", label=f"{METRIC_IDEAL[metric]} (1.0)")
        rate_axes(success, f"SmolLM2-135M on {game} from a format-only warm start",
                  "held-out success rate")  # fmt: skip
        rate_axes(strategy, f"{metric} in the same held-out games", metric,
                  unit_range=metric != "path_ratio")  # fmt: skip
        save(fig, out_dir / f"curves_{game}.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.study.real_model2", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model-path", default=MODEL, help=f"the converted model ({MODEL})")
    parser.add_argument("--runs", default="runs/real-model2", help="where the runs go")
    parser.add_argument("--out", default="benchmarks/real_model/round2", help="the report")
    parser.add_argument("--games", help=f"comma-separated (default: {','.join(GAMES)})")
    parser.add_argument("--report-only", action="store_true", help="aggregate existing runs only")
    parser.add_argument(
        "--export-best", action="store_true", help="export the best run and check the export"
    )
    parser.add_argument(
        "--lr-probe", action="store_true",
        help=f"run only the learning-rate probe (mpo, seed 0, {PROBE_STEPS} steps at each of "
        f"{', '.join(LR_PROBE)}) after the warm start",
    )  # fmt: skip
    parser.add_argument(
        "--presets", help="comma-separated: run only these presets' cells (the report reads all)"
    )
    parser.add_argument("--seeds", help="comma-separated: run only these seeds' cells")
    parser.add_argument("--loggers", help=LOGGERS_HELP)
    args = parser.parse_args(argv)
    games = tuple(args.games.split(",")) if args.games else tuple(GAMES)
    unknown = sorted(set(games) - set(GAMES))
    if unknown:
        raise SystemExit(f"--games: unknown {unknown}; choose from {sorted(GAMES)}")
    chosen = _chosen_cells(games, args.presets, args.seeds)
    root, out = Path(args.runs), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recorded = _read(out / "results.json")
    round1 = _read(out.parent / "results.json")
    # the reference lines of `train.study.reference_lines`, beside round 1's report (made there
    # if missing): one file for both rounds
    lines_file = out.parent / "reference_lines.json"
    if not lines_file.exists():
        from train.study.reference_lines import reference_lines

        lines_file.write_text(json.dumps(reference_lines(400), indent=1) + "\n")
    lines = _read(lines_file)
    if not args.report_only and not args.export_best:
        if not (Path(args.model_path) / "config.json").exists():
            raise SystemExit(f"--model-path: no converted model at {args.model_path}; run "
                             "`make smollm2` first")  # fmt: skip
        check_held_out(games, flag="--games")
        check_study_loggers(args.loggers)
        for game in games:
            started = time.perf_counter()
            make_warm_start(game, root, args.model_path, args.loggers)
            measure_warm_start(game, root, recorded.get(game, {}).get("warm_start"))
            print(f"warm start of {game}: {time.perf_counter() - started:.0f} s", flush=True)
            if args.lr_probe:
                for lr in LR_PROBE:
                    cell = probe_cell(game, lr)
                    record = run_cell(cell, root, args.model_path, args.loggers, steps=PROBE_STEPS)
                    print(f"lr probe {game} --lr {lr}: {_state(record)}", flush=True)
                continue
            todo = [c for c in cells((game,)) if chosen(c)]
            for n, cell in enumerate(todo, 1):
                record = run_cell(cell, root, args.model_path, args.loggers)
                print(f"[{n}/{len(todo)}] {cell}: {_state(record)}", flush=True)
    results = summarise(root, recorded, round1)
    if args.export_best:
        check = export_best(root, results, args.model_path, game=EXPORTED_GAME, cell=Cell)
        (out / "export.json").write_text(json.dumps(check, indent=1) + "\n")
    exported = _read(out / "export.json") or None
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results, lines, exported))
    plot(results, lines, out)
    print(f"wrote {out}/results.md, results.json and curves_*.png")
    return 0


def _chosen_cells(
    games: tuple[str, ...], presets: str | None, seeds: str | None
) -> Callable[[Cell], bool]:
    """The filter of ``--presets`` and ``--seeds`` (absent: every cell), refusing a preset that
    none of ``games`` runs and a seed that is not a whole number >= 0."""
    known = {p for game in games for p in GAMES[game]["presets"]}
    wanted = set(presets.split(",")) if presets else known
    if wanted - known:
        unknown = sorted(wanted - known)
        raise SystemExit(f"--presets: unknown {unknown}; choose from {sorted(known)}")
    numbers = seeds.split(",") if seeds else None
    if numbers and not all(n.isdigit() for n in numbers):
        raise SystemExit(f"--seeds: {seeds!r} must be comma-separated whole numbers >= 0")
    kept = {int(n) for n in numbers} if numbers else None
    return lambda cell: cell.preset in wanted and (kept is None or cell.seed in kept)


def _over_seeds(figure: dict[str, Any] | None, signed: bool = False) -> str:
    """A mean over seeds in points with its bootstrap interval. One seed has no interval, and two
    seeds' bootstrap "interval" is only their range (its resamples' means are a, (a + b) / 2 and
    b), so it is printed as a range."""
    if not figure:
        return ""
    sign = "+" if signed else ""
    mean, low, high = (f"{100 * figure[k]:{sign}.0f}" for k in ("mean", "low", "high"))
    if figure["n"] < 2:
        return f"{mean} (one seed)"
    if figure["n"] == 2:
        return f"{mean} (two seeds: {low} to {high})"
    return f"{mean} [{low}, {high}]"


def _state(record: dict[str, Any]) -> str:
    """A launched run's status line: skipped, or its wall time."""
    return "skipped (done)" if record["skipped"] else f"{record['wall_s']:.0f} s"


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


if __name__ == "__main__":
    raise SystemExit(main())
