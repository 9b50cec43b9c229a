"""KV-cache sampling for ragged batches of conversations, one turn at a time.

    gen = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16, temperature=1.0, stop_ids=(7,))
    gen.tokens[0], gen.logprobs[0]        # new ids of prompt 0 (a stop id ends it) and their logp

Multi-turn rollouts keep the cache alive between turns with
[`Sampler`][train.engine.sampler.Sampler]:

    s = Sampler(model, capacity=4096)
    s.start(prompts)                      # allocates the cache for len(prompts) rows, prefills
    turn = s.generate(max_new_tokens=256, stop_ids=(im_end,))
    s.extend(observation_ids_per_row)     # tool responses appended; the prefix is not re-run
    turn = s.generate(...)
    s.close()                             # frees the cache

Shapes are static: prompt and observation lengths are padded to power-of-two buckets and
prefilled in chunks of at most ``prefill_chunk`` tokens, and the decode loop is one jitted
``lax.while_loop`` over a preallocated cache, so a new prompt length costs a compile only when it
enters a new bucket. Every sampled token (the stop id included) is fed back into the cache, so
the cache always holds the conversation exactly as sampled. The cache holds ``capacity`` slots a
row (rounded up to the attention kernel's block) in the model's compute dtype; it is allocated by
[`Sampler.start`][train.engine.sampler.Sampler.start] for the rows given and released by
[`Sampler.close`][train.engine.sampler.Sampler.close], so one sampler serves training and evaluation
batches of any size.

Log-probs are those of the distribution the token was sampled from, ``softmax(logits / τ)``
(plain softmax for τ = 0, greedy), before top-k / top-p filtering: what the learner recomputes
with ``kernels.logprobs`` at the same temperature.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from train.model.qwen3 import KVCache, unstacked

__all__ = [
    "Generation",
    "Sampler",
    "generate",
    "bucket",
    "cache_slots",
    "cache_sharding",
    "empty_cache",
    "categorical",
    "splits_layers",
    "SPLIT_LAYERS_FROM",
]


@dataclasses.dataclass
class Generation:
    """New token ids and their log-probs, one list per row (empty for rows not generated)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]  # ended on a stop id (False: ran out of max_new_tokens or capacity)


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n - 1).bit_length()))


def cache_slots(capacity: int) -> int:
    """Cache slots for ``capacity`` tokens a row: rounded up to the attention kernel's key block,
    so the kernel never pads the cache (writes past the end are dropped, not shifted)."""
    block = 512 if capacity > 512 else 8
    return -(-capacity // block) * block


def _filter_logits(logits, top_k: int, top_p: float):
    """Masks logits outside the top-k and outside the top-p nucleus (to -inf)."""
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
        keep_sorted = before < top_p  # always keeps the most likely token
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def _last_positive(x):
    """Index of the last entry > 0 along the last axis (0 if none)."""
    n = x.shape[-1]
    return n - 1 - jnp.argmax(jnp.flip(x > 0, axis=-1), axis=-1)


def _inverse_cdf(weights, u):
    """The first index whose cumulative weight exceeds u · total, per row; never a 0-weight one."""
    cdf = jnp.cumsum(weights, axis=-1)
    target = u[:, None] * cdf[:, -1:]
    return jnp.minimum(jnp.sum(cdf <= target, axis=-1), _last_positive(weights))


def categorical(key, logits, block: int = 1024):
    """Samples one index per row of logits [B, V] exactly from softmax(logits).

    Two-level inverse-CDF sampling: choose a block of ``block`` entries by its total mass, then an
    entry inside it. Two uniforms per row instead of V Gumbel variates: on a 151,936-entry
    vocabulary this is an order of magnitude faster than ``jax.random.categorical`` on CPUs.
    """
    b, v = logits.shape
    block = min(block, v)
    pad = (-v) % block
    logits = jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)).reshape(b, -1, block)
    u1, u2 = _uniforms(key, b)
    chosen = _inverse_cdf(jnp.sum(p, axis=-1), u1)
    inside = jnp.take_along_axis(p, chosen[:, None, None], axis=1)[:, 0]
    return chosen * block + _inverse_cdf(inside, u2)


