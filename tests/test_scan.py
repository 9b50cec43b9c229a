"""The linear-recurrence primitive against a Python loop, both strategies, values and gradients."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpo_jax.scan import forward_linear_scan, reverse_linear_scan


def loop(a, c, init):
    y = np.array(init, float)
    out = np.zeros_like(a)
    for t in reversed(range(a.shape[-1])):
        y = a[..., t] + c[..., t] * y
        out[..., t] = y
    return out


# Lengths: the edge cases of both strategies (1, 2, 3; powers of two and their neighbours, where
# the associative scan's odd/even split changes) and a few others; each new length compiles.
LENGTHS = st.sampled_from([1, 2, 3, 5, 7, 8, 9, 16, 31, 33, 64, 70])


@pytest.mark.parametrize("method", ["sequential", "associative"])
@hypothesis.given(seed=st.integers(0, 2**31 - 1), t=LENGTHS)
def test_reverse_scan_matches_loop(method, seed, t):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(3, t))
    c = rng.choice([0.0, 0.5, 0.99, 1.0], size=(3, t))
    init = rng.normal(size=3)
    with jax.enable_x64(True):
        out = reverse_linear_scan(a, c, init, method=method)
        np.testing.assert_allclose(out, loop(a, c, init), atol=1e-12)
        fwd = forward_linear_scan(a[:, ::-1], c[:, ::-1], init, method=method)
        np.testing.assert_allclose(fwd[:, ::-1], loop(a, c, init), atol=1e-12)


def test_scan_over_another_axis_and_jit():
    a = np.arange(12.0).reshape(4, 3)
    c = np.full((4, 3), 0.5)
    out = jax.jit(lambda a, c: reverse_linear_scan(a, c, axis=0))(a, c)
    np.testing.assert_allclose(out, loop(a.T, c.T, np.zeros(3)).T, rtol=1e-6)


def test_gradients_of_both_strategies_agree():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(2, 33)), jnp.float32)
    c = jnp.asarray(rng.uniform(size=(2, 33)), jnp.float32)

    def loss(a, c, method):
        return jnp.sum(jnp.sin(reverse_linear_scan(a, c, 0.3, method=method)))

    g_seq = jax.grad(loss, argnums=(0, 1))(a, c, "sequential")
    g_assoc = jax.grad(loss, argnums=(0, 1))(a, c, "associative")
    for x, y in zip(g_seq, g_assoc, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def test_shape_mismatch_and_unknown_method_are_named():
    with pytest.raises(ValueError, match="a has shape"):
        reverse_linear_scan(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="method"):
        reverse_linear_scan(np.zeros(3), np.zeros(3), method="parallel")
