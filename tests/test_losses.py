"""Policy / value losses, KL, entropy, aggregation: gradients, ratio levels, micro-batching."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpo_jax import losses as L
from mpo_jax.advantages import turn_log_ratio
from tests.batches import random_batch

SEEDS = st.integers(0, 2**31 - 1)

# Two rows. Row 0: turn 0 = positions 1-2, turn 1 = positions 4-6. Row 1: one turn, positions 0-1.
MASK = np.array([[0, 1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]], bool)
TID = np.array([[-1, 0, 0, -1, 1, 1, 1], [0, 0, -1, -1, -1, -1, -1]], np.int32)


def test_aggregation_modes_hand_computed():
    # Loss 1..7 per position. Row 0 tokens: 2,3 | 5,6,7 (sum 23, 5 tokens); row 1: 1,2 (sum 3).
    x = np.tile(np.arange(1.0, 8.0), (2, 1))
    s, c = L.aggregate(x, MASK, TID, mode="token_mean")
    assert (float(s), float(c)) == (26.0, 7.0)
    s, c = L.aggregate(x, MASK, TID, mode="seq_mean_token_mean")  # 23/5 + 3/2 over 2 rows
    np.testing.assert_allclose((s, c), (23 / 5 + 1.5, 2.0))
    s, c = L.aggregate(x, MASK, TID, mode="seq_mean_token_sum")
    np.testing.assert_allclose((s, c), (26.0, 2.0))
    s, c = L.aggregate(x, MASK, TID, mode="turn_mean_token_mean")  # turns: 2.5, 6, 1.5
    np.testing.assert_allclose((s, c), (2.5 + 6 + 1.5, 3.0))
    with pytest.raises(ValueError, match="aggregation: unknown mode 'sum'"):
        L.aggregate(x, MASK, TID, mode="sum")


@pytest.mark.parametrize("jit", [False, True])
def test_mpo_gradient_carries_each_tokens_own_advantage(jit):
    rng = np.random.default_rng(0)
    old = -rng.uniform(0.5, 2.0, size=MASK.shape)
    logp = old + np.where(MASK, rng.normal(scale=0.15, size=MASK.shape), 0)
    advs = np.where(MASK, rng.normal(size=MASK.shape), 0)

    def loss(lp):
        return L.policy_loss(
            lp, old, advs, MASK, TID, ratio_level="turn", clip_low=0.1, clip_high=0.1
        )[0]

    grad_fn = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    grad = np.asarray(grad_fn(jnp.asarray(logp, jnp.float32)))
    rho = np.exp(np.asarray(turn_log_ratio(logp, old, MASK, TID)))
    count = MASK.sum()
    clipped = ((advs > 0) & (rho > 1.1)) | ((advs < 0) & (rho < 0.9))
    expected = np.where(MASK & ~clipped, -rho * advs / count, 0)
    assert clipped[MASK].any() and (~clipped[MASK]).any()  # both cases are exercised
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_ratio_levels_values_and_equivalences():
    rng = np.random.default_rng(1)
    old = -rng.uniform(0.5, 2.0, size=MASK.shape)
    logp = old + np.where(MASK, rng.normal(scale=0.1, size=MASK.shape), 0)
    ones = np.where(MASK, 1.0, 0)
    wide = dict(clip_low=10.0, clip_high=10.0)  # nothing clipped: loss = -mean(w)

    # GSPO: the stop-gradient form has the value of the length-normalised sequence ratio.
    _, m = L.policy_loss(logp, old, ones, MASK, TID, ratio_level="sequence", **wide)
    seq = [np.exp(np.mean((logp - old)[i][MASK[i]])) for i in range(2)]
    expected_mean = (seq[0] * 5 + seq[1] * 2) / 7
    np.testing.assert_allclose(m["ratio_mean"], expected_mean, rtol=1e-5)

    # One token per turn: the turn ratio is the token ratio.
    one_tok = np.where(MASK, np.cumsum(MASK, axis=1) - 1, -1)
    a = L.policy_loss(logp, old, ones, MASK, one_tok, ratio_level="turn", **wide)[0]
    b = L.policy_loss(logp, old, ones, MASK, one_tok, ratio_level="token", **wide)[0]
    np.testing.assert_allclose(a, b, rtol=1e-6)

    # One turn per trajectory with reduce="sum": the turn ratio is the un-normalised sequence one.
    one_turn = np.where(MASK, 0, -1)
    a = L.policy_loss(logp, old, ones, MASK, one_turn, ratio_level="turn", **wide)[0]
    b = L.policy_loss(
        logp, old, ones, MASK, one_turn, ratio_level="sequence", ratio_reduce="sum", **wide
    )[0]
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_clamp_keeps_a_long_turn_finite():
    # A 2,000-token turn with log-ratio 0.05 per token: L = 100, exp(100) overflows float32.
    t = 2000
    mask = np.ones((1, t), bool)
    tid = np.zeros((1, t), np.int32)
    old = np.full((1, t), -1.0, np.float32)
    logp = old + 0.05
    for adv in (1.0, -1.0):
        advs = np.full((1, t), adv, np.float32)

        def loss(lp, advs=advs):
            return L.policy_loss(lp, old, advs, mask, tid, ratio_level="turn")[0]

        value, grad = jax.value_and_grad(loss)(jnp.asarray(logp))
        assert np.isfinite(value) and np.all(np.isfinite(grad))
    # ... and without the clamp it would not be: the test can fail.
    value = L.policy_loss(logp, old, -np.ones((1, t)), mask, tid, log_ratio_clamp=1e9)[0]
    assert not np.isfinite(value)


@functools.partial(jax.jit, static_argnames=("mode", "kind"))
def _loss_grad(x, other, target, mask, tid, normalizer, *, mode, kind):
    """The gradient of the policy loss (x = logp, other = old_logp, target = advantages) or the
    value loss (x = values, other = old values, target = returns), divided by ``normalizer``.
    Jitted with the data as arguments: one compile per shape serves every example."""

    def loss(x):
        if kind == "policy":
            fn, args = L.policy_loss, (x, other, target, mask, tid)
        else:
            fn, args = L.value_loss, (x, other, target, mask, tid)
        return fn(*args, aggregation=mode, normalizer=normalizer)[0]

    return jax.grad(loss)(x)


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
@hypothesis.given(seed=SEEDS)
def test_micro_batches_accumulate_to_the_full_batch_gradient(mode, seed):
    with jax.enable_x64(True):
        b = random_batch(np.random.default_rng(seed), batch=8, length=24)
        advs = np.where(b.loss_mask, np.random.default_rng(seed).normal(size=b.logp.shape), 0)
        for kind, x, other, target in (
            ("policy", b.logp, b.old_logp, advs),
            ("value", b.values + 0.3, b.values, b.rewards),
        ):
            _, count = L.aggregate(np.zeros(x.shape), b.loss_mask, b.turn_ids, mode=mode)

            def grad(rows, normalizer, kind=kind, x=x, other=other, target=target):
                data = (x[rows], other[rows], target[rows], b.loss_mask[rows], b.turn_ids[rows])
                return np.asarray(_loss_grad(*data, normalizer, mode=mode, kind=kind))

            # Σ over micro-batches of grad(loss_mb / full count) = grad of the full-batch loss
            # (which divides by its own count: normalizer None)
            full = grad(slice(None), None)
            acc = np.zeros_like(x)
            for rows in (slice(0, 3), slice(3, 5), slice(5, 8)):
                acc[rows] += grad(rows, count)
            np.testing.assert_allclose(acc, full, atol=1e-12)


def test_dual_clip_bounds_negative_advantage_losses():
    # Token ratio e^2 = 7.39 with Â = -1: the clipped loss would be 7.39; dual clip c = 3 caps it.
    mask = np.ones((1, 2), bool)
    tid = np.array([[0, 1]])
    logp = np.array([[2.0, 0.0]])
    old = np.zeros((1, 2))
    adv = np.array([[-1.0, 1.0]])
    loss, m = L.policy_loss(logp, old, adv, mask, tid, ratio_level="token", dual_clip=3.0)
    np.testing.assert_allclose(loss, (3.0 - 1.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["dual_clip_frac"], 0.5)
    loss, _ = L.policy_loss(logp, old, adv, mask, tid, ratio_level="token")
    np.testing.assert_allclose(loss, (np.exp(2.0) - 1.0) / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        L.policy_loss(logp, old, adv, mask, tid, dual_clip=0.5)


def test_clip_fraction_metrics():
    # Turn 0's ratio e^0.5 with Â > 0 is clipped as a whole (2 tokens); turn 1 is not.
    mask = np.ones((1, 4), bool)
    tid = np.array([[0, 0, 1, 1]])
    logp = np.array([[0.25, 0.25, 0.0, 0.0]])
    _, m = L.policy_loss(logp, np.zeros((1, 4)), np.ones((1, 4)), mask, tid, ratio_level="turn")
    np.testing.assert_allclose(m["clip_frac"], 0.5)
    np.testing.assert_allclose(m["turn_clip_frac"], 0.5)
    np.testing.assert_allclose(m["ratio_max"], np.exp(0.5), rtol=1e-6)


def test_turn_log_ratio_metrics_measure_each_turn_whatever_the_ratio_level():
    # Turn 0: two tokens at +0.25 -> |sum| 0.5, |mean| 0.25; turn 1: three tokens, -0.3, 0, 0
    # -> |sum| 0.3, |mean| 0.1. Padding (last column) counts for nothing.
    mask = np.array([[1, 1, 1, 1, 1, 0]], bool)
    tid = np.array([[0, 0, 1, 1, 1, 1]])
    logp = np.array([[0.25, 0.25, -0.3, 0.0, 0.0, 9.0]])
    for level in ("token", "turn", "sequence"):
        _, m = L.policy_loss(logp, np.zeros((1, 6)), np.ones((1, 6)), mask, tid, ratio_level=level)
        np.testing.assert_allclose(m["turn_log_ratio_abs"], (0.5 + 0.3) / 2, rtol=1e-6)
        np.testing.assert_allclose(m["turn_log_ratio_abs_max"], 0.5, rtol=1e-6)
        np.testing.assert_allclose(m["turn_mean_log_ratio_abs"], (0.25 + 0.1) / 2, rtol=1e-6)


def test_value_loss_hand_computed():
    # V = 2, V_old = 1, G = 0: unclipped ½·4 = 2; clipped V' = 1.2 -> ½·1.44 = .72; max -> 2.
    # V = 0.5, V_old = 1, G = 1: unclipped ½·.25 = .125; clipped V' = .8 -> ½·.04 = .02 -> .125.
    mask = np.ones((1, 2), bool)
    loss, m = L.value_loss(
        np.array([[2.0, 0.5]]), np.array([[1.0, 1.0]]), np.array([[0.0, 1.0]]), mask
    )
    np.testing.assert_allclose(loss, (2 + 0.125) / 2, rtol=1e-6)
    # V = 1.5, V_old = 1, G = 2: unclipped .125, clipped (1.2 - 2)² / 2 = .32 -> clipped wins.
    loss, m = L.value_loss(
        np.array([[1.5]]), np.array([[1.0]]), np.array([[2.0]]), np.ones((1, 1), bool)
    )
    np.testing.assert_allclose(loss, 0.32, rtol=1e-5)
    assert float(m["clip_frac"]) == 1.0
    loss, _ = L.value_loss(
        np.array([[1.5]]), np.array([[1.0]]), np.array([[2.0]]), np.ones((1, 1), bool), clip=None
    )
    np.testing.assert_allclose(loss, 0.125, rtol=1e-6)


def test_kl_estimators():
    logp = np.array([[-1.0, -2.0, -0.5]])
    ref = np.array([[-1.5, -1.0, -0.5]])
    mask = np.array([[1, 1, 0]], bool)
    x = logp - ref
    np.testing.assert_allclose(L.kl_penalty(logp, ref, mask, kind="k1"), [[0.5, -1.0, 0]])
    np.testing.assert_allclose(L.kl_penalty(logp, ref, mask, kind="k2"), [[0.125, 0.5, 0]])
    k3 = np.where(mask, np.exp(-x) - 1 + x, 0)
    np.testing.assert_allclose(L.kl_penalty(logp, ref, mask, kind="k3"), k3, rtol=1e-6)
    assert np.all(np.asarray(L.kl_penalty(logp, ref, mask)) >= 0)
    with pytest.raises(ValueError, match="kind"):
        L.kl_penalty(logp, ref, mask, kind="k4")


def test_k3_is_an_unbiased_kl_estimate():
    # Samples from p: mean of k3 with r = q/p estimates KL(p || q); compare with the exact value.
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.5, 0.3])
    rng = np.random.default_rng(0)
    idx = rng.choice(3, size=200_000, p=p)
    est = np.mean(
        np.asarray(
            L.kl_penalty(np.log(p[idx])[None], np.log(q[idx])[None], np.ones((1, idx.size), bool))
        )
    )
    np.testing.assert_allclose(est, np.sum(p * np.log(p / q)), rtol=0.02)


def test_entropy_from_logprobs():
    with np.errstate(divide="ignore"):
        lp = np.log(np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]))
    np.testing.assert_allclose(L.entropy_from_logprobs(lp), [np.log(2), 0.0], atol=1e-7)
    logits = np.random.default_rng(0).normal(size=(4, 11))
    lp = jax.nn.log_softmax(logits)
    p = np.exp(np.asarray(lp, np.float64))
    np.testing.assert_allclose(L.entropy_from_logprobs(lp), -(p * np.log(p)).sum(-1), rtol=1e-5)


def test_unknown_options_are_named():
    z = np.zeros((2, 7))
    with pytest.raises(ValueError, match="ratio_level"):
        L.policy_loss(z, z, z, MASK, TID, ratio_level="episode")
    with pytest.raises(ValueError, match="ratio_reduce"):
        L.policy_loss(z, z, z, MASK, TID, ratio_reduce="max")


@functools.cache
def _jitted_policy_loss(level):
    return jax.jit(functools.partial(L.policy_loss, ratio_level=level))


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
@hypothesis.given(seed=SEEDS)
def test_policy_loss_is_finite_on_random_batches(level, seed):
    b = random_batch(np.random.default_rng(seed))
    adv = np.where(b.loss_mask, 1.0, 0.0)
    loss, metrics = _jitted_policy_loss(level)(b.logp, b.old_logp, adv, b.loss_mask, b.turn_ids)
    assert np.isfinite(loss)
    assert all(np.isfinite(v) for v in metrics.values())


# -- off-policy correction: behaviour weights (decoupled PPO) ------------------------------------


def _slow_behaviour_weights(p, b, mask, tid, level, reduce, cap, bound):
    """A loop transcription of losses.behaviour_weights."""
    out = np.zeros(p.shape)
    for row in range(p.shape[0]):
        cols = np.nonzero(mask[row])[0]
        if level == "token":
            spans = [[c] for c in cols]
        elif level == "turn":
            spans = [[c for c in cols if tid[row, c] == k] for k in sorted(set(tid[row, cols]))]
        else:
            spans = [list(cols)] if cols.size else []
        for span in spans:
            d = sum(p[row, c] - b[row, c] for c in span)
            if reduce == "mean":
                d /= len(span)
            rho = np.exp(np.clip(d, -20, 20))
            w = rho if cap is None else min(rho, cap)
            if bound is not None and not 1 / bound <= rho <= bound:
                w = 0.0
            for c in span:
                out[row, c] = w
    return out


@hypothesis.given(
    seed=SEEDS,
    level=st.sampled_from(L.IS_LEVELS),
    reduce=st.sampled_from(["sum", "mean"]),
    cap=st.sampled_from([None, 1.5]),
    bound=st.sampled_from([None, 3.0]),
    jit=st.booleans(),
    f64=st.booleans(),
)
def test_behaviour_weights_match_a_slow_transcription(seed, level, reduce, cap, bound, jit, f64):
    rng = np.random.default_rng(seed)
    dtype = np.float64 if f64 else np.float32
    batch = random_batch(rng, dtype=dtype)  # edge cases: empty rows, one-token turns, one turn
    p = np.asarray(batch.old_logp)
    b = p + np.where(batch.loss_mask, rng.normal(scale=0.4, size=p.shape), 0).astype(dtype)
    fn = functools.partial(L.behaviour_weights, level=level, reduce=reduce, cap=cap,
                           mask_bound=bound)  # fmt: skip
    fn = jax.jit(fn) if jit else fn
    with jax.enable_x64(f64):
        got = np.asarray(fn(p, b, batch.loss_mask, batch.turn_ids))
    want = _slow_behaviour_weights(p, b, batch.loss_mask, batch.turn_ids, level, reduce, cap, bound)
    np.testing.assert_allclose(got, want, rtol=1e-5 if f64 else 1e-4, atol=1e-6)
    assert np.all(got[~batch.loss_mask] == 0)


def test_weighted_policy_loss_gradient_is_the_weighted_token_gradient():
    # ℓ_t ← ρ̄_t ℓ_t: each token's gradient is its unweighted gradient times its weight, the
    # weights themselves carry no gradient.
    rng = np.random.default_rng(3)
    old = -rng.uniform(0.5, 2.0, size=MASK.shape)
    logp = old + np.where(MASK, rng.normal(scale=0.05, size=MASK.shape), 0)
    advs = np.where(MASK, rng.normal(size=MASK.shape), 0)
    weights = np.where(MASK, rng.uniform(0.2, 2.0, size=MASK.shape), 0)

    def loss(lp, w):
        return L.policy_loss(lp, old, advs, MASK, TID, ratio_level="token", is_weights=w)[0]

    g_weighted = np.asarray(jax.grad(loss)(jnp.asarray(logp), jnp.asarray(weights)))
    g_plain = np.asarray(jax.grad(loss)(jnp.asarray(logp), jnp.asarray(np.where(MASK, 1.0, 0))))
    np.testing.assert_allclose(g_weighted, g_plain * weights, rtol=1e-5, atol=1e-9)
    assert not np.any(jax.grad(loss, argnums=1)(jnp.asarray(logp), jnp.asarray(weights)))


@pytest.mark.parametrize("level, reduce", [("token", "sum"), ("turn", "sum"), ("sequence", "sum")])
def test_untruncated_weights_make_the_behaviour_estimate_unbiased(level, reduce):
    # A two-turn episode of 2 + 1 tokens over a 3-word vocabulary, each token drawn independently
    # from known behaviour (b) and proximal (p) policies: enumerating all 27 sequences,
    # E_b[ρ f] = E_p[f] exactly, for an f of each token (token level) or of the whole span.
    rng = np.random.default_rng(4)
    b_probs = rng.dirichlet(np.ones(3), size=3)  # per position
    p_probs = rng.dirichlet(np.ones(3), size=3)
    mask = np.ones((1, 3), bool)
    tid = np.array([[0, 0, 1]], np.int32)
    f_table = rng.normal(size=(3, 3))
    seqs = np.array(np.meshgrid(*[range(3)] * 3, indexing="ij")).reshape(3, -1).T
    rows = len(seqs)
    b_logp = np.log(b_probs[np.arange(3), seqs])
    p_logp = np.log(p_probs[np.arange(3), seqs])
    with jax.enable_x64(True):  # exact enumeration: float64 throughout
        w = np.asarray(L.behaviour_weights(p_logp, b_logp, np.repeat(mask, rows, 0),
                                           np.repeat(tid, rows, 0), level=level, reduce=reduce,
                                           cap=None))  # fmt: skip
    f = f_table[np.arange(3), seqs]  # f of each token
    b_prob, p_prob = np.exp(b_logp.sum(1)), np.exp(p_logp.sum(1))
    np.testing.assert_allclose(b_prob.sum(), 1.0)
    # each token's estimate E_b[w_t f_t] equals E_p[f_t]
    np.testing.assert_allclose((b_prob[:, None] * w * f).sum(0), (p_prob[:, None] * f).sum(0),
                               rtol=1e-10)  # fmt: skip
    # a capped weight is biased low where it binds (the price of bounded variance)
    capped = np.asarray(
        L.behaviour_weights(
            p_logp, b_logp, np.repeat(mask, rows, 0), np.repeat(tid, rows, 0), level=level, cap=1.0
        )
    )
    assert (b_prob[:, None] * capped).sum(0).max() < 1 - 1e-3


def test_behaviour_weights_refuse_bad_settings():
    with pytest.raises(ValueError, match="level: unknown level 'row'"):
        L.behaviour_weights(MASK * 0.0, MASK * 0.0, MASK, TID, level="row")
    with pytest.raises(ValueError, match="cap: must be > 0"):
        L.behaviour_weights(MASK * 0.0, MASK * 0.0, MASK, TID, cap=0.0)
    with pytest.raises(ValueError, match="mask_bound: must be > 1"):
        L.behaviour_weights(MASK * 0.0, MASK * 0.0, MASK, TID, mask_bound=0.5)
