"""Context parallelism: one row's tokens split over the mesh's ``context`` axis.

With a mesh whose ``context`` axis has size C > 1 (``--mesh data,fsdp,tensor,context``), every
full-sequence forward of `train.model.qwen3` (the actor's and the critic's, forward and backward;
old, reference and TRACE scores) keeps 1/C of each row's tokens on each device: the residual
stream, the MLP's and the norms' activations, the queries. Attention is the one place a token
needs the others: each layer all-gathers the keys and values (and their positions) over
``context``, so that every device attends its own queries to the whole row; the backward of the
all-gather is a reduce-scatter of the keys' and values' gradients. With grouped KV heads the
gathered K/V are ``2 · Hkv · head_dim`` numbers a token against the ``hidden`` of the residual
stream (Qwen3-8B: 2 · 8 · 128 = 2048 against 4096). Why an all-gather and not a ring of
blocks: it is one collective a layer that XLA schedules and differentiates as it is (its
transpose a reduce-scatter), the kernel then runs unchanged (its block skipping included) on
the gathered keys, and the extra memory is one layer's gathered K/V (``1 - 1/C`` of a row's,
small with grouped KV heads) while a layer runs. A ring would save that memory and overlap each
block's transfer with the previous block's compute, which pays where the interconnect is slow
against the compute; on fake CPU devices there is no overlap to measure, so it is left for a
measured reason (`benchmarks/context.py` prints the bytes each layer gathers).

**Balance.** Causal attention makes a query at position t attend t keys, so with rows split
into C contiguous parts the last device does about ``2C/(C + 1)`` times the average work (the
kernel skips invisible blocks) and the first almost nothing. Rows are therefore laid out
*zigzag*: the row is cut into 2C chunks and device d holds chunks d and 2C - 1 - d (one early,
one late), which gives every device the same number of visible (query, key) pairs.
`visible_blocks` counts them; ``benchmarks/context.py`` prints both layouts.

The model pads a row to a multiple of 2C (padding is never a visible key), lays its tokens out
zigzag (`to_zigzag`), runs the layers and puts the final hidden states back in order
(`from_zigzag`), so every caller sees the same ``[B, T, D]`` as on one device: log-probs,
values and the turn-level sums downstream (a turn may start on one device and end on another)
are computed on the row in its natural order by ``mpo_jax``, unchanged.

Decode (the sampler's and the engine's ``extend``) does not split tokens: its rows (and their KV
cache) spread over data x fsdp x context instead (`train.model.sharding.DECODE_AXES`), so that the
devices of a context group do not decode the same rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels.attention import attention
from train.model.sharding import row_axes

__all__ = [
    "CONTEXT_AXIS",
    "context_ways",
    "padded_length",
    "to_zigzag",
    "from_zigzag",
    "constrain_tokens",
    "context_attention",
    "visible_blocks",
]

CONTEXT_AXIS = "context"


def context_ways() -> int:
    """The size of the ``context`` axis of the mesh in effect (``jax.set_mesh``); 1 without."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[CONTEXT_AXIS])


