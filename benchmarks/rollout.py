"""The rollout loop's own overhead: episodes per second with a scripted policy (no model).

    python benchmarks/rollout.py [--env synthetic-nav --episodes 256 --reps 5]

A scripted optimal policy plays every episode, so the time is the host loop, the environments and
the batch assembly alone: the cost the loop adds on top of the sampler.
"""

from __future__ import annotations

import argparse
import statistics
import time

import envs
from envs.rollout import collect
from envs.scripted import ScriptedPolicy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="synthetic-nav")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    times, turns = [], 0
    for rep in range(args.reps):
        batch = [envs.make(args.env, seed=rep * args.episodes + i) for i in range(args.episodes)]
        codec = batch[0].codec
        policy = ScriptedPolicy(codec, lambda i, batch=batch: batch[i].optimal_turn())
        t0 = time.perf_counter()
        out = collect(
            batch,
            codec,
            policy,
            group_ids=list(range(args.episodes)),
            max_len=args.max_len,
            max_new_tokens=batch[0].turn_length,
        )
        times.append(time.perf_counter() - t0)
        turns = sum(e["turns"] for e in out.episodes)
    t = statistics.median(times)
    print(
        f"{args.env}: {args.episodes} episodes ({turns} turns) in {t * 1e3:.1f} ms (median of "
        f"{args.reps}): {args.episodes / t:,.0f} episodes/s, {turns / t:,.0f} turns/s"
    )


if __name__ == "__main__":
    main()
