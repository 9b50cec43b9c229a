"""Continuous batching over episodes: decode slots, chunks of decode steps, and environments
stepped concurrently between chunks.

    out = collect_continuous(envs, codec, sampler, group_ids=groups, max_len=4096,
                             max_new_tokens=256, slots=16, chunk=32, env_workers=8)

The lockstep loop (``envs.rollout.collect``) runs rounds: every live episode's turn in one
generate call, then every environment, then the next round, so each round waits for its longest
turn and the device idles while tools run. Here a [`Sampler`][train.engine.sampler.Sampler] holds
``slots`` rows of KV cache (opened once) and the host loop between device programs does:

1. **admit**: a free slot takes the next episode not started (its row is reset and its prompt
   prefilled); more episodes may be in flight than there are slots;
2. **answers**: environments that answered (a thread pool of ``env_workers``; 0 steps them
   inline, in slot order) get their observation prefilled on top of the slot's cached prefix,
   or free the slot when the episode ended; one that raised, or did not answer within
   ``env_timeout`` seconds, ends its own episode (truncated, ``env_exception`` says why);
3. **prefill** the slots that got new ids, in one call over those rows only (their count
   padded to a power of two, widths bucketed, chunked);
4. **decode** one chunk of at most ``chunk`` steps over every slot, each decoding slot with the
   rest of its turn's budget; a slot whose turn ended (stop id, budget, or no room) hands the
   turn's text to its environment. While it waits it keeps its slot and cache, unless
   ``recompute`` is on and other episodes wait for a slot: then the slot goes to them and the
   episode, once answered, queues for a slot again (ahead of new episodes) and prefills its
   whole conversation anew (the prefix recomputed instead of held).

Between chunks ``publish()`` (if given) may return new weights ``(state, version)``; every
sampled token records the version that sampled it (``Rollouts.token_versions``), so a turn may
straddle an update.

Each episode samples from a random stream of its own: its token at cache position p is drawn
with ``fold_in(fold_in(key(seed), episode), p)``, as in lockstep's rounds (``envs.rollout``).
So which slot, chunk or call samples a token does not change it: with ``slots`` = episodes,
``chunk`` = ``max_new_tokens`` and ``env_workers`` = 0 the rollouts equal ``collect``'s bit for
bit, and with fewer slots, shorter chunks, threads or a recomputed prefix the sampled tokens
are still lockstep's wherever the logits are (tested on the CPU; a backend whose matmuls round
differently with the batch's size may move a token where two are within a rounding).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from envs.base import Env
from envs.rollout import (
    Rollouts,
    record_failure,
    record_result,
    record_turn,
    start_episodes,
    to_batch,
)

__all__ = ["REFILL", "EngineStats", "collect_continuous"]

# The default early chunk end (``refill``): measured on the CPU, side by side with chunks run to
# their end, it gave more episodes/s at 0 and 0.2 s tool latency, with a slot per episode and
# with half as many (benchmarks/README.md), once a prefill call ran only the rows that need it.
REFILL = 0.5


@dataclasses.dataclass
class EngineStats:
    """What one collection did with its slots and its time.

    ``utilisation``: the share of slot-steps of the decode chunks that sampled a live token;
    ``contended_utilisation``: the same over the chunks that started while an episode waited
    for a slot (every slot held: what the scheduler loses to turns ending inside a chunk and to
    slots held through tool calls, without the step's drain, when fewer episodes are left than
    slots); ``device_idle``: the share of the wall time outside the device programs (prefill,
    decode).
    """

    slots: int
    chunks: int = 0
    slot_steps: int = 0
    live_steps: int = 0
    contended_slot_steps: int = 0  # of the chunks started while an episode waited for a slot
    contended_live_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    env_wait_s: float = 0.0  # blocked with nothing to decode, waiting for an environment
    recomputed: int = 0  # conversations prefilled anew after giving their slot up
    swaps: int = 0  # new weights taken between chunks
    wall_s: float = 0.0

    @property
    def utilisation(self) -> float:
        return self.live_steps / self.slot_steps if self.slot_steps else 0.0

    @property
    def contended_utilisation(self) -> float:
        steps = self.contended_slot_steps
        return self.contended_live_steps / steps if steps else 0.0

    @property
    def device_idle(self) -> float:
        busy = self.prefill_s + self.decode_s
        return max(0.0, 1.0 - busy / self.wall_s) if self.wall_s else 0.0

    def figures(self) -> dict[str, float]:
        return {
            "engine_utilisation": self.utilisation,
            "engine_utilisation_contended": self.contended_utilisation,
            "engine_chunks": float(self.chunks),
            "engine_recomputed": float(self.recomputed),
            "engine_swaps": float(self.swaps),
            # wall-clock figures: named as the rollout phase's timings
            "rollout_device_idle_frac": self.device_idle,
            "rollout_env_wait_s": self.env_wait_s,
        }


@dataclasses.dataclass
class _Turn:
    """The turn an episode is sampling: ids, log-probs and versions so far, budget left."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    left: int = 0


