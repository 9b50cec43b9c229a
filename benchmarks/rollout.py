"""The rollout loop's own overhead: episodes per second with a scripted optimal policy (no model).

    python benchmarks/rollout.py [--envs search bfcl ...] [--tasks 16 --group 4 --reps 3]

Every episode is played by the environment's oracle, so the time is the host loop, the
environments' tools and the token bookkeeping alone: what the loop adds on top of the sampler.
Baseline, measured in the same run: the same oracle episodes played directly on the environments
(``reset`` + ``step``, no tokenizer, no batch), so ``loop / env`` is the loop's own cost factor.
The real-data environments use the Qwen3 tokenizer and chat template; ``synthetic-nav`` its word
codec. Each run draws fresh tasks (``--tasks`` x ``--group`` rollouts, as a training step does),
so per-task work (a prompt rendered once per group, tau2's gold database) is paid as in training.
Medians of ``--reps`` runs; environments are built outside the timed region.
"""

from __future__ import annotations

import argparse
import statistics
import time

import envs
from envs.checks import play_episode
from envs.rollout import collect
from envs.scripted import ScriptedPolicy, oracle_act

MAX_LEN = {"synthetic-nav": 64}


def _codec(env, chat):
    return getattr(env, "codec", None) or chat


def _make(name, tasks, group, seed):
    return [envs.make(name, seed=seed + i // group) for i in range(tasks * group)]


def _loop(name, tasks, group, seed, chat):
    batch = _make(name, tasks, group, seed)
    episodes = len(batch)
    codec = _codec(batch[0], chat)
    acts: dict[int, object] = {}

    def act(i):
        if i not in acts:
            acts[i] = oracle_act(batch[i])
        return acts[i]()

    policy = ScriptedPolicy(codec, act)
    t0 = time.perf_counter()
    out = collect(
        batch,
        codec,
        policy,
        group_ids=[i // group for i in range(episodes)],
        max_len=MAX_LEN.get(name, 16_384),
        max_new_tokens=getattr(batch[0], "turn_length", 1_024),
    )
    seconds = time.perf_counter() - t0
    turns = sum(e["turns"] for e in out.episodes)
    tokens = sum(e["tokens"] for e in out.episodes)
    success = sum(e["success"] for e in out.episodes) / episodes
    return seconds, turns, tokens, success


def _direct(name, tasks, group, seed):
    batch = _make(name, tasks, group, seed)
    t0 = time.perf_counter()
    for env in batch:
        act = oracle_act(env)  # read lazily, after play_episode's reset
        play_episode(env, lambda _env, act=act: act(), limit=10_000)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--envs",
        nargs="+",
        default=["synthetic-nav", "search", "bfcl", "tau2-retail", "tau2-airline"],
    )
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    from envs.chat import ChatFormat, load_tokenizer

    chat = ChatFormat(load_tokenizer())
    episodes = args.tasks * args.group
    print(f"{args.tasks} tasks x {args.group} oracle rollouts per run, median of {args.reps}\n")
    print(
        "| env | turns/ep | tokens/ep | success | loop ms | env-only ms | loop / env | episodes/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.envs:
        _loop(name, 2, 1, 10**6, chat)  # warm-up: loads the data, reads (or builds) the index
        seeds = [1 + rep * args.tasks for rep in range(args.reps)]  # fresh tasks every run
        runs = [_loop(name, args.tasks, args.group, s, chat) for s in seeds]
        loop_s = statistics.median(r[0] for r in runs)
        seeds = [10**5 + s for s in seeds]
        env_s = statistics.median(_direct(name, args.tasks, args.group, s) for s in seeds)
        _, turns, tokens, success = runs[0]
        print(
            f"| {name} | {turns / episodes:.1f} | {tokens / episodes:,.0f} | "
            f"{success:.0%} | {loop_s * 1e3:,.1f} | {env_s * 1e3:,.1f} | {loop_s / env_s:.2f}x | "
            f"{episodes / loop_s:,.0f} |"
        )


if __name__ == "__main__":
    main()
