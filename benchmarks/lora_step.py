"""One real-model RL step, full fine-tuning against LoRA: wall time by phase and peak memory.

    python benchmarks/lora_step.py [--model-path models/smollm2-135m-instruct] [--steps 3]
        [--presets grpo,mpo] [--rank 16]

Each (preset, full or LoRA) pair is ``python -m train.run`` in a process of its own, on
GuessTheNumber with the real-model study's settings (16 episodes a step: 4 tasks x 4 rollouts,
``--max-len 1024 --max-new-tokens 48 --micro-batch-tokens 4096 --minibatches 1``, no
evaluation), the same seed, so both draw the same games, and ``--lr 0``: both policies stay the
base (LoRA's merged kernels are then the base's, bit for bit), so both sample the same episodes
and every phase does the same work on both sides (an update's cost does not depend on its
learning rate; the optimizer step still runs). Tokens a step are printed to show it. LoRA: rank
``--rank``, alpha 2 x rank, every projection. The table gives the mean over the steps after the
first (which compiles) of each phase's seconds from ``metrics.jsonl``, and the process's peak
resident memory (its ``ru_maxrss``), then LoRA's ratio to full fine-tuning. Runs take turns
full, LoRA, full, LoRA... so a load drifting on the machine reaches both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "scoring", "credit", "update")
STUDY = [
    "--env", "guess-the-number", "--lr", "0", "--warmup-steps", "2", "--prompts-per-step",
    "4", "--group-size", "4", "--max-len", "1024", "--max-new-tokens", "48",
    "--micro-batch-tokens", "4096", "--minibatches", "1", "--eval-every", "0", "--no-progress",
    "--checkpoint-every", "1000",
]  # fmt: skip

# runs train.run in this process and writes its peak resident memory (KiB) beside the run
CHILD = """
import os, resource, runpy, sys
sys.argv = ["train.run", *sys.argv[1:]]
try:
    runpy.run_module("train.run", run_name="__main__")
finally:
    with open(os.environ["PEAK_FILE"], "w") as f:
        f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
"""


def one_run(model: str, preset: str, rank: int, steps: int) -> dict:
    """Mean seconds of each phase over the steps after the first, and the peak RSS in GiB."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, peak = Path(tmp) / "run", Path(tmp) / "peak"
        flags = [*STUDY, "--model-path", model, "--preset", preset, "--steps", str(steps)]
        if rank:
            flags += ["--lora-rank", str(rank), "--lora-alpha", str(2 * rank)]
        env = {**os.environ, "PEAK_FILE": str(peak), "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-c", CHILD, *flags, "--run-dir", str(run_dir)]
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        later = rows[1:] or rows
        out = {p: statistics.mean(r[f"{p}_s"] for r in later) for p in PHASES}
        out["step"] = sum(out[p] for p in PHASES)
        out["peak_gib"] = int(peak.read_text()) / 2**20
        out["success"] = statistics.mean(r["success_rate"] for r in rows)
        out["tokens"] = [r["tokens"] for r in rows]
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="models/smollm2-135m-instruct")
    p.add_argument("--presets", default="grpo,mpo")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    if not (Path(args.model_path) / "config.json").exists():
        raise SystemExit(f"--model-path: no model at {args.model_path} (make smollm2)")
    results = {}
    for preset in args.presets.split(","):
        for rank in (0, args.rank):
            results[preset, rank] = one_run(args.model_path, preset, rank, args.steps)
            print(f"{preset} {'LoRA' if rank else 'full'}: {results[preset, rank]}", flush=True)
    print(
        f"\n{args.model_path}, GuessTheNumber, 16 episodes a step, mean of steps 2-{args.steps}, "
        f"LoRA rank {args.rank} (alpha {2 * args.rank}, every projection), CPU"
    )
    columns = ("tokens a step", "rollout s", "scoring s", "update s", "step s", "peak GiB")
    print(f"| preset | weights | {' | '.join(columns)} |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        full, lo = results[preset, 0], results[preset, args.rank]
        for name, r in (("full", full), (f"LoRA r{args.rank}", lo)):
            print(
                f"| {preset} | {name} | {'/'.join(map(str, r['tokens']))} | {r['rollout']:.1f} | "
                f"{r['scoring']:.1f} | {r['update']:.1f} | {r['step']:.1f} | {r['peak_gib']:.2f} |"
            )
        print(
            f"| {preset} | LoRA / full | | {lo['rollout'] / full['rollout']:.2f}x | "
            f"{lo['scoring'] / full['scoring']:.2f}x | {lo['update'] / full['update']:.2f}x | "
            f"{lo['step'] / full['step']:.2f}x | {lo['peak_gib'] / full['peak_gib']:.2f}x |"
        )


if __name__ == "__main__":
    main()