def _uniforms(key, b: int):
    """Two [b] uniforms: from one key for the whole batch, or from each row's own key (a [b]
    key array: a row's draw then depends on its key alone, not on the other rows)."""
    if key.shape == ():
        k1, k2 = jax.random.split(key)
        return jax.random.uniform(k1, (b,)), jax.random.uniform(k2, (b,))
    pairs = jax.vmap(jax.random.split)(key)
    draw = jax.vmap(lambda k: jax.random.uniform(k, ()))
    return draw(pairs[:, 0]), draw(pairs[:, 1])


def _sample(logits, key, temperature: float, top_k: int, top_p: float):
    """(token, log-prob under softmax(logits / τ)) for each row of logits [B, V]."""
    if temperature == 0:
        token = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        scaled = logits / temperature
        logp = jax.nn.log_softmax(scaled, axis=-1)
        token = categorical(key, _filter_logits(scaled, top_k, top_p))
    return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def as_key(seed) -> jax.Array:
    """A PRNG key from an int seed, or the key itself."""
    if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    return jax.random.key(seed)


# Weights from which a CPU sampler holds them one array a layer by default: below, a layer's
# weights are small enough that copying them out of the stack costs little, while the split
# graph costs compile time (0.2-0.8 s more a program on the tests' 2-4-layer models).
SPLIT_LAYERS_FROM = 64 * 2**20


def splits_layers(weights, platform: str) -> bool:
    """Whether a sampler holds ``weights`` (a pytree of arrays or ShapeDtypeStructs: the
    sampler's own state, or the plan's abstract one) one array a layer by default
    (`train.model.qwen3.unstacked`): on the CPU, whose compiler copies a stacked layer's
    weights at every decode step, for weights of at least `SPLIT_LAYERS_FROM` bytes in all;
    never on accelerators, where the copy would cost device memory."""
    if platform != "cpu":
        return False
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights)) >= SPLIT_LAYERS_FROM


