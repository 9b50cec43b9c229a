"""Token log-probs and entropy from final hidden states, without [tokens, vocab] logits at once.

For hidden states h_n, the LM head W and temperature τ (τ = 0, greedy, is treated as 1):

    z_n = h_n W / τ,   lse_n = log Σ_v exp(z_nv),
    logp_n = z_n[y_n] - lse_n,   H_n = lse_n - Σ_v p_nv z_nv      (p = softmax(z))

The forward pass takes one exponential per logit for both outputs (with m = max z,
e = exp(z - m) and s = Σ e: lse = m + log s and H = log s - Σ e (z - m) / s), which halves its
cost on a CPU against a second softmax pass for the entropy. The tokens of each row are processed
in chunks along the sequence with ``lax.scan`` (the rows stay a batch axis of their own, so a
batch split over devices stays split); a custom VJP recomputes each chunk's logits in the
backward pass, where

    ∂logp/∂z = onehot(y) - p,    ∂H/∂z = -p (log p + H),
    ∂h = ∂z Wᵀ / τ,   ∂W = Σ_chunks hᵀ ∂z / τ,

so peak memory is one chunk's [rows, chunk, vocab] block instead of the whole [tokens, vocab]
matrix (151,936-way softmax per token is where RL trainers run out of memory). Values and
gradients equal the naive computation (`naive_logprobs_and_entropy`) to float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["logprobs_and_entropy", "token_logprobs", "naive_logprobs_and_entropy"]


def _scale(temperature: float) -> float:
    return 1.0 / temperature if temperature and temperature > 0 else 1.0


def _chunk_logits(h, w, vocab_axis, scale):
    eq = "...d,dv->...v" if vocab_axis == -1 else "...d,vd->...v"
    return jnp.einsum(eq, h, w, preferred_element_type=jnp.float32) * scale


def naive_logprobs_and_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    vocab_axis: int = -1,
) -> tuple[jax.Array, jax.Array]:
    """The reference: full [..., vocab] logits, log-softmax, gather, entropy."""
    h = hidden.reshape(-1, hidden.shape[-1])
    z = _chunk_logits(h, weight, vocab_axis, _scale(temperature))
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets.reshape(-1, 1), axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp.reshape(targets.shape), entropy.reshape(targets.shape)


def _forward_chunks(h, w, y, vocab_axis, scale):
    """(logp, entropy, lse) per token; h [n_chunks, B, chunk, D], y [n_chunks, B, chunk]."""

    def body(_, xs):
        hc, yc = xs
        z = _chunk_logits(hc, w, vocab_axis, scale)  # [B, chunk, V]
        # One exponential per logit for both: with m = max z, e = exp(z - m), s = Σ e,
        # lse = m + log s and H = lse - Σ p z = log s - Σ e (z - m) / s.
        m = jnp.max(z, axis=-1, keepdims=True)
        shifted = z - m
        e = jnp.exp(shifted)
        # s and Σ e (z - m) in one pass over the block, a variadic reduction: with two sums,
        # XLA's CPU backend took 268 ms for these statistics of a [1,022 x 49,152] block
        # (SmolLM2's 2 x 512 tokens), with one 81 ms.
        zero = jnp.zeros((), e.dtype)
        s, e_shifted = jax.lax.reduce(
            (e, e * shifted), (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), (e.ndim - 1,)
        )
        log_s = jnp.log(s)
        lse = m[..., 0] + log_s
        logp = jnp.take_along_axis(z, yc[..., None], axis=-1)[..., 0] - lse
        entropy = log_s - e_shifted / s
        return None, (logp, entropy, lse)

    _, out = jax.lax.scan(body, None, (h, y))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(h, w, y, vocab_axis, scale):
    logp, entropy, _ = _forward_chunks(h, w, y, vocab_axis, scale)
    return logp, entropy


def _chunked_fwd(h, w, y, vocab_axis, scale):
    logp, entropy, lse = _forward_chunks(h, w, y, vocab_axis, scale)
    return (logp, entropy), (h, w, y, lse, entropy)


def _chunked_bwd(vocab_axis, scale, residuals, grads):
    h, w, y, lse, entropy = residuals
    g_logp, g_ent = grads

    def body(dw, xs):
        hc, yc, lse_c, ent_c, gl, ge = xs
        z = _chunk_logits(hc, w, vocab_axis, scale)
        log_p = z - lse_c[..., None]
        # dz = gl (onehot(y) - p) - ge p (log p + H), the one-hot part added where y is (no
        # [B, C, V] one-hot matrix): one fused elementwise pass, then the additions.
        dz = -jnp.exp(log_p) * (gl[..., None] + ge[..., None] * (log_p + ent_c[..., None]))
        hit = jnp.arange(z.shape[-1])[None, None, :] == yc[..., None]
        dz = (dz + jnp.where(hit, gl[..., None], 0.0)) * scale
        wf = w.astype(jnp.float32)
        hf = hc.astype(jnp.float32)
        dh = jnp.einsum("bcv,dv->bcd" if vocab_axis == -1 else "bcv,vd->bcd", dz, wf)
        # ∂W accumulates as [D, V] whatever W's layout: the chunk's [B, C, V] gradient is then
        # read in the layout it was written in (a [V, D] accumulator made XLA write it a second
        # time, transposed, recomputing its exponentials); one [D, V] transpose at the end.
        dw = dw + jnp.einsum("bcd,bcv->dv", hf, dz)
        return dw, dh.astype(hc.dtype)

    dw0 = jnp.zeros(w.shape if vocab_axis == -1 else w.shape[::-1], jnp.float32)  # [D, V]
    dw, dh = jax.lax.scan(body, dw0, (h, y, lse, entropy, g_logp, g_ent))
    dw = dw if vocab_axis == -1 else dw.T
    return dh, dw.astype(w.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def logprobs_and_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    vocab_axis: int = -1,
) -> tuple[jax.Array, jax.Array]:
    """Per-token ``log p(y)`` and entropy of ``softmax(h W / τ)``, chunked over tokens.

    Args:
      hidden: [..., N, D] final hidden states (after the final norm); leading axes are rows.
      weight: the LM head, [D, vocab] (``vocab_axis=-1``) or [vocab, D] (``vocab_axis=0``, a tied
        embedding table, used without a transpose).
      targets: int [...] token ids whose log-probs are wanted (the next tokens).
      temperature: the sampling temperature τ; 0 (greedy) means plain softmax.
      chunk_size: tokens per chunk over all rows (each row's chunk is chunk_size / rows, at
        least 16); peak memory is about chunk_size x vocab floats.

    Returns:
      (logp, entropy), float32, shaped like ``targets``. Differentiable in hidden and weight.
    """
    if vocab_axis not in (-1, 0):
        raise ValueError(f"vocab_axis: must be -1 ([D, vocab]) or 0 ([vocab, D]), got {vocab_axis}")
    d = hidden.shape[-1]
    if weight.ndim != 2 or weight.shape[1 if vocab_axis == 0 else 0] != d:
        raise ValueError(f"weight: shape {weight.shape} does not match hidden size {d}")
    shape = targets.shape
    if hidden.shape[:-1] != shape:
        raise ValueError(f"hidden: shape {hidden.shape} does not match targets {shape} + (D,)")
    if len(shape) < 2:  # [N] tokens: one row
        hidden, targets = hidden[None], targets[None]
    h = hidden.reshape(-1, hidden.shape[-2], d)  # [rows, N, D]: the rows stay their own axis
    y = targets.reshape(-1, targets.shape[-1]).astype(jnp.int32)
    rows, n = y.shape
    chunk = max(1, min(max(chunk_size // rows, 16), n))
    pad = (-n) % chunk
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        y = jnp.pad(y, ((0, 0), (0, pad)))
    h = jnp.moveaxis(h.reshape(rows, -1, chunk, d), 1, 0)  # [n_chunks, rows, chunk, D]
    y = jnp.moveaxis(y.reshape(rows, -1, chunk), 1, 0)
    logp, entropy = _chunked(h, weight, y, vocab_axis, _scale(temperature))

    def back(x):
        return jnp.moveaxis(x, 0, 1).reshape(rows, -1)[:, :n].reshape(shape)

    return back(logp), back(entropy)


def token_logprobs(hidden, weight, targets, **kwargs) -> jax.Array:
    """Per-token log-probs only (see `logprobs_and_entropy`)."""
    return logprobs_and_entropy(hidden, weight, targets, **kwargs)[0]
