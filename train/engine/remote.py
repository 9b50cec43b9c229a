"""Episodes played against a [`Generator`][train.engine.generator.Generator] (an inference server):
one thread an episode, its turns as requests, its environment stepped in its own thread.

    out = collect_remote(envs, codec, servers, group_ids=groups, max_len=4096,
                         max_new_tokens=256, temperature=1.0, seed=key, concurrency=32)

Each episode is a task of its own: render the prompt once, then (request a turn with the whole
conversation's ids -> book it -> step the environment -> append the observation's ids) until the
environment ends it or the next turn would not fit in ``max_len``. The server batches the requests
of all episodes continuously (that is its engine's job); ``concurrency`` bounds how many episodes
are in flight, so how many requests the servers hold at once. Episode ``i`` sends its turns with
``affinity=i``: with several servers it stays on one, whose prefix cache holds its conversation.

What comes back is booked exactly as the local engines book theirs (``envs.rollout``): the same
padded batch, the server's log-probs as ``sampler_logp`` (the behaviour policy), each token's
weight version in ``token_versions``. An environment that raises ends its own episode; a server
that fails ([`ServerError`][train.engine.servers.ServerError], after its retries) ends the
collection with that error, naming the server: a rollout without its turns is not a rollout.

Sampling seeds: each turn's request carries ``seed(episode, turn)`` drawn from ``seed``, so a
server that honours per-request seeds (vLLM does) repeats an episode's samples; the batch a server
forms still depends on timing, and its kernels may not be batch-invariant.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from envs.base import Env
from envs.rollout import (
    Rollouts,
    record_failure,
    record_result,
    record_turn,
    start_episodes,
    to_batch,
)

__all__ = ["RemoteStats", "collect_remote", "turn_seed"]


@dataclasses.dataclass
class RemoteStats:
    """What one collection against servers measured."""

    requests: int = 0
    request_s: float = 0.0  # summed over requests (they overlap)
    env_s: float = 0.0
    wall_s: float = 0.0
    sync: dict = dataclasses.field(default_factory=dict)  # the weight push before it, if any

    def figures(self) -> dict[str, float]:
        return {
            "rollout_requests": float(self.requests),
            "rollout_request_mean_s": self.request_s / max(self.requests, 1),
            "rollout_env_s": self.env_s,
            **self.sync,
        }


def turn_seed(seed: Any, episode: int, turn: int) -> int:
    """The request seed of an episode's turn: from a JAX key (``fold_in`` of episode and turn)
    or an int, in [0, 2**31)."""
    if isinstance(seed, jax.Array):
        key = jax.random.fold_in(jax.random.fold_in(seed, episode), turn)
        return int(jax.random.randint(key, (), 0, 2**31 - 1))
    return (int(seed) * 1_000_003 + episode * 10_007 + turn) % (2**31 - 1)


def collect_remote(
    envs: Sequence[Env],
    codec,
    generator,
    *,
    group_ids: Sequence[int],
    max_len: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: Any = 0,
    concurrency: int = 0,
    max_step_keys: int | None = None,
) -> Rollouts:
    """One episode in each env, its turns sampled by ``generator``; returns the padded batch of
    ``envs.rollout.collect`` (the same episodes, in the same order) with ``stats``.

    ``concurrency``: episodes in flight at once (0: all). Raises ``ValueError`` for a negative
    concurrency or a prompt without room for a turn; the generator's error where it fails.
    """
    if concurrency < 0:
        raise ValueError(f"concurrency: must be >= 0, got {concurrency}")
    t0 = time.perf_counter()
    episodes, prompts = start_episodes(envs, codec, group_ids, max_len, max_new_tokens)
    stats = RemoteStats()
    lock = threading.Lock()
    failed = threading.Event()
    end_of_turn = list(getattr(codec, "end_of_turn", ()))
    stops = tuple(codec.stop_ids)

    def play(i: int) -> None:
        ep, env = episodes[i], envs[i]
        while ep.active and not failed.is_set():
            room = max_len - len(ep.tokens)
            started = time.perf_counter()
            gen = generator.generate(
                ep.tokens,
                max_new_tokens=min(max_new_tokens, room),
                temperature=temperature,
                stop_ids=stops,
                seed=turn_seed(seed, i, ep.turns),
                affinity=i,
            )
            took = time.perf_counter() - started
            with lock:
                stats.requests += 1
                stats.request_s += took
            close = record_turn(ep, env, gen.tokens, gen.logprobs, end_of_turn, gen.version)
            if close is None:
                return
            started = time.perf_counter()
            try:
                result = env.step(codec.turn_text(gen.tokens))
            except Exception as e:  # noqa: BLE001  (one broken environment never kills a run)
                record_failure(ep, e)
                return
            finally:
                with lock:
                    stats.env_s += time.perf_counter() - started
            record_result(ep, result, close, codec, max_len, max_new_tokens)

    workers = concurrency or len(envs)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="episode") as pool:
        futures = [pool.submit(play, i) for i in range(len(envs))]
        for future in concurrent.futures.as_completed(futures):
            error = future.exception()
            if error is not None:  # a server failed: stop the others, end with its error
                failed.set()
                for f in futures:
                    f.cancel()
                raise error
    out = to_batch(episodes, envs, codec, group_ids, max_len, max_step_keys, t0)
    stats.wall_s = out.seconds
    out.stats = stats
    return out