class Sampler:
    """A batch of live conversations sharing one preallocated KV cache.

    Args:
      model: a `train.model.qwen3.Qwen3ForCausalLM` (any module with the same ``extend``).
      capacity: the most tokens one conversation may hold (prompt, turns, observations).
      batch_size: rows (conversations) a batch must have; None: whatever
        [`start`][train.engine.sampler.Sampler.start] gets.
      prefill_chunk: the most tokens a row prefills in one call (longer prompts and
        observations go in chunks: the attention's working set is chunk x capacity).
      mesh: where the cache lives (rows over the data axes), if anywhere but one device.
      device: a context held around each device program (default: none).
      split_layers: hold the weights one array a layer (`train.model.qwen3.unstacked`:
        a copy of them, made whenever ``state`` is set, that the CPU's decode reads in place);
        None: [`splits_layers`][train.engine.sampler.splits_layers] (on the CPU, for weights of at
        least `SPLIT_LAYERS_FROM` bytes).
    """

    def __init__(
        self,
        model,
        *,
        capacity: int,
        batch_size: int | None = None,
        prefill_chunk: int = 512,
        mesh=None,
        device=None,
        split_layers: bool | None = None,
    ):
        self.graphdef, state = nnx.split(model)
        if split_layers is None:
            split_layers = splits_layers(state, jax.default_backend())
        self._lay_out = None
        if split_layers and getattr(model.cfg, "stack_layers", False) and model.cfg.num_layers > 1:
            self.graphdef, self._lay_out = unstacked(model)
        self.state = state
        self.cfg = model.cfg
        self.batch_size = batch_size
        self.capacity = capacity
        self.prefill_chunk = prefill_chunk
        self.slots = cache_slots(capacity)
        self.mesh = mesh
        # held around each program call (a lock shared with a learner thread,
        # train.core.async_rollouts)
        self.device = device if device is not None else contextlib.nullcontext()
        self.cache = None
        self.version = 0  # the policy version of the weights (updates applied; see swap)
        self.lengths = np.zeros(batch_size or 0, np.int32)
        self.next_logits = None

    @property
    def state(self):
        """The weights the programs read (set it with a state of the model given, stacked)."""
        return self._state

    @state.setter
    def state(self, state) -> None:
        self._state = None  # the old copy goes before the new one is made
        self._state = state if self._lay_out is None else self._lay_out(state)

    # -- host API ------------------------------------------------------------------------------

    def extend(self, rows: Sequence[Sequence[int] | None]) -> None:
        """Appends token ids to each row's conversation (``None`` or ``[]``: row unchanged).

        The new tokens attend to everything already in the cache; nothing is re-run.
        Raises ValueError when a row would exceed ``capacity``.
        """
        if self.cache is None:
            raise ValueError("extend: no live batch (call start first)")
        if len(rows) != len(self.lengths):
            raise ValueError(f"rows: {len(rows)} rows for a batch of {len(self.lengths)}")
        n_new = np.array([len(r) if r is not None else 0 for r in rows], np.int32)
        over = np.nonzero(self.lengths + n_new > self.capacity)[0]
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"rows[{i}]: {int(self.lengths[i])} + {int(n_new[i])} tokens exceed the capacity "
                f"{self.capacity}"
            )
        if not n_new.any():
            return
        longest = int(n_new.max())
        ids = np.zeros((len(rows), longest), np.int32)
        for i, r in enumerate(rows):
            if r:
                ids[i, : len(r)] = r
        for lo in range(0, longest, self.prefill_chunk):
            part = np.clip(n_new - lo, 0, self.prefill_chunk).astype(np.int32)
            width = min(bucket(int(part.max())), self.prefill_chunk)
            chunk = np.zeros((len(rows), width), np.int32)
            chunk[:, : min(width, longest - lo)] = ids[:, lo : lo + width]
            some = self._rows_to_extend(part)
            sel = slice(None) if some is None else some
            with self.device:
                self.next_logits, self.cache = _extend_jit(
                    self.graphdef,
                    self.state,
                    self.cache,
                    jnp.asarray(chunk[sel]),
                    jnp.asarray(self.lengths[sel]),
                    jnp.asarray(part[sel]),
                    self.next_logits,
                    None if some is None else jnp.asarray(some),
                )
                jax.block_until_ready(self.next_logits)
            self.lengths = self.lengths + part

    def _rows_to_extend(self, n_new: np.ndarray) -> np.ndarray | None:
        """The cache rows one prefill call runs: those with new tokens, padded with rows that
        have none (left as they are) to a power of two, so a call costs the rows that need it
        (a slot engine's call often has one or two of many) in at most log2(rows) + 1 programs
        a width; None: every row (as many, or a cache laid over several devices, whose rows
        stay where they are)."""
        if self.mesh is not None:
            return None
        have = np.flatnonzero(n_new > 0)
        count = bucket(len(have), minimum=1)
        if count >= len(n_new):
            return None
        pad = np.flatnonzero(n_new == 0)[: count - len(have)]
        return np.sort(np.concatenate([have, pad])).astype(np.int32)

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Starts a batch (one row per prompt) and prefills it; the cache is allocated here."""
        if self.batch_size is not None and len(prompts) != self.batch_size:
            raise ValueError(f"prompts: {len(prompts)} prompts for a batch of {self.batch_size}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt")
        rows = len(prompts)
        if self.cache is None or self.cache.k.shape[1] != rows:
            self.cache = None  # free the old one first
            self.cache = empty_cache(self.cfg, rows, self.slots, self.mesh)
        self.lengths = np.zeros(rows, np.int32)
        self.next_logits = jnp.zeros((rows, self.cfg.vocab_size), jnp.float32)
        self.extend(prompts)

    def close(self) -> None:
        """Releases the cache (a later [`start`][train.engine.sampler.Sampler.start] allocates a new
        one)."""
        self.cache = self.next_logits = None

    def open(self, rows: int) -> None:
        """Allocates an empty cache of ``rows`` rows (slots) without prefilling any: rows are
        then filled with [`reset`][train.engine.sampler.Sampler.reset] and
        [`extend`][train.engine.sampler.Sampler.extend] one by one (the slot engine)."""
        if self.cache is None or self.cache.k.shape[1] != rows:
            self.cache = None
            self.cache = empty_cache(self.cfg, rows, self.slots, self.mesh)
        self.lengths = np.zeros(rows, np.int32)
        self.next_logits = jnp.zeros((rows, self.cfg.vocab_size), jnp.float32)

    def reset(self, rows: Sequence[int]) -> None:
        """Empties ``rows`` (their length goes to 0: what the cache held there is never read
        again, attention reads a row's first ``length`` slots only); fill them with
        [`extend`][train.engine.sampler.Sampler.extend]."""
        if self.cache is None:
            raise ValueError("reset: no live batch (call start or open first)")
        self.lengths = self.lengths.copy()
        self.lengths[np.asarray(rows, int)] = 0

    def swap(self, state, version: int) -> None:
        """New weights (an ``nnx.State`` of the same model), policy version ``version``, for
        every later program call; the cache keeps what older weights wrote (the engine's weight
        swap between chunks)."""
        self.state, self.version = state, int(version)

    def generate(
        self,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_ids: Sequence[int] = (),
        seed: int = 0,
        active: Sequence[bool] | None = None,
        budgets: Sequence[int] | None = None,
        min_live: int = 1,
        streams: Sequence[int] | None = None,
    ) -> Generation:
        """Samples up to ``max_new_tokens`` for every active row, continuing each conversation.

        A row stops after a stop id (which is kept), at ``max_new_tokens``, at its own budget
        (``budgets[i]`` tokens, at most ``max_new_tokens``; 0: the row is inactive), or at
        capacity. ``seed`` is an int or a JAX PRNG key. ``min_live``: the call returns as soon
        as fewer rows than this are still sampling (the slot engine hands freed rows to waiting
        episodes sooner; rows not done then continue in the next call); 1: when all are done.
        """
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        if temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        if self.cache is None:
            raise ValueError("generate: no live batch (call start first)")
        rows = len(self.lengths)
        act = np.ones(rows, bool) if active is None else np.asarray(active, bool)
        budget = np.full(rows, max_new_tokens, np.int32)
        if budgets is not None:
            budget = np.minimum(budget, np.asarray(budgets, np.int32))
            act = act & (budget > 0)
        with self.device:
            self.cache, lengths, self.next_logits, stopped, out, out_lp = _decode_jit(
                self.graphdef,
                self.capacity,
                self.state,
                self.cache,
                jnp.asarray(self.lengths),
                self.next_logits,
                jnp.asarray(act),
                jnp.asarray(budget),
                as_key(seed),
                int(max_new_tokens),
                float(temperature),
                int(top_k),
                float(top_p),
                tuple(int(s) for s in stop_ids),
                jnp.int32(min_live),
                None if streams is None else jnp.asarray(streams, jnp.int32),
            )
            self.lengths = np.asarray(lengths)
            out, out_lp = np.asarray(out), np.asarray(out_lp)
        tokens, logprobs = [], []
        for i in range(rows):
            n = int(np.sum(out[i] >= 0))
            tokens.append(out[i, :n].tolist())
            logprobs.append(out_lp[i, :n].tolist())
        return Generation(tokens, logprobs, np.asarray(stopped).tolist())


def cache_sharding(cfg, rows: int, mesh) -> jax.sharding.NamedSharding | None:
    """How a cache of ``rows`` rows lies on ``mesh``: rows over data, fsdp and context
    (`train.model.sharding.DECODE_AXES`: decode splits rows, not tokens), else over the
    data-parallel axes, and key/value heads over ``tensor``, each where it divides (None without
    a mesh)."""
    if mesh is None:
        return None
    from train.model.sharding import DECODE_AXES, row_axes

    data = row_axes(mesh, rows, DECODE_AXES)
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and cfg.num_kv_heads % tensor == 0 else None
    return jax.sharding.NamedSharding(mesh, jax.P(None, data, None, heads, None))


def empty_cache(cfg, rows: int, slots: int, mesh=None) -> KVCache:
    """A zero cache allocated where it lives (sharded on ``mesh``; never a host copy first)."""
    sharding = cache_sharding(cfg, rows, mesh)
    make = functools.partial(KVCache.empty, cfg, rows, slots)
    if sharding is None:
        return make()
    return jax.jit(make, out_shardings=KVCache(sharding, sharding))()


# The jitted programs live at module level, keyed on the graphdef, so that samplers of equal
# models share their compiled code. The cache is donated: each call updates it in place.


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _extend_jit(graphdef, state, cache, ids, offsets, n_new, old_logits, rows=None):
    """Prefills ``ids`` [B, L] (row b: its first ``n_new[b]``) into cache rows ``rows`` [B]
    (None: every row, in order); returns every cache row's next-token logits and the cache."""
    model = nnx.merge(graphdef, state)
    logits, cache = model.extend(ids, offsets, n_new, cache, rows)
    kept = old_logits if rows is None else old_logits[rows]
    logits = jnp.where((n_new > 0)[:, None], logits, kept)
    return (logits if rows is None else old_logits.at[rows].set(logits)), cache


@functools.partial(jax.jit, static_argnums=(0, 1, 9, 10, 11, 12, 13), donate_argnums=(3,))
def _decode_jit(
    graphdef,
    capacity,
    state,
    cache,
    lengths,
    logits,
    active,
    budget,
    key,
    steps,
    temperature,
    top_k,
    top_p,
    stop_ids,
    min_live,
    streams=None,
):
    model = nnx.merge(graphdef, state)
    # per-row streams: each row's key for a token is its stream's key folded with the position
    row_keys = None if streams is None else jax.vmap(jax.random.fold_in, (None, 0))(key, streams)
    b = lengths.shape[0]
    limit = jnp.int32(capacity)
    stops = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)

    def cond(carry):  # with min_live 1: until every row is done
        step, _, _, _, done, *_ = carry
        return (step < steps) & (jnp.sum(~done) >= min_live)

    def body(carry):
        step, cache, lengths, logits, done, stopped, key, out, out_lp = carry
        if row_keys is None:
            key, sub = jax.random.split(key)
        else:
            sub = jax.vmap(jax.random.fold_in)(row_keys, lengths)
        token, logp = _sample(logits, sub, temperature, top_k, top_p)
        live = ~done
        out = out.at[:, step].set(jnp.where(live, token, -1))
        out_lp = out_lp.at[:, step].set(jnp.where(live, logp, 0.0))
        is_stop = jnp.any(token[:, None] == stops[None], axis=-1) & live
        n_new = live.astype(jnp.int32)
        new_logits, cache = model.extend(token[:, None], lengths, n_new, cache)
        logits = jnp.where(live[:, None], new_logits, logits)
        lengths = lengths + n_new
        stopped = stopped | is_stop
        done = done | is_stop | (lengths >= limit) | (step + 1 >= budget)
        return step + 1, cache, lengths, logits, done, stopped, key, out, out_lp

    out = jnp.full((b, steps), -1, jnp.int32)
    out_lp = jnp.zeros((b, steps), jnp.float32)
    done = ~active | (lengths >= limit)
    carry = (jnp.int32(0), cache, lengths, logits, done, jnp.zeros(b, bool), key, out, out_lp)
    _, cache, lengths, logits, _, stopped, _, out, out_lp = jax.lax.while_loop(cond, body, carry)
    return cache, lengths, logits, stopped, out, out_lp


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
) -> Generation:
    """One turn for a ragged batch of prompts (lists of token ids); see
    [`Sampler`][train.engine.sampler.Sampler]."""
    capacity = max(len(p) for p in prompts) + max_new_tokens
    sampler = Sampler(model, capacity=capacity)
    sampler.start(prompts)
    return sampler.generate(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_ids=stop_ids,
        seed=seed,
    )