def collect_continuous(
    envs: Sequence[Env],
    codec,
    sampler,
    *,
    group_ids: Sequence[int],
    max_len: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: Any = 0,
    slots: int | None = None,
    chunk: int | None = None,
    env_workers: int = 0,
    env_timeout: float | None = None,
    max_step_keys: int | None = None,
    publish: Callable[[], tuple[Any, int] | None] | None = None,
    recompute: bool = True,
    refill: float = REFILL,
) -> Rollouts:
    """One episode in each env, continuously batched; returns the padded batch of
    ``envs.rollout.collect`` (the same episodes, in the same order) with ``stats`` filled.

    Args:
      sampler: a [`Sampler`][train.engine.sampler.Sampler] (its capacity >= ``max_len``).
      slots: decode rows (default: one per episode). chunk: decode steps between host visits
        (default ``max_new_tokens``). env_workers: threads stepping environments (0: inline).
      env_timeout: seconds an environment may take to answer a turn (None: no limit; needs
        ``env_workers`` > 0 to be enforced).
      publish: called before each chunk; returns ``(state, version)`` to sample with from then
        on, or None to keep the current weights.
      recompute: an episode waiting on its environment gives its slot up when others wait for
        one, and recomputes its prefix when it returns (False: it always holds its slot).
      refill: while work waits for a slot or an answer, a chunk ends once this share of its
        live slots ended their turns, so freed slots are handed on sooner (default
        `REFILL`; 0: chunks run to ``chunk`` steps or until all are done). Where nothing
        waits (a slot per episode, environments stepped inline) it changes nothing.

    Raises ``ValueError`` for a bad slot, chunk or worker count, or a prompt with no room for a
    turn in ``max_len``.
    """
    t0 = time.perf_counter()
    n = len(envs)
    slots = n if slots is None else slots
    chunk = max_new_tokens if chunk is None else chunk
    for name, value, low in (
        ("slots", slots, 1),
        ("chunk", chunk, 1),
        ("env_workers", env_workers, 0),
    ):
        if value < low:
            raise ValueError(f"{name}: must be >= {low}, got {value}")
    if env_timeout is not None and not env_workers:
        raise ValueError("env_timeout: needs env_workers > 0 (an inline step cannot be timed out)")
    slots = min(slots, n)
    episodes, prompts = start_episodes(envs, codec, group_ids, max_len, max_new_tokens)
    loop = _Loop(
        episodes, envs, codec, sampler, slots, chunk, max_len, max_new_tokens, env_workers,
        env_timeout, publish, recompute, refill,
    )  # fmt: skip
    try:
        loop.run(prompts, temperature, seed)
    finally:
        loop.close()
    out = to_batch(episodes, envs, codec, group_ids, max_len, max_step_keys, t0)
    loop.stats.wall_s = out.seconds
    out.stats = loop.stats
    return out


