"""The credit-assignment study: presets and ablations side by side on tasks built for credit.

    python -m train.study.round1                # the whole grid (resumable: finished runs skipped)
    python -m train.study.round1 --quick        # a few presets, one seed, short runs (< 10 min)
    python -m train.study.round1 --report-only  # aggregate what is there

Every run goes through the trainer's own CLI (``python -m train.run``) into
``<runs>/<env>/<variant>/seed<k>``; a run that finished has a ``study.json`` beside its
``metrics.jsonl`` and is skipped, and one that was killed is resumed (``--resume``). Independent
runs go ``--jobs`` at a time. Every preset gets the same sizes, learning rates and budget: no
preset is tuned more than another. The aggregate goes to ``--out`` (default
``benchmarks/credit/``, ``benchmarks/credit/quick/`` for ``--quick``): ``results.md`` (tables),
``results.json`` and ``curves_<env>.png`` (mean and 95% bootstrap band over seeds).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from train.core.metrics import read_metrics
from train.core.preflight import check_split_draws
from train.core.trackers import check_loggers
from train.study.stats import bootstrap_ci, mean_band, normalised_auc, steps_to_threshold

__all__ = [
    "VARIANTS",
    "ENVS",
    "SIZES",
    "Cell",
    "grid",
    "run_size",
    "run_cell",
    "thread_limited_env",
    "child_env",
    "compile_cache",
    "check_study_loggers",
    "summarise",
    "refuse_smaller_report",
    "markdown",
    "main",
]

# variant name -> (preset, --algo-set overrides). The MPO ablations are the paper's.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mpo": ("mpo", {}),
    "turn_ppo": ("turn_ppo", {}),
    "ppo": ("ppo", {}),
    "grpo": ("grpo", {}),
    "rloo": ("rloo", {}),
    "gigpo": ("gigpo", {}),
    "trace": ("trace", {}),
    "mpo_trace": ("mpo_trace", {}),
    "mpo_token_ratio": ("mpo", {"ratio_level": "token"}),
    "mpo_beta0": ("mpo", {"beta": 0.0}),
    "mpo_beta0.25": ("mpo", {"beta": 0.25}),
    "mpo_beta1": ("mpo", {"beta": 1.0}),
}
PRESET_VARIANTS = ("mpo", "turn_ppo", "ppo", "grpo", "rloo", "gigpo", "trace", "mpo_trace")
ABLATIONS = ("mpo", "mpo_token_ratio", "mpo_beta0", "mpo_beta0.25", "mpo_beta1")
QUICK_VARIANTS = ("mpo", "turn_ppo", "ppo", "grpo")

ENVS = ("synthetic-nav-longturns", "synthetic-keydoor", "synthetic-nav-noisy")

# The sizes of one run, the same for every preset (flags of train.run), per environment: sized so
# that the whole grid fits about an hour of this project's 2-core CPU (see benchmarks/credit/).
# The entropy bonus is pinned (at 0, the trainer's default when the grid ran) so that a change of
# the trainer's defaults never changes the study's numbers.
_COMMON = {
    "--eval-k": 4,
    "--eval-every": 20,
    "--eval-episodes": 32,
    "--entropy-coef": 0.0,
    "--no-progress": None,
}
_STEP = {"--prompts-per-step": 16, "--group-size": 4}
_LONG = {"--prompts-per-step": 8, "--group-size": 4, "--eval-every": 10, "--eval-episodes": 16}
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        "synthetic-keydoor": {"--steps": 80, **_STEP, **_COMMON},
        "synthetic-nav-noisy": {"--steps": 80, **_STEP, **_COMMON},
        "synthetic-nav-longturns": {"--steps": 40, **_COMMON, **_LONG},
    },
    "quick": {
        "synthetic-keydoor": {"--steps": 40, **_STEP, **_COMMON},
        "synthetic-nav-noisy": {"--steps": 40, **_STEP, **_COMMON},
        "synthetic-nav-longturns": {"--steps": 20, **_COMMON, **_LONG},
    },
    "tiny": {  # for the test of the study itself
        "*": {
            "--steps": 2,
            "--prompts-per-step": 2,
            "--group-size": 2,
            "--eval-every": 1,
            "--eval-episodes": 2,
            "--eval-k": 2,
            "--layers": 1,
            "--width": 32,
            "--heads": 2,
            "--kv-heads": 1,
            "--checkpoint-every": 1,
            "--no-progress": None,
        }
    },
}


def run_size(size: str, env: str) -> dict[str, Any]:
    """The flags of one run of ``env`` at ``size`` (an environment outside the table gets the
    largest-budget entry's flags)."""
    table = SIZES[size]
    if env in table:
        return table[env]
    return table.get("*") or table["synthetic-nav-noisy"]


THRESHOLD = 0.5  # "steps to reach": the first evaluation with held-out success >= this
HELDOUT, FRESH = "eval_heldout_success_rate", "eval_fresh_success_rate"
PAPER_TURN_VARIANCE = 0.895  # MPO paper: median between-turn share of the critic's variance


@dataclasses.dataclass(frozen=True)
class Cell:
    env: str
    variant: str
    seed: int

    def run_dir(self, root: Path) -> Path:
        return Path(root) / self.env / self.variant / f"seed{self.seed}"

    @property
    def group(self) -> str:
        """The report's section the cell belongs to."""
        return self.env


def grid(envs, variants, seeds: int) -> list[Cell]:
    return [Cell(e, v, s) for e in envs for v in variants for s in range(seeds)]


def _flags(size: dict[str, Any]) -> list[str]:
    out = []
    for k, v in size.items():
        out += [k] if v is None else [k, str(v)]
    return out


def finished_record(run_dir: Path) -> dict | None:
    """The ``study.json`` a finished run has beside it (its cell and wall time), or None."""
    marker = run_dir / "study.json"
    return json.loads(marker.read_text()) if marker.exists() else None


def run_cell(
    cell: Cell, root: Path, size: str, *, threads: int = 0, loggers: str | None = None
) -> dict:
    """Runs (or resumes, or skips) one cell through ``python -m train.run`` at ``size``."""
    preset, overrides = VARIANTS[cell.variant]
    sets = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    args = [
        "--env", cell.env, "--preset", preset, "--seed", str(cell.seed),
        *_flags(run_size(size, cell.env)), *(["--algo-set", *sets] if sets else []),
    ]  # fmt: skip
    return launch(
        "train.run", args, cell.run_dir(root), dataclasses.asdict(cell), threads=threads,
        cache=compile_cache(root), loggers=loggers,
    )  # fmt: skip


def compile_cache(root: Path) -> Path:
    """The persistent compilation cache a study's runs under ``root`` share."""
    return Path(root) / "xla-cache"


def thread_limited_env(threads: int) -> dict[str, str]:
    """This process's environment for a child run; with ``threads`` > 0, XLA's CPU thread pool
    kept to that many threads (runs side by side, one per core)."""
    env = dict(os.environ)
    if threads:
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "")
            + f" --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads={threads}"
        )
    return env


