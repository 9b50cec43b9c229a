"""What fits where: ``train.plan`` over the Qwen3 family, sequence lengths and device counts.

    python benchmarks/plans.py [--models qwen3-0.6b,qwen3-4b] [--lengths 8192] [--devices 1,8]
    python benchmarks/plans.py --propose 141e9 --models qwen3-4b --lengths 16384 --devices 8

For each (model, length, devices) the memory plan of one recipe (below) is compiled on fake CPU
devices (``benchmarks/configs/<model>/config.json``: the released models' architectures), and the
table gives the peak per device and whether it fits an H200 (141 GB = 131.3 GiB) and a TPU v5p
(95 GB = 88.5 GiB). Each plan runs in a process of its own (the device count is fixed when JAX
starts). The recipe, the same for every model: ``--preset mpo`` (actor, critic and reference),
``--compute-dtype bfloat16`` with float32 weights and moments, ``--remat full``, the ``search``
environment; one device: 4 tasks x 4 rollouts, micro-batches of one row; several devices: fsdp
over all of them, 8 tasks x 8 rollouts, one row a device per micro-batch. ``--extra`` adds flags.

``--propose BYTES``: the defaults instead (256 episodes a step, remat, slots and micro-batches
left to the plan) on a device of BYTES (``--platform gpu``), and the settings the plan chose to
fit beside each row, or what it says would fit.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-30b-a3b")
H200, V5P = 141e9, 95e9


def proposal_flags(model: str, length: int, devices: int, memory: float) -> list[str]:
    flags = [
        "--model-path", str(ROOT / "benchmarks" / "configs" / model), "--env", "search",
        "--max-len", str(length), "--devices", str(devices), "--device-memory", str(memory),
        "--platform", "gpu",
    ]  # fmt: skip
    return flags + (["--mesh", f"1,{devices},1"] if devices > 1 else [])


def recipe(model: str, length: int, devices: int, extra: list[str]) -> list[str]:
    flags = [
        "--model-path", str(ROOT / "benchmarks" / "configs" / model), "--env", "search",
        "--preset", "mpo", "--max-len", str(length), "--remat", "full",
        "--compute-dtype", "bfloat16", "--devices", str(devices),
    ]  # fmt: skip
    if devices == 1:
        flags += ["--prompts-per-step", "4", "--group-size", "4", "--minibatches", "4",
                  "--micro-batches", "4"]  # fmt: skip
    else:
        rows = 64 // (4 * devices)  # micro-batches giving one row a device
        flags += ["--mesh", f"1,{devices},1", "--prompts-per-step", "8", "--group-size", "8",
                  "--minibatches", "4", "--micro-batches", str(max(rows, 1))]  # fmt: skip
    return flags + extra


def plan(flags: list[str]) -> tuple[float, str, str]:
    """(peak GiB per device, the program at the peak, the verdict after the peak) of one plan,
    in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "train.plan", *flags], env=env, capture_output=True, text=True
    )
    lines = out.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("peak per device"):
        raise SystemExit(f"train.plan {' '.join(flags)} failed:\n{out.stderr[-3000:]}")
    peak = float(re.search(r"peak per device: ([\d.]+) GiB", lines[-1]).group(1))
    rows = [line for line in lines if line.startswith("| ") and line.count("|") == 5]
    worst = max(rows[1:], key=lambda r: float(r.split("|")[4]))
    verdict = lines[-1].split(": ", 2)[-1]
    return peak, worst.split("|")[1].strip(), verdict


def grid(args) -> itertools.product:
    """(model, tokens, devices) of every plan asked for, models outermost."""
    return itertools.product(
        args.models.split(","),
        [int(x) for x in args.lengths.split(",")],
        [int(x) for x in args.devices.split(",")],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--devices", default="1,8")
    p.add_argument("--extra", default="", help="more train.run flags for every plan")
    p.add_argument("--propose", type=float, default=0.0, help="device bytes: let the plan choose")
    args = p.parse_args()
    extra = args.extra.split()
    if args.propose:
        print(f"defaults; remat, slots, micro-batches chosen by the plan for {args.propose:.3g} B")
        print("| model | tokens | devices | peak GiB / device | verdict |")
        print("|---|---|---|---|---|")
        for model, length, devices in grid(args):
            peak, _, verdict = plan(proposal_flags(model, length, devices, args.propose) + extra)
            # where the weights and moments alone do not fit, no setting was searched: the
            # peak printed is the defaults' (thousands of GiB), not a plan anyone would run
            shown = "–" if "alone take" in verdict else f"{peak:.1f}"
            print(f"| {model} | {length:,} | {devices} | {shown} | {verdict} |", flush=True)
        return
    print(f"recipe: {' '.join(recipe('MODEL', 0, 8, extra)[2:])} (see the docstring)")
    print("| model | tokens | devices | peak GiB / device | at | H200 141 GB | v5p 95 GB |")
    print("|---|---|---|---|---|---|---|")
    for model, length, devices in grid(args):
        peak, worst, _ = plan(recipe(model, length, devices, extra))
        fits = ["fits" if peak * 2**30 <= mem else "no" for mem in (H200, V5P)]
        print(
            f"| {model} | {length:,} | {devices} | {peak:.1f} | {worst} | {fits[0]} | {fits[1]} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