def padded_length(t: int, ways: int) -> int:
    """``t`` rounded up to a multiple of ``2 · ways`` (two chunks a device)."""
    return -(-t // (2 * ways)) * (2 * ways)


def to_zigzag(x: jax.Array, ways: int) -> jax.Array:
    """Axis 1 (length a multiple of 2C) reordered so that its C equal parts are, in turn,
    chunks (d, 2C - 1 - d) of the natural order: part d is what device d of ``context`` holds."""
    b, t = x.shape[:2]
    n = t // (2 * ways)
    chunks = x.reshape(b, 2 * ways, n, *x.shape[2:])
    early, late = chunks[:, :ways], chunks[:, ways:][:, ::-1]
    return jnp.stack([early, late], axis=2).reshape(x.shape)


def from_zigzag(x: jax.Array, ways: int) -> jax.Array:
    """The inverse of `to_zigzag`."""
    b, t = x.shape[:2]
    n = t // (2 * ways)
    parts = x.reshape(b, ways, 2, n, *x.shape[2:])
    early, late = parts[:, :, 0], parts[:, ::-1, 1]
    return jnp.concatenate([early, late], axis=1).reshape(x.shape)


def constrain_tokens(x: jax.Array) -> jax.Array:
    """``x`` [B, T, ...] with its rows over the data-parallel axes (where they divide) and its
    tokens over ``context`` (where they divide); unchanged without a context axis."""
    mesh = jax.sharding.get_abstract_mesh()
    ways = context_ways()
    if ways == 1 or x.shape[1] % ways:
        return x
    return jax.lax.with_sharding_constraint(x, jax.P(row_axes(mesh, x.shape[0]), CONTEXT_AXIS))


@jax.custom_vjp
def _gather_tokens(x: jax.Array) -> jax.Array:
    """All-gather of axis 1 over ``context`` (inside `context_attention`'s shard_map)."""
    return jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)


def _gather_fwd(x):
    return _gather_tokens(x), None


def _gather_bwd(_, g):
    """The transpose, a reduce-scatter, summed in float32: more exact for bfloat16 gradients,
    and XLA's CPU compiler fails on a bfloat16 reduce-scatter ("Invalid binary instruction
    opcode copy" in its all-reduce promotion, XLA of jax 0.10)."""
    summed = jax.lax.psum_scatter(
        g.astype(jnp.float32), CONTEXT_AXIS, scatter_dimension=1, tiled=True
    )
    return (summed.astype(g.dtype),)


_gather_tokens.defvjp(_gather_fwd, _gather_bwd)


def context_attention(
    q, k, v, q_positions, k_positions, k_valid, q_lower, *, implementation, **blocks
):
    """`kernels.attention.attention` on zigzag rows split over ``context``: each device keeps its
    queries [B, T/C, Hq, D] and all-gathers keys, values, their positions and validity, which it
    puts back in natural order (so that the kernel's block ranges stay tight) before attending.
    Every argument is explicit (the model fills the defaults); ``blocks``: the kernel's
    ``block_q``/``block_k``."""
    ways = context_ways()

    def whole_row(x, gather=_gather_tokens):  # gathered, back in natural order
        return from_zigzag(gather(x), ways)

    def integers(x):  # positions and validity: no gradient, no float32 reduce-scatter
        return jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)

    def local(q, k, v, q_pos, k_pos, k_val, q_low):
        k, v = whole_row(k), whole_row(v)
        k_pos, k_val = whole_row(k_pos, integers), whole_row(k_val, integers)
        kernel = dict(implementation=implementation, **blocks)
        return attention(q, k, v, q_pos, k_pos, k_val, q_low, **kernel)

    tokens = jax.P(None, CONTEXT_AXIS)
    # check_vma off: the kernel's loops start from constants that do not vary over the axis
    split = jax.shard_map(
        local,
        in_specs=(tokens,) * 7,
        out_specs=tokens,
        axis_names={CONTEXT_AXIS},
        check_vma=False,
    )
    return split(q, k, v, q_positions, k_positions, k_valid, q_lower)


def visible_blocks(t: int, ways: int, block: int, *, zigzag: bool) -> np.ndarray:
    """[ways] (query block, key block) pairs each device's causal attention visits on a full row
    of ``t`` tokens with ``block``-sized blocks: the work each device does, contiguous or zigzag."""
    t = padded_length(t, ways)
    cols = np.arange(t)
    order = np.asarray(to_zigzag(jnp.asarray(cols)[None], ways))[0] if zigzag else cols
    per = t // ways
    out = np.zeros(ways, np.int64)
    for d in range(ways):
        q = order[d * per : (d + 1) * per]
        q_max = q.reshape(-1, min(block, per)).max(axis=1)
        k_min = cols.reshape(-1, min(block, t)).min(axis=1)
        out[d] = int((k_min[None, :] <= q_max[:, None]).sum())
    return out
