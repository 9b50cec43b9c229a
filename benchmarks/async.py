"""Asynchronous rollouts against the synchronous loop: steps/s, where the time goes, staleness.

    python benchmarks/async.py [--envs synthetic-nav,search] [--staleness 0,1,2] [--steps 12]

Each (environment, K) is one ``python -m train.run --env ENV --max-staleness K`` with otherwise
default flags (K = 0 is the synchronous loop), in this session, one after another: the embedded tiny
model on the synthetic tasks, and on the chat environments the newcomer's random Qwen3-shaped
checkpoint of ``benchmarks/step.py`` (real vocabulary, 2 tasks x 2 rollouts). The table reads the
runs' ``metrics.jsonl``, medians over the steps after the first ``--warmup`` (compilation): steps/s
and its ratio to K = 0, the worker's generation time, the learner's wait for a batch, the update's
and scoring's time, the mean staleness, and the final training success.

On one device the worker and the learner take turns on it (a first-come-first-served lock), so the
overlap is only host work (the environments, the tokenizer, Python) against device work. On an
accelerator with generation and learning on separate devices the two overlap entirely; the last
column predicts that case from the synchronous run's own phases: a step would take ``max(rollout,
learner)`` instead of ``rollout + learner`` (learner = scoring + credit + update), so ``(rollout +
learner) / max(rollout, learner)`` is the speed-up bounded staleness buys there.

``--seeds 0,1,2 --success`` asks the other question, whether staleness costs learning: each
(environment, K, seed) is the run at its default size with its default evaluations, and a second
table gives the final held-out success per K (mean over seeds, bootstrap interval) and its
difference from K = 0 paired by seed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHAT_ENVS = ("search", "bfcl", "tau2-retail", "tau2-airline")


def run(
    env: str, k: int, steps: int | None, seed: int, extra: list[str], threads: int = 0
) -> tuple[list[dict], float]:
    """(metrics rows, wall seconds) of one run; ``steps`` None: the run's default size and
    evaluations; ``threads``: XLA CPU threads (0: XLA's default)."""
    from train.study.round1 import thread_limited_env

    with tempfile.TemporaryDirectory() as tmp:
        if env in CHAT_ENVS:  # the newcomer's random Qwen3-shaped checkpoint (benchmarks/step.py)
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from step import write_checkpoint

            write_checkpoint(Path(tmp) / "ckpt")
            extra = ["--model-path", f"{tmp}/ckpt", "--prompts-per-step", "2",
                     "--group-size", "2", *extra]  # fmt: skip
        if steps is not None:
            extra = ["--steps", str(steps), "--eval-every", "0", "--checkpoint-every", str(steps),
                     *extra]  # fmt: skip
        cmd = [
            sys.executable, "-m", "train.run", "--env", env, "--max-staleness", str(k),
            "--seed", str(seed), "--no-progress", "--run-dir", f"{tmp}/run", *extra,
        ]  # fmt: skip
        start = time.perf_counter()
        env_vars = thread_limited_env(threads)
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env_vars)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").open()]
    return rows, wall


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--envs", default="synthetic-nav,search")
    p.add_argument("--staleness", default="0,1,2", help="comma-separated K (0: synchronous)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out (compilation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default="0,1,2", help="--success: comma-separated seeds")
    p.add_argument("--jobs", type=int, default=1, help="--success: runs side by side")
    p.add_argument(
        "--success", action="store_true",
        help="final held-out success per K at the run's default size, over --seeds",
    )  # fmt: skip
    p.add_argument("extra", nargs="*", help="more train.run flags (after --)")
    args = p.parse_args()
    ks = [int(k) for k in args.staleness.split(",")]
    if args.success:
        seeds = [int(x) for x in args.seeds.split(",")]
        return success_table(args.envs.split(","), ks, seeds, args.extra, args.jobs)
    print(f"train.run, tiny model, {args.steps} steps, medians over steps {args.warmup + 1}.."
          f"{args.steps}; seconds per step")  # fmt: skip
    print()
    head = ("| env | K | steps/s | x sync | rollout/generate s | learner wait s | scoring s "
            "| update s | staleness | success | predicted x (separate devices) |")  # fmt: skip
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for env in args.envs.split(","):
        base = None
        for k in ks:
            rows, _ = run(env, k, args.steps, args.seed, args.extra)
            late = rows[args.warmup :]
            rate = _median(late, "steps_per_s")
            base = rate if k == 0 else base
            gen = _median(late, "worker_generate_s" if k else "rollout_s")
            learner = [r["scoring_s"] + r["credit_s"] + r["update_s"] for r in late]
            predicted = "–"
            if k == 0:
                roll = _median(late, "rollout_s")
                learn = statistics.median(learner)
                predicted = f"{(roll + learn) / max(roll, learn):.2f}"
            ratio = f"{rate / base:.2f}" if base else "–"
            wait = _median(late, "learner_wait_s") if k else 0.0
            print(
                f"| {env} | {k} | {rate:.3f} | {ratio} | {gen:.2f} | {wait:.2f} "
                f"| {_median(late, 'scoring_s'):.2f} | {_median(late, 'update_s'):.2f} "
                f"| {_median(late, 'staleness_mean') if k else 0:.2f} "
                f"| {statistics.mean(r['success_rate'] for r in rows[-3:]):.2f} | {predicted} |",
                flush=True,
            )


def success_table(
    envs: list[str], ks: list[int], seeds: list[int], extra: list[str], jobs: int = 1
) -> None:
    """Final held-out success per (environment, K) over seeds, and its difference from K = 0
    paired by seed (mean and bootstrap interval); ``jobs`` runs side by side, one XLA thread
    each."""
    from train.study.stats import bootstrap_ci

    print(f"train.run at its default size per K, seeds {seeds}: final held-out success")
    print()
    print("| env | K | final success per seed | mean [95% interval] | minus K = 0, paired "
          "[interval] | wall s per run |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    cells = [(env, k, seed) for env in envs for k in ks for seed in seeds]
    threads = 1 if jobs > 1 else 0

    def one(cell):
        env, k, seed = cell
        return run(env, k, None, seed, extra, threads)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        done = dict(zip(cells, pool.map(one, cells), strict=True))
    key = "eval_heldout_success_rate"
    for env in envs:
        base = None
        for k in ks:
            finals = [[r[key] for r in done[(env, k, s)][0] if key in r][-1] for s in seeds]
            walls = [done[(env, k, s)][1] for s in seeds]
            base = finals if k == 0 else base
            mean, lo, hi = bootstrap_ci(finals)
            diff = "–"
            if k and base:
                d, dlo, dhi = bootstrap_ci([a - b for a, b in zip(finals, base, strict=True)])
                diff = f"{d:+.3f} [{dlo:+.3f}, {dhi:+.3f}]"
            print(
                f"| {env} | {k} | {', '.join(f'{x:.3f}' for x in finals)} | {mean:.3f} "
                f"[{lo:.3f}, {hi:.3f}] | {diff} | {statistics.median(walls):.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