class _Loop:
    """The host side of one collection: which episode holds which slot, and what each waits on."""

    def __init__(
        self, episodes, envs, codec, sampler, slots, chunk, max_len, max_new, workers, timeout,
        publish, recompute, refill,
    ):  # fmt: skip
        self.episodes, self.envs, self.codec, self.sampler = episodes, envs, codec, sampler
        self.n_slots, self.chunk, self.max_len, self.max_new = slots, chunk, max_len, max_new
        self.timeout, self.publish, self.recompute = timeout, publish, recompute
        self.refill = refill
        self.queue: collections.deque[int] = collections.deque()  # not started
        self.returning: collections.deque[int] = collections.deque()  # answered, without a slot
        self.prompts: list[list[int]] = []
        self.end_of_turn = list(getattr(codec, "end_of_turn", ()))
        self.pool = concurrent.futures.ThreadPoolExecutor(workers) if workers else None
        self.holder = [-1] * slots  # slot -> episode, -1: free
        self.slot_of: dict[int, int] = {}
        self.turns: dict[int, _Turn] = {}  # episodes decoding a turn
        self.pending: dict[concurrent.futures.Future, tuple[int, list[int], float]] = {}
        self.new_ids: dict[int, list[int]] = {}  # slot -> ids to prefill before the next chunk
        self.stats = EngineStats(slots)

    def run(self, prompts, temperature, seed) -> None:
        self.queue.extend(range(len(self.episodes)))
        self.prompts = prompts
        self.sampler.open(self.n_slots)
        while self.queue or self.returning or self.slot_of or self.pending:
            self._answers(block=False)
            self._admit()
            if not self.turns and not self.new_ids:  # nothing to run: wait for an answer
                self._answers(block=True)
                self._admit()
            if self.new_ids:
                started = time.perf_counter()
                self.sampler.extend([self.new_ids.get(s) for s in range(self.n_slots)])
                self.stats.prefill_s += time.perf_counter() - started
                self.new_ids = {}
            if self.turns:
                self._decode(temperature, seed)

    def _admit(self) -> None:
        """Free slots go to answered episodes without one (their whole conversation is
        prefilled), then to new episodes (their prompt). With ``recompute``, episodes still
        waiting on their environment lend their slots first when others wait for one (the most
        recently handed over first: the likeliest to be away longest)."""
        free = [s for s in range(self.n_slots) if self.holder[s] < 0]
        wanted = len(self.returning) + len(self.queue) - len(free)
        if self.recompute and wanted > 0:
            waiting = [i for i, _, _ in self.pending.values() if i in self.slot_of]
            for i in waiting[::-1][:wanted]:
                self._free(i)
        for slot in [s for s in range(self.n_slots) if self.holder[s] < 0]:
            if self.returning:
                i = self.returning.popleft()
                ids = list(self.episodes[i].tokens)
                self.stats.recomputed += 1
            elif self.queue:
                i = self.queue.popleft()
                ids = self.prompts[i]
            else:
                return
            self.holder[slot], self.slot_of[i] = i, slot
            self.sampler.reset([slot])
            self.new_ids[slot] = ids
            self.turns[i] = _Turn(left=self.max_new)

    def _decode(self, temperature, key) -> None:
        if self.publish is not None:
            fresh = self.publish()
            if fresh is not None:
                self.sampler.swap(*fresh)
                self.stats.swaps += 1
        budgets = np.zeros(self.n_slots, np.int32)
        for i, turn in self.turns.items():
            budgets[self.slot_of[i]] = turn.left
        version = int(getattr(self.sampler, "version", 0))
        contended = bool(self.queue or self.returning)  # episodes wait for a slot
        started = time.perf_counter()
        gen = self.sampler.generate(
            max_new_tokens=self.chunk,
            temperature=temperature,
            stop_ids=tuple(self.codec.stop_ids),
            seed=key,
            budgets=budgets,
            min_live=self._min_live(),
            streams=[max(i, 0) for i in self.holder],  # each episode its own stream
        )
        self.stats.decode_s += time.perf_counter() - started
        lengths = [len(t) for t in gen.tokens]
        ran = max(lengths)  # the chunk's steps (fewer than chunk: all done, or refill early)
        self.stats.chunks += 1
        self.stats.slot_steps += self.n_slots * ran
        self.stats.live_steps += sum(lengths)
        if contended:
            self.stats.contended_slot_steps += self.n_slots * ran
            self.stats.contended_live_steps += sum(lengths)
        full = self.sampler.lengths >= self.sampler.capacity
        for i in list(self.turns):
            slot, turn = self.slot_of[i], self.turns[i]
            ids = gen.tokens[slot]
            turn.tokens += ids
            turn.logp += gen.logprobs[slot]
            turn.versions += [version] * len(ids)
            turn.left -= len(ids)
            ended = gen.stopped[slot] or turn.left <= 0 or full[slot]
            if ended or len(ids) < min(ran, budgets[slot]):
                del self.turns[i]
                self._hand_over(i, turn)

    def _min_live(self) -> int:
        """The chunk ends once fewer slots than this still decode: while work waits for a
        slot or an answer (episodes not started, answered ones without a slot, tools running),
        as soon as ``refill`` of the live slots (at least one, at most as many as wait) have
        ended their turns, so the host admits the waiting sooner; otherwise when all have."""
        waiting = len(self.queue) + len(self.returning) + len(self.pending)
        if not waiting or not self.refill:
            return 1
        live = len(self.turns)
        ended = min(waiting, max(1, math.ceil(self.refill * live)))
        return max(1, live - ended + 1)

    def _hand_over(self, i: int, turn: _Turn) -> None:
        """The turn ended: book it and give its text to the environment."""
        ep, env = self.episodes[i], self.envs[i]
        close = record_turn(ep, env, turn.tokens, turn.logp, self.end_of_turn, turn.versions)
        if close is None:
            return self._free(i)
        text = self.codec.turn_text(turn.tokens)
        if self.pool is None:
            try:
                result = env.step(text)
            except Exception as e:  # noqa: BLE001  (one broken environment never kills a run)
                record_failure(ep, e)
                return self._free(i)
            return self._answered(i, result, close)
        self.pending[self.pool.submit(env.step, text)] = (i, close, time.perf_counter())

    def _answers(self, block: bool) -> None:
        """Books the environments that answered; with ``block``, waits for at least one (or
        for the first to time out)."""
        if not self.pending:
            return
        if block:
            started = time.perf_counter()
            wait = None
            if self.timeout is not None:
                oldest = min(t for _, _, t in self.pending.values())
                wait = max(0.0, oldest + self.timeout - started)
            concurrent.futures.wait(
                self.pending, timeout=wait, return_when=concurrent.futures.FIRST_COMPLETED
            )
            self.stats.env_wait_s += time.perf_counter() - started
        now = time.perf_counter()
        for future in list(self.pending):
            i, close, submitted = self.pending[future]
            if future.done():
                del self.pending[future]
                try:
                    result = future.result()
                except Exception as e:  # noqa: BLE001
                    record_failure(self.episodes[i], e)
                    self._free(i)
                    continue
                self._answered(i, result, close)
            elif self.timeout is not None and now - submitted >= self.timeout:
                del self.pending[future]  # abandoned: its thread finishes on its own
                record_failure(self.episodes[i], f"TimeoutError: no answer in {self.timeout:g} s")
                self._free(i)

    def _answered(self, i: int, result, close) -> None:
        ids = record_result(self.episodes[i], result, close, self.codec, self.max_len, self.max_new)
        if ids is None:
            return self._free(i)
        if i not in self.slot_of:
            self.returning.append(i)
            return
        self.new_ids[self.slot_of[i]] = ids
        self.turns[i] = _Turn(left=self.max_new)

    def _free(self, i: int) -> None:
        if i in self.slot_of:
            self.holder[self.slot_of.pop(i)] = -1

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.sampler.close()
