"""Which tasks a step draws, and which tasks fit the length budget.

A step's ``prompts`` tasks are seeded ``offset + seed * 1_000_003 + step * prompts + p``, so a
resumed run sees the same data as an uninterrupted one; each process builds its share of them
(`train.core.distributed.host_share`) with ``group`` rollouts each, and the group ids are
global.

Before a run starts, `length_budget` sizes ``--max-len`` from the environment's longest
episode and `fit_tasks` checks every task of a split: its prompt plus one turn must fit.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

import envs
from train.core.distributed import host_share

__all__ = [
    "make_episodes",
    "sampling_key",
    "TRAIN_STREAM",
    "EVAL_STREAM",
    "EVAL_TASK_OFFSET",
    "DEFAULT_MAX_LEN",
    "length_budget",
    "fit_tasks",
]

# Streams of sampling keys: fold_in(key(seed), stream) then the step and the process, so that no
# evaluation shares a key with a training step, and no process with another.
TRAIN_STREAM, EVAL_STREAM = 0, 1

# The length budget of environments that cannot say how long their longest episode is.
DEFAULT_MAX_LEN = 8192

EVAL_TASK_OFFSET = 10**9  # evaluation task seeds (their split already keeps them held out)


def sampling_key(seed: int, stream: int, step: int, process: int) -> jax.Array:
    """The sampling key of one rollout: its own stream per (purpose, step, process)."""
    key = jax.random.fold_in(jax.random.key(seed), stream)
    return jax.random.fold_in(jax.random.fold_in(key, step), process)


def make_episodes(
    env: str, *, seed: int, step: int, prompts: int, group: int, options: dict, offset: int = 0
):
    """(environments, group ids) of this process's share of one step's episodes."""
    base = offset + seed * 1_000_003 + step * prompts
    out, groups = [], []
    for p in range(prompts)[host_share(prompts, what="tasks")]:
        for _ in range(group):
            out.append(envs.make(env, seed=base + p, **options))
            groups.append(p)
    return out, groups


def length_budget(max_len: int, env, codec, *, name: str, say: Callable[[str], None]) -> int:
    """``max_len``, or (0) the environment's longest episode (`DEFAULT_MAX_LEN` where it
    cannot say); says so when a given budget cannot hold the longest episode."""
    longest = env.max_episode_tokens(codec)
    if not max_len:
        return int(longest or DEFAULT_MAX_LEN)
    if longest and max_len < longest:
        say(
            f"warning: --max-len {max_len} cannot hold the longest episode of {name} "
            f"({longest} tokens): such episodes are cut by length (logged as length_cut_frac); "
            "leave --max-len at 0 to size it from the environment"
        )
    return max_len


def fit_tasks(
    env,
    codec,
    options: dict,
    *,
    name: str,
    max_len: int,
    max_new_tokens: int,
    drop: bool,
    say: Callable[[str], None],
) -> None:
    """Checks every task of ``env``'s split: its prompt plus one turn (and the end-of-turn
    token) must fit ``max_len``. Raises ``ValueError`` naming the flags, or with ``drop`` leaves
    the tasks that cannot fit out (``options['exclude_tasks']``) and says how many."""
    prompts = env.task_prompts()
    if prompts is None:
        return
    room = max_new_tokens + len(getattr(codec, "end_of_turn", ()))
    lengths = {task: len(codec.prompt(m, t)) for task, m, t in prompts}
    too_long = sorted(task for task, n in lengths.items() if n + room > max_len)
    if not too_long:
        return
    what = (
        f"{len(too_long)} of the {len(lengths)} {options.get('split', 'train')} tasks of {name} "
        f"do not fit: their prompt (the longest {max(lengths.values())} tokens) plus one turn of "
        f"--max-new-tokens {max_new_tokens} exceeds --max-len {max_len}"
    )
    if not drop or len(too_long) == len(lengths):
        leave = "" if drop else ", or pass --drop-long-tasks to leave them out"
        raise ValueError(f"max_len: {what}; raise --max-len or lower --max-new-tokens{leave}")
    say(f"--drop-long-tasks: {what}; dropped them")
    options["exclude_tasks"] = too_long
