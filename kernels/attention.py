"""Attention by position without a [Tq, Tk] matrix per head: blockwise online softmax.

For queries q_t, keys k_s and values v_s with positions, key s is visible to query t iff
``lower(t) <= pos(s) <= pos(t)`` and ``valid(s)`` (``lower``: the first position a query may see,
the start of its own sequence when several are packed in one row; default: none); with
``scale = 1/sqrt(D)`` by default,

    o_t = Σ_s p_ts v_s,   p_ts = exp(z_ts - lse_t),   z_ts = scale · q_t·k_s,
    lse_t = log Σ_{s visible} exp(z_ts)                   (o_t = 0 when nothing is visible)

`attention` computes it block by block (FlashAttention, Dao et al. 2022): for each block of
``block_q`` queries, a loop over blocks of ``block_k`` keys carries the running max, the running
sum and the unnormalised output; blocks whose keys are all invisible to the query block are not
visited (the causal upper triangle, a cache's empty slots). Only ``o`` and ``lse`` are kept for
the backward pass, a custom VJP that recomputes each block's probabilities:

    D_t = Σ_d do_td o_td,   dp_ts = do_t·v_s,   ds_ts = p_ts (dp_ts − D_t),
    dq_t = scale Σ_s ds_ts k_s,   dk_s = scale Σ_t ds_ts q_t,   dv_s = Σ_t p_ts do_t.

Peak memory is one [block_q, block_k] block per head, whatever the sequence length. Grouped-query
attention (``Hq = G · Hkv``) shares each key/value head with its G query heads. Scores, the
softmax and every accumulation are float32 whatever the inputs' dtype.

``implementation``: ``"chunked"`` (the above; CPU and TPU), ``"cudnn"`` (cuDNN's fused flash
attention through ``jax.nn.dot_product_attention``, GPU only, for full causal sequences:
positions 0..T-1, every key valid), ``"reference"`` (the whole [Tq, Tk] matrix: tests and short
sequences). ``None`` picks cuDNN on a GPU where it applies, the reference where queries and keys
fit one block each (the same computation with a simpler program), else ``"chunked"``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["attention", "reference_attention", "default_block", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("chunked", "cudnn", "reference")
_NEG = -jnp.inf


def _visible(q_pos, k_pos, k_valid, q_lower):
    """[B, 1, 1, Tq, Tk] bool: key s visible to query t (broadcast over kv heads and groups)."""
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    mask = mask & (k_pos[:, None, :] >= q_lower[:, :, None])
    return mask[:, None, None]


def _defaults(q, k, q_positions, k_positions, k_valid, q_lower=None):
    b, tq = q.shape[:2]
    tk = k.shape[1]
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(tq, dtype=jnp.int32), (b, tq))
    if k_positions is None:
        k_positions = jnp.broadcast_to(jnp.arange(tk, dtype=jnp.int32), (b, tk))
    if k_valid is None:
        k_valid = jnp.ones((b, tk), bool)
    if q_lower is None:
        q_lower = jnp.full((b, tq), jnp.iinfo(jnp.int32).min, jnp.int32)
    return (
        q_positions.astype(jnp.int32),
        k_positions.astype(jnp.int32),
        k_valid.astype(bool),
        q_lower.astype(jnp.int32),
    )


def _check(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"attention: expected q [B, Tq, Hq, D] and k, v [B, Tk, Hkv, D], got {q.shape}, "
            f"{k.shape}, {v.shape}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"attention: q {q.shape} and k {k.shape} disagree (batch, head width, or query heads "
            "not a multiple of key/value heads)"
        )


def reference_attention(
    q, k, v, q_positions=None, k_positions=None, k_valid=None, q_lower=None, *, scale=None
):
    """The whole [Tq, Tk] score matrix, masked, softmaxed in float32 (the test reference)."""
    _check(q, k, v)
    qp, kp, kv, lo = _defaults(q, k, q_positions, k_positions, k_valid, q_lower)
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, tq, hkv, hq // hkv, d)
    z = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    mask = _visible(qp, kp, kv, lo)
    z = jnp.where(mask, z, _NEG)
    m = jnp.max(z, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0)), 0)
    l_sum = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l_sum > 0, l_sum, 1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, hq, d).astype(q.dtype)


# -- the chunked kernel ------------------------------------------------------------------------


def _pad_to(x, size, axis, value):
    extra = -x.shape[axis] % size
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def _block_ranges(q_pos, k_pos, k_valid, bq, bk):
    """Which key blocks each query block must visit, as [lo, hi) ranges both ways.

    A key block is needed by a query block iff some row has a valid key in it whose position is
    <= the largest query position of the block; the loops visit [lo, hi) of the needed ones
    (exactly the needed ones when positions grow along the sequence, as they do here)."""
    b = q_pos.shape[0]
    q_max = jnp.max(q_pos.reshape(b, -1, bq), axis=-1)  # [B, nq]
    big = jnp.iinfo(jnp.int32).max
    k_min = jnp.min(jnp.where(k_valid, k_pos, big).reshape(b, -1, bk), axis=-1)  # [B, nk]
    needed = jnp.any(k_min[:, None, :] <= q_max[:, :, None], axis=0)  # [nq, nk]

    def span(m):  # [n, m] bool -> first and one-past-last True per row (0, 0 if none)
        n = m.shape[-1]
        idx = jnp.arange(n)
        lo = jnp.min(jnp.where(m, idx, n), axis=-1)
        hi = jnp.max(jnp.where(m, idx + 1, 0), axis=-1)
        return lo, jnp.maximum(hi, lo)

    return span(needed), span(needed.T)


def _scores(qi, kj, qpos_i, kpos_j, kval_j, qlo_i, scale):
    """z [B, Hkv, G, bq, bk] float32, invisible entries at -inf (so exp(z - c) is 0 there for
    any finite c: no mask after the exponential)."""
    z = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kj, preferred_element_type=jnp.float32)
    if scale != 1.0:
        z = z * scale
    return jnp.where(_visible(qpos_i, kpos_j, kval_j, qlo_i), z, _NEG)


def _folded(q, scale):
    """(q, the scale left for the scores): float32 queries take the scale once, before the
    loops (one product per query instead of one per score); others keep it in the scores,
    in float32, so that a bfloat16 query is not rounded twice."""
    if q.dtype == jnp.float32:
        return q * scale, 1.0
    return q, scale


def _forward(q, k, v, q_pos, k_pos, k_valid, q_lo, scale, bq, bk):
    """Blocked inputs -> (out [B, nq, Hkv, G, bq, D] float32, lse [B, nq, Hkv, G, bq])."""
    b, nq, hkv, g, _, d = q.shape
    (k_lo, k_hi), _ = _block_ranges(
        q_pos.reshape(b, -1), k_pos.reshape(b, -1), k_valid.reshape(b, -1), bq, bk
    )
    q, scale = _folded(q, scale)

    def query_block(i):
        qi, qpos_i = q[:, i], q_pos[:, i]

        def body(j, carry):
            m, l_sum, acc = carry
            z = _scores(qi, k[:, j], qpos_i, k_pos[:, j], k_valid[:, j], q_lo[:, i], scale)
            m_new = jnp.maximum(m, jnp.max(z, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(z - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)  # 0 while nothing was visible (m = -inf)
            l_sum = l_sum * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum(
                "bhgqk,bhkd->bhgqd", p.astype(v.dtype), v[:, j], preferred_element_type=jnp.float32
            )
            return m_new, l_sum, acc * alpha[..., None] + pv

        init = (
            jnp.full((b, hkv, g, bq), _NEG, jnp.float32),
            jnp.zeros((b, hkv, g, bq), jnp.float32),
            jnp.zeros((b, hkv, g, bq, d), jnp.float32),
        )
        m, l_sum, acc = jax.lax.fori_loop(k_lo[i], k_hi[i], body, init)
        seen = l_sum > 0
        out = acc / jnp.where(seen, l_sum, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l_sum, 1.0)), _NEG)
        return out, lse  # [B, Hkv, G, bq, D], [B, Hkv, G, bq]

    out, lse = jax.lax.map(query_block, jnp.arange(nq))
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(lse, 0, 1)


def _backward(q, k, v, q_pos, k_pos, k_valid, q_lo, out, lse, do, scale, bq, bk):
    b, nq, hkv, g, _, d = q.shape
    nk = k.shape[1]
    _, (first_q, last_q) = _block_ranges(
        q_pos.reshape(b, -1), k_pos.reshape(b, -1), k_valid.reshape(b, -1), bq, bk
    )
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [B, nq, Hkv, G, bq]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    # z = z_scale (q_s . k) with q_s = q scale / z_scale: dq = scale Σ ds k (scaled once at the
    # end), dk = z_scale Σ ds q_s (ds: the gradient with respect to z)
    q, z_scale = _folded(q, scale)

    def key_block(dq, j):
        kj, vj = k[:, j], v[:, j]

        def body(i, carry):
            dq, dk, dv = carry
            qi, doi = q[:, i], do[:, i]
            z = _scores(qi, kj, q_pos[:, i], k_pos[:, j], k_valid[:, j], q_lo[:, i], z_scale)
            p = jnp.exp(z - lse_safe[:, i][..., None])
            dv = dv + jnp.einsum(
                "bhgqk,bhgqd->bhkd", p.astype(do.dtype), doi, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[:, i][..., None])
            if z_scale != 1.0:
                ds = ds * z_scale
            dk = dk + jnp.einsum(
                "bhgqk,bhgqd->bhkd", ds.astype(q.dtype), qi, preferred_element_type=jnp.float32
            )
            dqi = jnp.einsum(
                "bhgqk,bhkd->bhgqd", ds.astype(k.dtype), kj, preferred_element_type=jnp.float32
            )
            return dq.at[:, i].add(dqi), dk, dv

        zeros = jnp.zeros((b, hkv, bk, d), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(first_q[j], last_q[j], body, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq0 = jnp.zeros(q.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(key_block, dq0, jnp.arange(nk))
    if z_scale == 1.0:  # the scale was folded into q: dq takes it here, once
        dq = dq * scale
    return dq, jnp.moveaxis(dk, 0, 1), jnp.moveaxis(dv, 0, 1)


def _q_blocks(x, bq: int, hkv: int):
    """[B, T, Hq, D] -> head-major blocks [B, nq, Hkv, G, bq, D] (padded to whole blocks)."""
    b, _, hq, d = x.shape
    x = _pad_to(x, bq, 1, 0).reshape(b, -1, bq, hkv, hq // hkv, d)
    return x.transpose(0, 1, 3, 4, 2, 5)


def _q_tokens(x, t: int):
    """The inverse of `_q_blocks`: [B, nq, Hkv, G, bq, D] -> [B, t, Hq, D]."""
    b, nq, hkv, g, bq, d = x.shape
    return x.transpose(0, 1, 4, 2, 3, 5).reshape(b, nq * bq, hkv * g, d)[:, :t]


def _kv_blocks(x, bk: int):
    """[B, T, Hkv, D] -> head-major blocks [B, nk, Hkv, bk, D]."""
    b, _, hkv, d = x.shape
    return _pad_to(x, bk, 1, 0).reshape(b, -1, bk, hkv, d).transpose(0, 1, 3, 2, 4)


def _kv_tokens(x, t: int):
    """The inverse of `_kv_blocks`: [B, nk, Hkv, bk, D] -> [B, t, Hkv, D]."""
    b, nk, hkv, bk, d = x.shape
    return x.transpose(0, 1, 3, 2, 4).reshape(b, nk * bk, hkv, d)[:, :t]


def _to_blocks(q, k, v, q_pos, k_pos, k_valid, q_lo, bq, bk):
    """Blocks in head-major order (every product inside the loops is then a batched matrix
    product over (B, Hkv) of contiguous [block, D] tiles, with no transpose in the loop);
    positions [B, n, block]."""
    b = q.shape[0]
    hkv = k.shape[2]
    q = _q_blocks(q, bq, hkv)
    q_pos = _pad_to(q_pos, bq, 1, -1).reshape(b, -1, bq)  # padded queries see nothing
    q_lo = _pad_to(q_lo, bq, 1, 0).reshape(b, -1, bq)
    k, v = _kv_blocks(k, bk), _kv_blocks(v, bk)
    k_pos = _pad_to(k_pos, bk, 1, 0).reshape(b, -1, bk)
    k_valid = _pad_to(k_valid, bk, 1, False).reshape(b, -1, bk)
    return q, k, v, q_pos, k_pos, k_valid, q_lo


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _chunked(q, k, v, q_pos, k_pos, k_valid, q_lo, scale, bq, bk):
    return _chunked_fwd(q, k, v, q_pos, k_pos, k_valid, q_lo, scale, bq, bk)[0]


def _chunked_fwd(q, k, v, q_pos, k_pos, k_valid, q_lo, scale, bq, bk):
    tq = q.shape[1]
    blocks = _to_blocks(q, k, v, q_pos, k_pos, k_valid, q_lo, bq, bk)
    out, lse = _forward(*blocks, scale, bq, bk)
    result = _q_tokens(out, tq).astype(q.dtype)
    return result, (q, k, v, q_pos, k_pos, k_valid, q_lo, result, lse)


def _chunked_bwd(scale, bq, bk, residuals, g):
    q, k, v, q_pos, k_pos, k_valid, q_lo, out, lse = residuals
    tq, (tk, hkv) = q.shape[1], k.shape[1:3]
    blocks = _to_blocks(q, k, v, q_pos, k_pos, k_valid, q_lo, bq, bk)
    do, out = (_q_blocks(x, bq, hkv) for x in (g, out))
    dq, dk, dv = _backward(*blocks, out, lse, do, scale, bq, bk)
    dq = _q_tokens(dq, tq).astype(q.dtype)
    dk = _kv_tokens(dk, tk).astype(k.dtype)
    dv = _kv_tokens(dv, tk).astype(v.dtype)
    return dq, dk, dv, None, None, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def default_block() -> int:
    """The chunked kernel's block size on this backend: 128 on the CPU, 512 elsewhere.

    On the CPU the work that is not a matrix product (masking, the exponentials, the transposes
    between the two products) is memory-bound, and a [128, 128] block per head stays in cache:
    measured on one SmolLM2-135M layer (9 heads of 64, two threads) at 2 x 512 tokens, the
    one-block reference took 82 ms forward and 277 ms forward+backward, 128-blocks 52 and 215
    (the whole model's forward+backward with chunked log-probs: 96 -> 115-121 tokens/s); at
    1 x 1,024 tokens the reference took 161/621 ms, 128-blocks 68/262, 256-blocks 61/246. With
    the head-major blocks, forward+backward of the SmolLM2 layer: 128-blocks 58 ms, 64-blocks
    65, 256-blocks 79, one 512-block 81 (PyTorch's fused attention in the same process: 54). On
    GPU and TPU the blocks feed matrix units, where larger ones pay."""
    return 128 if jax.default_backend() == "cpu" else 512


def _block(n: int, block: int) -> int:
    """The block size for a sequence of n: ``block``, or n itself (rounded up to 8) when shorter."""
    return block if n > block else max(8, -(-n // 8) * 8)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array | None = None,
    k_positions: jax.Array | None = None,
    k_valid: jax.Array | None = None,
    q_lower: jax.Array | None = None,
    *,
    scale: float | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Masked-by-position attention (see the module docstring).

    Args:
      q: [B, Tq, Hq, D] queries; k, v: [B, Tk, Hkv, D] keys and values, Hq a multiple of Hkv.
      q_positions: int [B, Tq], k_positions: int [B, Tk] (default 0..T-1); k_valid: bool [B, Tk]
        (default all); q_lower: int [B, Tq], the first key position each query may see (default
        none). All four None means a full causal sequence (cuDNN applies).
      scale: the score scale (default 1/sqrt(D)).
      implementation: one of `IMPLEMENTATIONS`, or None (see the module docstring).
      block_q, block_k: the chunked kernel's block sizes (default `default_block`: 128
        on the CPU, 512 elsewhere).

    Returns:
      [B, Tq, Hq, D] in q's dtype; zero for a query that sees no key.
    """
    _check(q, k, v)
    block_q = default_block() if block_q is None else block_q
    block_k = default_block() if block_k is None else block_k
    full_causal = q_positions is None and k_positions is None and k_valid is None
    full_causal = full_causal and q_lower is None
    if implementation is None:
        on_gpu = jax.default_backend() == "gpu"
        one_block = q.shape[1] <= block_q and k.shape[1] <= block_k
        # one block is the whole matrix anyway: the reference is the same computation, simpler
        implementation = (
            "cudnn" if on_gpu and full_causal else "reference" if one_block else ("chunked")
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: {implementation!r} is not one of {IMPLEMENTATIONS}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if implementation == "cudnn":
        if not full_causal:
            raise ValueError("implementation: 'cudnn' needs a full causal sequence (no positions)")
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn"
        )
    if implementation == "reference":
        return reference_attention(q, k, v, q_positions, k_positions, k_valid, q_lower, scale=scale)
    qp, kp, kv, lo = _defaults(q, k, q_positions, k_positions, k_valid, q_lower)
    bq, bk = _block(q.shape[1], block_q), _block(k.shape[1], block_k)
    return _chunked(q, k, v, qp, kp, kv, lo, scale, bq, bk)