def child_env(threads: int = 0, cache: Path | None = None) -> dict[str, str]:
    """A child run's environment: `thread_limited_env`, and JAX's persistent compilation
    cache in ``cache`` unless this process already names one (its own wins)."""
    env = thread_limited_env(threads)
    if cache is not None and "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return env


def launch(
    module: str,
    args: list[str],
    run_dir: Path,
    cell: dict,
    *,
    threads: int = 0,
    cache: Path | None = None,
    loggers: str | None = None,
    resume_flags: list[str] | None = None,
) -> dict:
    """Runs ``python -m <module> <args> --run-dir <run_dir>`` unless it finished (a
    ``study.json`` beside it: skipped) or resumes it (``--resume`` and ``resume_flags``: fields
    a resumed run may change, such as ``--steps``) if it was killed; writes
    ``study.json`` (the cell and the wall time) when it ends. ``threads``: XLA CPU threads.
    ``cache``: JAX's persistent compilation cache, shared by the study's runs (runs that differ
    only in seed compile the same programs: the second one reads them instead of compiling; a
    ``JAX_COMPILATION_CACHE_DIR`` already set wins). ``loggers``: the run's ``--loggers`` (a
    resumed run takes it too: its trackers continue the same tracker runs)."""
    finished = finished_record(run_dir)
    if finished is not None:
        return {**finished, "skipped": True}
    if (run_dir / "config.json").exists():  # killed earlier: continue it with its own config
        cmd = ["--resume", "--run-dir", str(run_dir), *(resume_flags or [])]
    else:
        cmd = [*args, "--run-dir", str(run_dir)]
    if loggers:
        cmd += ["--loggers", loggers]
    env = child_env(threads, cache)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", module, *cmd], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cell}: {module} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    record = {"cell": cell, "wall_s": wall}
    (run_dir / "study.json").write_text(json.dumps(record, indent=2) + "\n")
    return {**record, "skipped": False}


