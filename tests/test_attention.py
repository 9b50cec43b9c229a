"""Blockwise attention against the whole-matrix reference: values, gradients, masks by position,
grouped heads, empty rows, dtypes; and no [T, T] matrix kept for the backward pass."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import attention, reference_attention


def _inputs(rng, b, tq, tk, hq, hkv, d, dtype=jnp.float32):
    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    return arr(b, tq, hq, d), arr(b, tk, hkv, d), arr(b, tk, hkv, d)


def _masks(rng, b, tq, tk, kind):
    """Positions and valid keys: a full causal sequence, a cache (queries at offsets, keys at
    slots, slots past a row's length invalid), or random non-decreasing positions with holes."""
    if kind == "causal":
        return None, None, None
    if kind == "cache":
        lengths = rng.integers(0, tk - tq + 1, size=b)
        qp = lengths[:, None] + np.arange(tq)[None]
        kp = np.broadcast_to(np.arange(tk), (b, tk))
        return (jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32),
                jnp.asarray(kp < (lengths + tq)[:, None]))  # fmt: skip
    qp = np.sort(rng.integers(-2, tk, size=(b, tq)), axis=1)  # some queries see nothing
    kp = np.sort(rng.integers(0, tk, size=(b, tk)), axis=1)
    valid = rng.random((b, tk)) > 0.3
    valid[0] = False  # a row with no valid key at all
    return jnp.asarray(qp, jnp.int32), jnp.asarray(kp, jnp.int32), jnp.asarray(valid)


@settings(max_examples=8)  # each example compiles its shapes: few shapes, many mask draws
@given(
    seed=st.integers(0, 2**16),
    tq=st.sampled_from([1, 17, 40]),
    extra=st.sampled_from([0, 24]),
    heads=st.sampled_from([(4, 2), (6, 1)]),
    kind=st.sampled_from(["causal", "cache", "random"]),
)
def test_chunked_equals_the_reference_in_value_and_gradient(seed, tq, extra, heads, kind):
    rng = np.random.default_rng(seed)
    tk = tq if kind == "causal" else tq + extra
    q, k, v = _inputs(rng, 2, tq, tk, heads[0], heads[1], 8)
    masks = _masks(rng, 2, tq, tk, kind)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, *masks) * w)

    chunked = lambda *a: attention(*a, block_q=8, block_k=16)  # noqa: E731
    np.testing.assert_allclose(jax.jit(chunked)(q, k, v, *masks),
                               reference_attention(q, k, v, *masks), atol=2e-5)  # fmt: skip
    got = jax.jit(jax.grad(loss(chunked), (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(reference_attention), (0, 1, 2)))(q, k, v)
    for g, r in zip(got, want, strict=True):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, atol=5e-5)


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_packed_sequences_equal_the_same_sequences_apart(impl):
    # One row holding three sequences (lengths 5, 1, 20): each token attends within its own, so
    # outputs and gradients equal the three attended separately.
    rng = np.random.default_rng(3)
    lengths = [5, 1, 20]
    t = sum(lengths)
    q, k, v = _inputs(rng, 1, t, t, 4, 2, 8)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    starts = np.repeat(np.cumsum([0] + lengths[:-1]), lengths)[None].astype(np.int32)
    cols = jnp.arange(t, dtype=jnp.int32)[None]
    if impl == "chunked":
        fn = lambda *a: attention(*a, block_q=8, block_k=8)  # noqa: E731
    else:
        fn = reference_attention

    def packed(q, k, v):
        return jnp.sum(fn(q, k, v, cols, cols, None, jnp.asarray(starts)) * w)

    def apart(q, k, v):
        total, at = 0.0, 0
        for n in lengths:
            sl = slice(at, at + n)
            total += jnp.sum(reference_attention(q[:, sl], k[:, sl], v[:, sl]) * w[:, sl])
            at += n
        return total

    np.testing.assert_allclose(jax.jit(packed)(q, k, v), apart(q, k, v), rtol=1e-5)
    got = jax.jit(jax.grad(packed, (0, 1, 2)))(q, k, v)
    for g, r in zip(got, jax.jit(jax.grad(apart, (0, 1, 2)))(q, k, v), strict=True):
        np.testing.assert_allclose(g, r, atol=5e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_a_query_that_sees_nothing_gets_zero_and_no_gradient(jit):
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, 1, 4, 6, 2, 1, 8)
    qp = jnp.asarray([[-1, 0, 1, 2]], jnp.int32)  # query 0 precedes every key
    kp = jnp.arange(6, dtype=jnp.int32)[None]
    fn = jax.jit(attention) if jit else attention
    out = fn(q, k, v, qp, kp, None)
    np.testing.assert_array_equal(out[0, 0], 0)
    g = jax.grad(lambda q: jnp.sum(attention(q, k, v, qp, kp, None)))(q)
    np.testing.assert_array_equal(g[0, 0], 0)
    assert np.all(np.isfinite(g))


def test_bfloat16_inputs_accumulate_in_float32():
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, 2, 64, 64, 4, 2, 16)
    ref = reference_attention(q, k, v)
    out = attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), block_q=16, block_k=16)
    assert out.dtype == jnp.bfloat16
    # bfloat16 inputs (8 bits of mantissa): within a few percent of the float32 result
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=0.05, rtol=0.05)
    # ... and so are the gradients (bfloat16 keeps the scale in the float32 scores; float32
    # queries take it before the loops: both ways against the float32 reference)
    w = jnp.asarray(rng.normal(size=ref.shape), jnp.float32)

    def grads(fn, dtype):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)  # noqa: E731
        return jax.grad(loss, (0, 1, 2))(*(x.astype(dtype) for x in (q, k, v)))

    chunked = functools.partial(attention, implementation="chunked", block_q=16, block_k=16)
    pairs = zip(grads(chunked, jnp.bfloat16), grads(reference_attention, jnp.float32), strict=True)
    for got, want in pairs:
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.03 * scale)


def test_the_backward_pass_keeps_no_token_by_token_matrix():
    # Compiled on abstract shapes: the gradient's temporaries at 4,096 tokens stay far below one
    # [heads, T, T] float32 score matrix (what the reference keeps), and grow ~linearly with T.
    def temp_bytes(fn, t):
        s = jax.ShapeDtypeStruct
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), (0, 1, 2)))
        args = (s((1, t, 8, 64), jnp.float32), s((1, t, 2, 64), jnp.float32))
        compiled = grad.lower(args[0], args[1], args[1]).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    matrix = 8 * 4096 * 4096 * 4
    chunked = temp_bytes(attention, 4096)
    assert chunked < matrix / 8, (chunked, matrix)
    assert temp_bytes(reference_attention, 4096) >= matrix  # the reference does keep it
    assert temp_bytes(attention, 8192) < 3 * chunked  # linear, not quadratic, in T


def test_bad_shapes_and_implementations_are_named():
    q = jnp.zeros((1, 4, 3, 8))
    k = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="not a multiple of key/value heads"):
        attention(q, k, k)
    with pytest.raises(ValueError, match="implementation: 'flash' is not one of"):
        attention(q[:, :, :2], k, k, implementation="flash")
    with pytest.raises(ValueError, match="'cudnn' needs a full causal sequence"):
        pos = jnp.zeros((1, 4), jnp.int32)
        attention(q[:, :, :2], k, k, pos, pos, implementation="cudnn")
