"""The length trap: how far a turn's log-ratio drifts under staleness, by turn length.

    python benchmarks/length_trap.py [--staleness 0,1,4] [--steps 10] [--init-from DIR]

A product (sum-of-logs) turn ratio grows with the turn's length: a drift of 0.01 nats a token is
0.64 nats (ratio 1.9, outside any clip range) over a 64-token turn, while the length-normalised
(mean) ratio stays at 0.01. This benchmark measures the drift that staleness causes: it runs
``train.run``'s trainer on ``synthetic-calls-varlen`` (turns of 1 to 65 tokens that the policy
ends itself) with ``--max-staleness K`` and the ``reuse`` update regime (4 epochs x 4
minibatches, so each step moves the policy), and at every step records, for each turn, the
behaviour-vs-learner log-ratio Σ_t (log π_learner - log π_sampler) over the turn's tokens, i.e.
how far the policy that will be updated has moved from the one that sampled. The table gives,
per K and turn-length bin, the median and 90th percentile of |Σ log r| (the product ratio's log)
and of |mean log r| (the length-normalised one), and the share of turns whose product ratio lies
outside PPO's clip range [0.8, 1.28] (such a turn is clipped whole, before the update has done
anything). K = 0 measures the sampler's numerics alone.

``--init-from`` starts from a warm start (``python -m train.sft --env synthetic-calls-varlen
--demo-noise 0.25``; the default is a random tiny model, whose turns are mostly full length).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BINS = ((1, 8), (9, 16), (17, 32), (33, 65))
CLIP = (np.log(0.8), np.log(1.28))


def turn_ratios(batch) -> tuple[np.ndarray, np.ndarray]:
    """(turn lengths, Σ log r per turn) of a scored batch: learner (old_logp) over sampler."""
    mask, tid = np.asarray(batch.loss_mask), np.asarray(batch.turn_ids)
    gap = np.where(mask, np.asarray(batch.old_logp) - np.asarray(batch.sampler_logp), 0.0)
    lengths, sums = [], []
    for row in range(mask.shape[0]):
        for turn in np.unique(tid[row][mask[row]]):
            on = mask[row] & (tid[row] == turn)
            lengths.append(int(on.sum()))
            sums.append(float(gap[row][on].sum()))
    return np.asarray(lengths), np.asarray(sums)


def measure(k: int, steps: int, seed: int, init_from: str | None) -> tuple[np.ndarray, np.ndarray]:
    from train.core import trainer as trainer_module
    from train.core.config import parse_args

    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--env", "synthetic-calls-varlen", "--preset", "mpo", "--max-staleness", str(k),
                 "--epochs", "4", "--minibatches", "4", "--steps", str(steps), "--seed", str(seed),
                 "--lr", "1e-3", "--critic-lr", "2e-3", "--entropy-coef", "0",
                 "--warmup-steps", "0", "--eval-every", "0", "--no-progress",
                 "--run-dir", tmp]  # fmt: skip
        if init_from:
            flags += ["--init-from", init_from]
        trainer = trainer_module.Trainer(parse_args(flags))
        seen: list[tuple[np.ndarray, np.ndarray]] = []
        score = trainer.score

        def recording(rollouts):
            batch, scored = score(rollouts)
            seen.append(turn_ratios(batch))
            return batch, scored

        trainer.score = recording
        results = trainer.run_async(range(steps)) if k else (trainer.step(s) for s in range(steps))
        for _ in results:
            pass
    # the first K + 1 steps are sampled before the worker can run K versions ahead
    lengths = np.concatenate([s[0] for s in seen[k + 1 :]])
    sums = np.concatenate([s[1] for s in seen[k + 1 :]])
    return lengths, sums


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--staleness", default="0,1,4")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", help="a warm start (train.sft run directory)")
    args = p.parse_args()
    print(f"synthetic-calls-varlen, mpo, reuse (4 x 4), {args.steps} steps (first K + 1 left out), "
          f"start: {args.init_from or 'random tiny model'}")  # fmt: skip
    print()
    print("| K | turn tokens | turns | abs Σ log r p50 | p90 | abs mean log r p50 | p90 "
          "| product ratio outside [0.8, 1.28] |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for k in (int(x) for x in args.staleness.split(",")):
        lengths, sums = measure(k, args.steps, args.seed, args.init_from)
        for lo, hi in BINS:
            sel = (lengths >= lo) & (lengths <= hi)
            if not sel.any():
                continue
            s, m = np.abs(sums[sel]), np.abs(sums[sel] / lengths[sel])
            outside = np.mean((sums[sel] < CLIP[0]) | (sums[sel] > CLIP[1]))
            print(
                f"| {k} | {lo}-{hi} | {int(sel.sum())} | {np.median(s):.3f} "
                f"| {np.quantile(s, 0.9):.3f} | {np.median(m):.4f} | {np.quantile(m, 0.9):.4f} "
                f"| {100 * outside:.0f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