def _curve(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def _late_mean(rows: list[dict], key: str, share: float = 0.2) -> float | None:
    values = [r[key] for r in rows if key in r and np.isfinite(r[key])]
    if not values:
        return None
    return float(np.mean(values[-max(1, int(len(values) * share)) :]))


def run_summary(run_dir: Path) -> dict[str, Any] | None:
    """One run's figures: final and AUC of the held-out and fresh curves, steps to the threshold,
    wall time, late explained variance and turn-variance fraction, mean credit correlations."""
    rows = read_metrics(run_dir)
    finished = finished_record(run_dir)
    if not rows or finished is None:
        return None
    out: dict[str, Any] = {"wall_s": finished["wall_s"]}
    for name, key in (("heldout", HELDOUT), ("fresh", FRESH)):
        steps, values = _curve(rows, key)
        if steps:
            out[f"{name}_final"] = values[-1]
            out[f"{name}_auc"] = normalised_auc(steps, values)
            out[f"{name}_curve"] = [steps, values]
    steps, values = _curve(rows, HELDOUT)
    out["steps_to_threshold"] = steps_to_threshold(steps, values, THRESHOLD) if steps else None
    out["train_success_late"] = _late_mean(rows, "success_rate")
    out["explained_variance"] = _late_mean(rows, "explained_variance")
    out["turn_variance_fraction"] = _late_mean(rows, "turn_variance_fraction")
    for key in sorted({k for r in rows for k in r if k.startswith("credit_corr")}):
        out[key] = _late_mean(rows, key, share=1.0)
    return out


def summarise(root: Path, cells: list[Cell]) -> dict[str, Any]:
    """Per (env, variant): every seed's summary and the mean and 95% bootstrap CI of each
    figure over seeds."""
    by_key: dict[tuple[str, str], list[dict]] = {}
    for cell in cells:
        summary = run_summary(cell.run_dir(root))
        if summary is not None:
            by_key.setdefault((cell.group, cell.variant), []).append(summary)
    out: dict[str, Any] = {}
    for (env, variant), runs in by_key.items():
        figures = {}
        names = sorted({k for r in runs for k in r if not k.endswith("_curve")})
        for name in names:
            values = [r.get(name) for r in runs]
            if name == "steps_to_threshold":
                reached = [v for v in values if v is not None]
                figures[name] = {"reached": len(reached), "of": len(values)}
                if reached:
                    figures[name]["mean"] = float(np.mean(reached))
                continue
            mean, low, high = bootstrap_ci(values)
            figures[name] = {"mean": mean, "low": low, "high": high, "n": len(values)}
        curves = {}
        for name in ("heldout", "fresh"):
            cs = [r[f"{name}_curve"] for r in runs if f"{name}_curve" in r]
            if cs and all(c[0] == cs[0][0] for c in cs):
                mean, low, high = mean_band([c[1] for c in cs])
                curves[name] = {
                    "steps": cs[0][0],
                    "mean": mean.tolist(),
                    "low": low.tolist(),
                    "high": high.tolist(),
                }
        out.setdefault(env, {})[variant] = {
            "figures": figures,
            "curves": curves,
            "seeds": len(runs),
        }
    return out


def runs_in(results: dict[str, Any]) -> int:
    """How many finished runs a report's ``results`` were made from (every group's variants'
    seeds)."""
    return sum(entry["seeds"] for group in results.values() for entry in group.values())


def refuse_smaller_report(out_dir: Path, results: dict[str, Any], root: Path) -> None:
    """Raises ``SystemExit`` rather than let ``results`` replace the report in ``out_dir`` when
    they were made from fewer runs than it was. Run directories hold checkpoints and stay on the
    machine that ran them, so on a fresh clone the committed report is the only copy of hours of
    runs: ``--report-only`` there would otherwise rewrite it from nothing."""
    committed = Path(out_dir) / "results.json"
    if not committed.exists():
        return
    before = runs_in(json.loads(committed.read_text()).get("results", {}))
    now = runs_in(results)
    if now < before:
        raise SystemExit(
            f"--runs: {root} holds {now} finished runs of this study, and the report in {out_dir} "
            f"was made from {before}: it was left as it is (run the missing cells, or name another "
            "--out for a report of these runs alone)"
        )


def _ci(fig: dict | None, pct: bool = True) -> str:
    if not fig or not np.isfinite(fig.get("mean", np.nan)):
        return "–"
    k = 100 if pct else 1
    fmt = "{:.0f}" if pct else "{:.2f}"
    text = fmt.format(fig["mean"] * k)
    if fig.get("n", 1) > 1:
        text += " [" + fmt.format(fig["low"] * k) + ", " + fmt.format(fig["high"] * k) + "]"
    return text


def markdown(results: dict[str, Any], size: str, variants) -> str:
    lines = [
        "# Credit-assignment study: results",
        "",
        "Written by `python -m train.study.round1`; numbers are means over seeds with 95% "
        "bootstrap intervals in brackets. Success in %. Held-out = task instances training never "
        "draws; "
        "fresh = new episodes of the training instances. AUC = mean success over the evaluation "
        "curve. Steps to 50% = first evaluation with held-out success >= 50% (seeds that reached "
        "it / seeds). EV = the critic's explained variance, TVF = the between-turn share of its "
        "variance (MPO paper: 89.5%), both over the last 20% of steps. corr = correlation of the "
        "run's own advantage on each turn's decisive token with the task's ground-truth grade "
        "of that decision.",
        "",
    ]
    for env, by_variant in results.items():
        lines += [
            f"## {env}",
            "",
            f"Run size (every preset alike): `{' '.join(_flags(run_size(size, env)))}`",
            "",
            "| variant | held-out final | held-out AUC | fresh final | fresh AUC | steps to 50% "
            "| EV | TVF | corr | wall s | seeds |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for variant in variants:
            if variant not in by_variant:
                continue
            f = by_variant[variant]["figures"]
            reach = f.get("steps_to_threshold", {})
            reach_text = (
                f"{reach['mean']:.0f} ({reach['reached']}/{reach['of']})"
                if reach.get("reached")
                else f"– (0/{reach.get('of', 0)})"
            )
            wall = f.get("wall_s", {}).get("mean", float("nan"))
            lines.append(
                f"| {variant} | {_ci(f.get('heldout_final'))} | {_ci(f.get('heldout_auc'))} "
                f"| {_ci(f.get('fresh_final'))} | {_ci(f.get('fresh_auc'))} | {reach_text} "
                f"| {_ci(f.get('explained_variance'), False)} "
                f"| {_ci(f.get('turn_variance_fraction'))} | {_ci(f.get('credit_corr'), False)} "
                f"| {wall:.0f} | {by_variant[variant]['seeds']} |"
            )
        probes = by_variant.get("mpo", {}).get("figures", {})
        probe_names = sorted(k for k in probes if k.startswith("credit_corr_"))
        if probe_names:
            lines += [
                "",
                "Credit quality on the same batches (the `mpo` runs' rollouts and critic): "
                "correlation of each estimator's advantage on the decisive tokens with the "
                "ground-truth grade.",
                "",
                "| " + " | ".join(n.removeprefix("credit_corr_") for n in probe_names) + " |",
                "|" + "---|" * len(probe_names),
                "| " + " | ".join(_ci(probes[n], False) for n in probe_names) + " |",
            ]
        lines.append("")
    return "\n".join(lines)


ROUND1_PANELS = (("presets", PRESET_VARIANTS), ("MPO ablations", ABLATIONS))


def plot(results: dict[str, Any], out_dir: Path, panels=ROUND1_PANELS) -> list[Path]:
    """One figure per section: a column per panel (title, variants), held-out and fresh rows."""
    from train.study import figures

    paths = []
    for env, by_variant in results.items():
        fig, axes = figures.panels(2, len(panels), figsize=(6 * len(panels), 8), sharex=True,
                                   sharey=True)  # fmt: skip
        for col, (title, names) in enumerate(panels):
            for row, curve in enumerate(("heldout", "fresh")):
                ax = axes[row][col]
                for variant in names:
                    c = by_variant.get(variant, {}).get("curves", {}).get(curve)
                    if c:
                        figures.band(ax, c["steps"], c["mean"], c["low"], c["high"], label=variant)
                figures.rate_axes(ax, f"{env}: {title}, {curve} success", f"{curve} success rate")
        paths.append(figures.save(fig, out_dir / f"curves_{env.replace('/', '_')}.png"))
    return paths


def check_held_out(names, *, flag: str) -> None:
    """Each environment of a study draws a held-out task before the study's first run
    ([`train.core.preflight.check_split_draws`][train.core.preflight.check_split_draws]);
    ``SystemExit`` naming ``flag`` if not."""
    for name in names:
        try:
            check_split_draws(name, {"split": "test"}, flag="--eval-split")
        except ValueError as e:
            raise SystemExit(f"{flag}: {e}") from e


LOGGERS_HELP = (
    "trackers of every run, train.run's --loggers (default jsonl,tensorboard; e.g. "
    "jsonl,tensorboard,wandb)"
)


def check_study_loggers(loggers: str | None) -> None:
    """The studies' ``--loggers`` refused before the first run (unknown or not installed)."""
    if loggers:
        try:
            check_loggers(loggers)
        except ValueError as e:
            raise SystemExit(f"--{e}") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.study.round1", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="few presets, one seed, short runs")
    parser.add_argument("--size", choices=sorted(SIZES), help="run size (default: full, or quick)")
    parser.add_argument("--envs", help="comma-separated environments (default: the study's three)")
    parser.add_argument(
        "--variants", help="comma-separated variants (default: all, or the quick set)"
    )
    parser.add_argument("--seeds", type=int, help="seeds a cell (default 3; 1 with --quick)")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side (default 2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="XLA CPU threads a run when --jobs > 1 (0: XLA's default)",
    )
    parser.add_argument("--runs", help="where the runs go (default runs/study[-quick])")
    parser.add_argument("--out", help="where the report goes (default benchmarks/credit[/quick])")
    parser.add_argument("--report-only", action="store_true", help="aggregate existing runs only")
    parser.add_argument("--loggers", help=LOGGERS_HELP)
    args = parser.parse_args(argv)
    size_name = args.size or ("quick" if args.quick else "full")
    env_names = args.envs.split(",") if args.envs else list(ENVS)
    variants = (
        args.variants.split(",")
        if args.variants
        else list(QUICK_VARIANTS if args.quick else VARIANTS)
    )
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    seeds = args.seeds or (1 if args.quick else 3)
    root = Path(args.runs or ("runs/study-quick" if args.quick else "runs/study"))
    out_dir = Path(args.out or ("benchmarks/credit/quick" if args.quick else "benchmarks/credit"))
    cells = grid(env_names, variants, seeds)
    started = time.perf_counter()
    if not args.report_only:
        check_held_out(env_names, flag="--envs")
        check_study_loggers(args.loggers)
        threads = args.threads if args.jobs > 1 else 0
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
            run = partial(
                run_cell, root=root, size=size_name, threads=threads, loggers=args.loggers
            )
            futures = {pool.submit(run, c): c for c in cells}
            for n, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                rec = fut.result()
                state = "skipped (done)" if rec["skipped"] else f"{rec['wall_s']:.0f} s"
                print(f"[{n}/{len(cells)}] {futures[fut]}: {state}", flush=True)
    results = summarise(root, cells)
    refuse_smaller_report(out_dir, results, root)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "size": size_name,
        "flags": {e: _flags(run_size(size_name, e)) for e in env_names},
        "seeds": seeds,
        "jobs": args.jobs,
        # this call's wall time (None for --report-only) and the runs' own, summed
        "wall_s": None if args.report_only else time.perf_counter() - started,
        "runs_wall_s": sum(
            record["wall_s"]
            for record in (finished_record(c.run_dir(root)) for c in cells)
            if record is not None
        ),
    }
    (out_dir / "results.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1) + "\n"
    )
    (out_dir / "results.md").write_text(markdown(results, size_name, variants))
    plot(results, out_dir)
    took = time.perf_counter() - started
    print(f"wrote {out_dir}/results.md, results.json and curves_*.png in {took:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
