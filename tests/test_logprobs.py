"""Chunked log-probs and entropy equal the naive computation, values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.logprobs import logprobs_and_entropy, naive_logprobs_and_entropy


def setup(vocab_axis, seed=0, shape=(3, 13), d=24, vocab=301):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(*shape, d)), jnp.float32)
    w_shape = (d, vocab) if vocab_axis == -1 else (vocab, d)
    w = jnp.asarray(rng.normal(scale=0.5, size=w_shape), jnp.float32)
    y = jnp.asarray(rng.integers(0, vocab, size=shape), jnp.int32)
    weights = jnp.asarray(rng.normal(size=shape), jnp.float32)  # arbitrary cotangents
    return h, w, y, weights


@pytest.mark.parametrize("vocab_axis", [-1, 0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize(
    "shape, chunk",
    # rows of 13 tokens are one chunk whatever the size (a row's chunk is at least 16 tokens);
    # rows of 40 in chunks of 16 are three, the last one padded
    [((3, 13), 1), ((3, 13), 64), ((2, 40), 32), ((1, 40), 16)],
)
def test_values_and_gradients_match_naive(vocab_axis, temperature, shape, chunk):
    h, w, y, c = setup(vocab_axis, shape=shape)
    kw = dict(temperature=temperature, vocab_axis=vocab_axis)

    def loss(fn, h, w, **extra):
        logp, ent = fn(h, w, y, **kw, **extra)
        return jnp.sum(c * logp) + 0.3 * jnp.sum(c[::-1] * ent), (logp, ent)

    (l_ref, (lp_ref, ent_ref)), g_ref = jax.value_and_grad(
        lambda h, w: loss(naive_logprobs_and_entropy, h, w), argnums=(0, 1), has_aux=True
    )(h, w)
    (l_new, (lp_new, ent_new)), g_new = jax.jit(
        jax.value_and_grad(
            lambda h, w: loss(logprobs_and_entropy, h, w, chunk_size=chunk),
            argnums=(0, 1),
            has_aux=True,
        )
    )(h, w)
    np.testing.assert_allclose(lp_new, lp_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent_new, ent_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_new, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_matches_log_softmax_of_logits_directly():
    h, w, y, _ = setup(-1, seed=3)
    logits = np.asarray(h) @ np.asarray(w, np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = np.take_along_axis(logp_all, np.asarray(y)[..., None], -1)[..., 0]
    logp, ent = logprobs_and_entropy(h, w, y, chunk_size=5)
    np.testing.assert_allclose(logp, expected, rtol=1e-5, atol=1e-5)
    p = np.exp(logp_all)
    np.testing.assert_allclose(ent, -(p * logp_all).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [0.0, 1e-3, 60.0], ids=["uniform", "flat", "peaked"])
def test_entropy_at_the_extremes_of_the_softmax(scale):
    # One exponential per logit serves log-prob and entropy: exact from a uniform distribution
    # (H = log V) to a nearly one-hot one (logits hundreds apart, H -> 0); float64 inputs are
    # computed in float32 like the rest (the kernel's accumulation dtype).
    with jax.enable_x64():
        for dtype in (jnp.float32, jnp.float64):
            h, w, y, _ = setup(-1, seed=4)
            h = (h * scale).astype(dtype)
            w = w.astype(dtype)
            logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
            logits -= logits.max(-1, keepdims=True)
            logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            logp, ent = jax.jit(logprobs_and_entropy)(h, w, y)
            tol = 1e-5
            want = -(np.exp(logp_all) * logp_all).sum(-1)
            np.testing.assert_allclose(ent, want, rtol=tol * (1 + scale), atol=tol * (1 + scale))
            np.testing.assert_allclose(
                logp,
                np.take_along_axis(logp_all, np.asarray(y)[..., None], -1)[..., 0],
                rtol=tol * (1 + scale),
                atol=tol * (1 + scale),
            )
            if scale == 0.0:
                np.testing.assert_allclose(ent, np.log(w.shape[1]), rtol=tol)


def test_bfloat16_inputs_compute_in_float32():
    h, w, y, _ = setup(0, seed=1)
    logp, _ = logprobs_and_entropy(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), y, vocab_axis=0)
    assert logp.dtype == jnp.float32
    ref, _ = naive_logprobs_and_entropy(
        h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), y, vocab_axis=0
    )
    np.testing.assert_allclose(logp, ref, rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_named():
    h, w, y, _ = setup(-1)
    with pytest.raises(ValueError, match="weight: shape"):
        logprobs_and_entropy(h, w.T, y)
    with pytest.raises(ValueError, match="vocab_axis"):
        logprobs_and_entropy(h, w, y, vocab_axis=1)
