"""The advantage estimators: hand-worked cases, the math against a slow reference, invariants."""

from __future__ import annotations

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpo_jax import advantages as A
from mpo_jax.batch import broadcast_trajectory_values, trajectory_sums, turn_mean
from tests import reference as ref
from tests.batches import random_batch

# ------------------------------------------------------------------------------------------------
# The worked example used by every hand-computed test.
#
#   position   0       1     2     3      4     5     6
#   role       prompt  t0    t0    obs    t1    t1    pad
#   loss_mask  F       T     T     F      T     T     F
#   turn_ids   -1      0     0     -1     1     1     -1
#   reward     0       0     0     0      0     1     0      (outcome on the last action token)
#   value      0       .1    .2    0      .3    .4    0
# ------------------------------------------------------------------------------------------------
MASK = np.array([[0, 1, 1, 0, 1, 1, 0]], bool)
TID = np.array([[-1, 0, 0, -1, 1, 1, -1]], np.int32)
REW = np.array([[0, 0, 0, 0, 0, 1.0, 0]])
VAL = np.array([[0, 0.1, 0.2, 0, 0.3, 0.4, 0]])

JIT = pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])


@functools.cache
def _maybe_jit(fn, jit, kwargs):
    f = functools.partial(fn, **dict(kwargs))
    return jax.jit(f) if jit else f


def maybe_jit(fn, jit, **kwargs):
    """``fn`` with keyword hyperparameters bound, jitted or not; cached so hypothesis examples
    with equal hyperparameters reuse one compiled function."""
    return _maybe_jit(fn, jit, tuple(sorted(kwargs.items())))


@JIT
def test_token_gae_hand_computed(jit):
    # γ = 0.9, λ = 0.8, γλ = 0.72; the observation at position 3 is jumped over.
    # δ(5) = 1 + 0.9*0 - .4 = .6                     A(5) = .6
    # δ(4) = 0 + 0.9*.4 - .3 = .06                   A(4) = .06 + .72*.6    = .492
    # δ(2) = 0 + 0.9*.3 - .2 = .07                   A(2) = .07 + .72*.492  = .42424
    # δ(1) = 0 + 0.9*.2 - .1 = .08                   A(1) = .08 + .72*.42424 = .3854528
    adv, ret = maybe_jit(A.token_gae, jit, gamma=0.9, lam=0.8)(REW, VAL, MASK)
    expected = np.array([[0, 0.3854528, 0.42424, 0, 0.492, 0.6, 0]])
    np.testing.assert_allclose(adv, expected, atol=1e-6)
    np.testing.assert_allclose(ret, np.where(MASK, expected + VAL, 0), atol=1e-6)


@JIT
def test_turn_gae_hand_computed(jit):
    # Turn 1: R = 1, δ1 = 1 + 0.9*0 - V(s1)=.3 -> .7;             A1 = .7
    # Turn 0: R = 0, δ0 = 0 + 0.9*V(s1)=.3 - V(s0)=.1 -> .17;     A0 = .17 + .72*.7 = .674
    # Returns G_k = A_k + V(s_k): .774 on turn 0, 1.0 on turn 1.
    adv, ret = maybe_jit(A.turn_gae, jit, gamma=0.9, lam=0.8)(REW, VAL, MASK, TID)
    np.testing.assert_allclose(adv, [[0, 0.674, 0.674, 0, 0.7, 0.7, 0]], atol=1e-6)
    np.testing.assert_allclose(ret, [[0, 0.774, 0.774, 0, 1.0, 1.0, 0]], atol=1e-6)


@JIT
def test_multiscale_hand_computed(jit):
    # Turn part as in turn GAE (γ_turn = .9, λ_turn = .8): A0 = .674, A1 = .7.
    # Intra-turn trace, γ_tok = λ_tok = 1:
    #   turn 0: δ(1) = 0 + 1*V(2) - V(1) = .1; δ(2) = 0 + γ_turn*V(s1) - V(2) = .27 - .2 = .07
    #           a = [.17, .07], mean .12 -> centred [+.05, -.05]
    #   turn 1: δ(4) = 0 + V(5) - V(4) = .1;   δ(5) = 1 + γ_turn*0 - .4 = .6
    #           a = [.7, .6], mean .65 -> centred [+.05, -.05]
    # β = 1: [.724, .624] and [.75, .65].
    fn = maybe_jit(
        A.multiscale_advantages,
        jit,
        gamma_turn=0.9,
        lam_turn=0.8,
        gamma_token=1.0,
        lam_token=1.0,
        beta=1.0,
    )
    np.testing.assert_allclose(
        fn(REW, VAL, MASK, TID), [[0, 0.724, 0.624, 0, 0.75, 0.65, 0]], atol=1e-6
    )


@JIT
def test_turn_log_ratio_hand_computed(jit):
    # logp - old_logp = position index: turn 0 sums 1 + 2 = 3, turn 1 sums 4 + 5 = 9.
    logp = np.arange(7.0)[None]
    old = np.zeros((1, 7))
    out = maybe_jit(A.turn_log_ratio, jit)(logp, old, MASK, TID)
    np.testing.assert_allclose(out, [[0, 3, 3, 0, 9, 9, 0]])
    out = maybe_jit(A.turn_log_ratio, jit, reduce="mean")(logp, old, MASK, TID)
    np.testing.assert_allclose(out, [[0, 1.5, 1.5, 0, 4.5, 4.5, 0]])


@JIT
def test_group_advantages_hand_computed(jit):
    # Group 7: outcomes [1, 0, 0]: mean 1/3, std (ddof 1) = sqrt(1/3) = .57735.
    # Group 3: outcomes [2, 4]: mean 3, std sqrt(2). Group 9: one member -> 0.
    x = np.array([1.0, 0.0, 0.0, 2.0, 4.0, 5.0])
    g = np.array([7, 7, 7, 3, 3, 9])
    out = maybe_jit(A.group_advantages, jit, eps=0.0)(x, g)
    s = np.sqrt(1 / 3)
    np.testing.assert_allclose(
        out, [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, -1 / np.sqrt(2), 1 / np.sqrt(2), 0], 1e-5
    )
    # RLOO: x - mean of the others; no scaling. Group 7: [1 - 0, 0 - .5, 0 - .5].
    out = maybe_jit(A.group_advantages, jit, baseline="loo", scale="none")(x, g)
    np.testing.assert_allclose(out, [1, -0.5, -0.5, -2, 2, 0], atol=1e-6)
    # Dr.GRPO: mean baseline, no scaling.
    out = maybe_jit(A.group_advantages, jit, scale="none")(x, g)
    np.testing.assert_allclose(out, [2 / 3, -1 / 3, -1 / 3, -1, 1, 0], atol=1e-6)


@JIT
def test_trace_turn_credit_hand_computed(jit):
    # ℓ̄ = [-3, -2, -1] on three boundaries (the fourth is unset); ε = .1:
    # d = [3.1, 2.1, 1.1]; δ0 = log(3.1/2.1) = .38946, δ1 = log(2.1/1.1) = .64663.
    # H = 3, γ = .8: c0 = (δ0 + .8 δ1) / 1.8 = .50376 (normalised), c1 = δ1 / 1 = .64663; c2: none.
    lp = np.array([[-3.0, -2.0, -1.0, -0.5]])
    bm = np.array([[1, 1, 1, 0]], bool)
    d0, d1 = np.log(3.1 / 2.1), np.log(2.1 / 1.1)
    out = maybe_jit(A.trace_turn_credit, jit)(lp, bm)
    np.testing.assert_allclose(out, [[(d0 + 0.8 * d1) / 1.8, d1, 0]], rtol=1e-5)
    out = maybe_jit(A.trace_turn_credit, jit, normalize=False)(lp, bm)
    np.testing.assert_allclose(out, [[d0 + 0.8 * d1, d1, 0]], rtol=1e-5)


@JIT
def test_trace_turn_advantages_hand_computed(jit):
    # Boundaries 0 (prompt) and 1 (after turn 0's tool call) exist: credit [c0] for turn 0 only.
    # Turn 1 (the answer) crosses no boundary: "zero" gives it 0, "last" repeats c0.
    credit = np.array([[0.5]])
    bm = np.array([[True, True]])
    fn = maybe_jit(A.trace_turn_advantages, jit, alpha_out=1.0, alpha_turn=0.2)
    out = fn(np.array([2.0]), credit, bm, MASK, TID)
    np.testing.assert_allclose(out, [[0, 2.1, 2.1, 0, 2.0, 2.0, 0]], atol=1e-6)
    fn = maybe_jit(A.trace_turn_advantages, jit, terminal_fill="last")
    out = fn(np.array([2.0]), credit, bm, MASK, TID)
    np.testing.assert_allclose(out, [[0, 2.1, 2.1, 0, 2.1, 2.1, 0]], atol=1e-6)


@JIT
def test_gigpo_hand_computed(jit):
    # One prompt group of two trajectories, two turns each, outcome on the last turn.
    # Episode returns [1, 0] -> A_E = [+.7071, -.7071] (std ddof 1 = .7071).
    # Turn 0 of both acted in state 5: step returns γ^1 * R = [.9, 0] -> [+.7071, -.7071].
    # Turn 1 states differ (6 vs 8): step groups of one -> 0.
    r = np.array([[0.0, 1.0], [0.0, 0.0]])
    keys = np.array([[5, 6], [5, 8]])
    mask = np.ones((2, 2), bool)
    out = maybe_jit(A.gigpo_advantages, jit, gamma=0.9, omega=1.0, eps=0.0)(
        r, keys, mask, np.array([0, 0])
    )
    h = 1 / np.sqrt(2)
    np.testing.assert_allclose(out, [[2 * h, h], [-2 * h, -h]], rtol=1e-5)


def test_gigpo_steps_of_other_groups_do_not_mix():
    # The same state key in two different prompt groups forms two step groups of one.
    r = np.array([[1.0], [0.0]])
    out = A.gigpo_advantages(r, np.array([[5], [5]]), np.ones((2, 1), bool), np.array([0, 1]))
    np.testing.assert_allclose(out, 0.0)


def test_masked_whiten_hand_computed():
    # Masked entries [1, 2, 3]: mean 2, var (ddof 1) 1 -> [-1, 0, 1]; the masked-out 100 -> 0.
    out = A.masked_whiten(np.array([1.0, 2.0, 100.0, 3.0]), np.array([1, 1, 0, 1], bool), eps=0.0)
    np.testing.assert_allclose(out, [-1, 0, 0, 1], atol=1e-6)
    # Scale only: the mean 2 is added back -> [1, 2, 3]; [2, 4, 6] (std 2) -> [3, 4, 5].
    out = A.masked_whiten(np.array([2.0, 4.0, 6.0]), np.ones(3, bool), shift_mean=False, eps=0.0)
    np.testing.assert_allclose(out, [3, 4, 5], atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Against the slow reference, on random padded batches, float64, jit and no-jit.
# ------------------------------------------------------------------------------------------------

SEEDS = st.integers(0, 2**31 - 1)
GAMMAS = st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0])
LAMS = st.sampled_from([0.0, 0.7, 0.95, 1.0])
METHODS = st.sampled_from(["sequential", "associative"])


def in_x64(test):
    """Runs the test body with float64 enabled (a decorator: hypothesis re-runs the body)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        with jax.enable_x64(True):
            return test(*args, **kwargs)

    return wrapper


@JIT
@hypothesis.given(seed=SEEDS, gamma=GAMMAS, lam=LAMS, method=METHODS)
@in_x64
def test_token_gae_matches_reference(jit, seed, gamma, lam, method):
    b = random_batch(np.random.default_rng(seed))
    boot = np.where(b.truncated, b.bootstrap_values, 0.0)
    fn = maybe_jit(A.token_gae, jit, gamma=gamma, lam=lam, method=method)
    adv, ret = fn(b.rewards, b.values, b.loss_mask, bootstrap_value=boot)
    assert adv.dtype == jnp.float64
    r_adv, r_ret = ref.token_gae(b.rewards, b.values, b.loss_mask, gamma, lam, boot)
    np.testing.assert_allclose(adv, r_adv, atol=1e-10)
    np.testing.assert_allclose(ret, r_ret, atol=1e-10)


@JIT
@hypothesis.given(seed=SEEDS, gamma=GAMMAS, lam=LAMS, method=METHODS)
@in_x64
def test_turn_gae_matches_reference(jit, seed, gamma, lam, method):
    b = random_batch(np.random.default_rng(seed))
    boot = np.where(b.truncated, b.bootstrap_values, 0.0)
    fn = maybe_jit(A.turn_gae, jit, gamma=gamma, lam=lam, method=method)
    adv, ret = fn(b.rewards, b.values, b.loss_mask, b.turn_ids, bootstrap_value=boot)
    r_adv, r_ret = ref.turn_gae(b.rewards, b.values, b.loss_mask, b.turn_ids, gamma, lam, boot)
    np.testing.assert_allclose(adv, r_adv, atol=1e-10)
    np.testing.assert_allclose(ret, r_ret, atol=1e-10)


@JIT
@hypothesis.given(
    seed=SEEDS,
    gt=GAMMAS,
    lt=LAMS,
    gk=GAMMAS,
    lk=LAMS,
    beta=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    method=METHODS,
)
@in_x64
def test_multiscale_matches_reference(jit, seed, gt, lt, gk, lk, beta, method):
    b = random_batch(np.random.default_rng(seed))
    boot = np.where(b.truncated, b.bootstrap_values, 0.0)
    fn = maybe_jit(
        A.multiscale_advantages,
        jit,
        gamma_turn=gt,
        lam_turn=lt,
        gamma_token=gk,
        lam_token=lk,
        beta=beta,
        method=method,
    )
    out = fn(b.rewards, b.values, b.loss_mask, b.turn_ids, bootstrap_value=boot)
    expected = ref.multiscale(
        b.rewards, b.values, b.loss_mask, b.turn_ids, gt, lt, gk, lk, beta, boot
    )
    np.testing.assert_allclose(out, expected, atol=1e-10)


@JIT
@hypothesis.given(seed=SEEDS, reduce=st.sampled_from(["sum", "mean"]))
@in_x64
def test_turn_log_ratio_matches_reference(jit, seed, reduce):
    b = random_batch(np.random.default_rng(seed))
    out = maybe_jit(A.turn_log_ratio, jit, reduce=reduce)(
        b.logp, b.old_logp, b.loss_mask, b.turn_ids
    )
    expected = ref.turn_log_ratio(b.logp, b.old_logp, b.loss_mask, b.turn_ids, reduce)
    np.testing.assert_allclose(out, expected, atol=1e-10)


@JIT
@hypothesis.given(
    seed=SEEDS,
    n=st.integers(1, 24),
    baseline=st.sampled_from(["mean", "loo"]),
    scale=st.sampled_from(["std", "none"]),
)
@in_x64
def test_group_advantages_match_reference_and_sum_to_zero(jit, seed, n, baseline, scale):
    rng = np.random.default_rng(seed)
    groups = rng.integers(-3, 5, size=n) * 1000  # sparse, negative ids too
    x = rng.integers(0, 3, size=n).astype(np.float64) + 0.1 * rng.normal(size=n)
    out = maybe_jit(A.group_advantages, jit, baseline=baseline, scale=scale)(x, groups)
    np.testing.assert_allclose(out, ref.group_advantages(x, groups, baseline, scale), atol=1e-9)
    for g in np.unique(groups):
        assert abs(float(np.sum(np.asarray(out)[groups == g]))) < 1e-8


@JIT
@hypothesis.given(seed=SEEDS, horizon=st.integers(1, 5), gamma=GAMMAS, normalize=st.booleans())
@in_x64
def test_trace_credit_matches_reference(jit, seed, horizon, gamma, normalize):
    rng = np.random.default_rng(seed)
    b, m = 5, 7
    n = rng.integers(0, m + 1, size=b)
    bm = np.arange(m)[None] < n[:, None]
    lp = -rng.exponential(size=(b, m)) * 3
    fn = maybe_jit(A.trace_turn_credit, jit, horizon=horizon, gamma=gamma, normalize=normalize)
    out = fn(lp, bm)
    expected = ref.trace_credit(lp, bm, 0.1, horizon, gamma, normalize)
    np.testing.assert_allclose(out, expected, atol=1e-10)


# ------------------------------------------------------------------------------------------------
# Invariants and equivalences between estimators.
# ------------------------------------------------------------------------------------------------


@hypothesis.given(seed=SEEDS, beta=st.floats(-3, 3), gk=GAMMAS, lk=LAMS)
@in_x64
def test_multiscale_preserves_turn_means_for_any_beta(seed, beta, gk, lk):
    b = random_batch(np.random.default_rng(seed))
    kw = dict(gamma_turn=0.95, lam_turn=0.9)
    mae = A.multiscale_advantages(
        b.rewards, b.values, b.loss_mask, b.turn_ids, gamma_token=gk, lam_token=lk, beta=beta, **kw
    )
    turn_adv, _ = A.turn_gae(b.rewards, b.values, b.loss_mask, b.turn_ids, gamma=0.95, lam=0.9)
    np.testing.assert_allclose(turn_mean(mae, b.loss_mask, b.turn_ids), turn_adv, atol=1e-10)


@hypothesis.given(seed=SEEDS, gamma=GAMMAS, lam=LAMS)
@in_x64
def test_multiscale_with_beta_zero_is_turn_gae(seed, gamma, lam):
    b = random_batch(np.random.default_rng(seed))
    mae = A.multiscale_advantages(
        b.rewards,
        b.values,
        b.loss_mask,
        b.turn_ids,
        gamma_turn=gamma,
        lam_turn=lam,
        gamma_token=0.5,
        lam_token=0.5,
        beta=0.0,
    )
    turn_adv, _ = A.turn_gae(b.rewards, b.values, b.loss_mask, b.turn_ids, gamma=gamma, lam=lam)
    np.testing.assert_allclose(mae, turn_adv, atol=1e-12)
    # A traced β = 0 (no Python shortcut) gives the same numbers.
    traced = jax.jit(
        lambda beta: A.multiscale_advantages(
            b.rewards,
            b.values,
            b.loss_mask,
            b.turn_ids,
            gamma_turn=gamma,
            lam_turn=lam,
            gamma_token=0.5,
            lam_token=0.5,
            beta=beta,
        )
    )(0.0)
    np.testing.assert_allclose(traced, turn_adv, atol=1e-10)


@hypothesis.given(seed=SEEDS, gamma=GAMMAS, lam=LAMS)
@in_x64
def test_turn_gae_with_one_token_turns_is_token_gae(seed, gamma, lam):
    # Number every action token as its own turn.
    b = random_batch(np.random.default_rng(seed))
    one_token_turns = np.where(b.loss_mask, np.cumsum(b.loss_mask, axis=1) - 1, -1)
    boot = np.where(b.truncated, b.bootstrap_values, 0.0)
    turn = A.turn_gae(
        b.rewards,
        b.values,
        b.loss_mask,
        one_token_turns,
        gamma=gamma,
        lam=lam,
        bootstrap_value=boot,
    )
    token = A.token_gae(
        b.rewards, b.values, b.loss_mask, gamma=gamma, lam=lam, bootstrap_value=boot
    )
    chex.assert_trees_all_close(turn, token, atol=1e-12)


@hypothesis.given(seed=SEEDS)
@in_x64
def test_trace_credit_horizon_one_telescopes(seed):
    rng = np.random.default_rng(seed)
    b, m = 6, 9
    n = rng.integers(0, m + 1, size=b)
    bm = np.arange(m)[None] < n[:, None]
    lp = -rng.exponential(size=(b, m)) * 4
    credit = np.asarray(A.trace_turn_credit(lp, bm, horizon=1))
    d = -lp + 0.1
    for i in range(b):
        if n[i] < 2:
            assert np.all(credit[i] == 0)
            continue
        v_last_minus_v0 = np.log(d[i, 0] / d[i, n[i] - 1])  # V_k = log(d_0 / d_k), V_0 = 0
        np.testing.assert_allclose(credit[i].sum(), v_last_minus_v0, atol=1e-10)


@hypothesis.given(seed=SEEDS)
@in_x64
def test_grpo_token_advantages_sum_to_zero_per_group(seed):
    b = random_batch(np.random.default_rng(seed), batch=10)
    adv = A.group_advantages(trajectory_sums(b.rewards, b.loss_mask), b.group_ids)
    for g in np.unique(b.group_ids):
        assert abs(float(np.asarray(adv)[b.group_ids == g].sum())) < 1e-8
    tok = broadcast_trajectory_values(adv, b.loss_mask)
    assert np.all(np.asarray(tok)[~b.loss_mask] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@hypothesis.given(seed=SEEDS)
def test_every_estimator_is_finite_and_keeps_its_dtype(dtype, seed):
    with jax.enable_x64(dtype == np.float64):
        b = random_batch(np.random.default_rng(seed), dtype=dtype)
        want = jnp.dtype(dtype)
        outs = [
            *A.token_gae(b.rewards, b.values, b.loss_mask, gamma=1.0, lam=1.0),
            *A.turn_gae(b.rewards, b.values, b.loss_mask, b.turn_ids, gamma=1.0, lam=0.95),
            A.multiscale_advantages(
                b.rewards,
                b.values,
                b.loss_mask,
                b.turn_ids,
                gamma_turn=1.0,
                lam_turn=0.95,
                gamma_token=1.0,
                lam_token=0.95,
                beta=0.5,
            ),
            A.turn_log_ratio(b.logp, b.old_logp, b.loss_mask, b.turn_ids),
            A.group_advantages(trajectory_sums(b.rewards, b.loss_mask), b.group_ids),
            A.masked_whiten(b.values, b.loss_mask),
        ]
        for out in outs:
            assert out.dtype == want
            assert np.all(np.isfinite(out))
            if out.ndim == 2:
                assert np.all(np.asarray(out)[~b.loss_mask] == 0)


def test_float32_agrees_with_float64():
    b = random_batch(np.random.default_rng(3), batch=8, length=96)
    kw = dict(gamma_turn=0.99, lam_turn=0.95, gamma_token=1.0, lam_token=0.9, beta=0.7)
    args = (b.rewards, b.values, b.loss_mask, b.turn_ids)
    with jax.enable_x64(True):
        hi = np.asarray(A.multiscale_advantages(*args, **kw))
    lo = A.multiscale_advantages(*(np.asarray(x, np.float32) for x in args[:2]), *args[2:], **kw)
    assert lo.dtype == jnp.float32
    np.testing.assert_allclose(lo, hi, atol=2e-5)


def test_garbage_off_the_mask_does_not_leak():
    # Values and rewards off the mask are unspecified: NaN there must not reach any output.
    r = np.where(MASK, REW, np.nan)
    v = np.where(MASK, VAL, np.inf)
    adv, ret = A.token_gae(r, v, MASK, gamma=0.9, lam=0.8)
    assert np.all(np.isfinite(adv)) and np.all(np.isfinite(ret))
    mae = A.multiscale_advantages(
        r, v, MASK, TID, gamma_turn=0.9, lam_turn=0.8, gamma_token=1.0, lam_token=1.0, beta=1.0
    )
    np.testing.assert_allclose(mae, [[0, 0.724, 0.624, 0, 0.75, 0.65, 0]], atol=1e-6)


def test_edge_cases_empty_batch_rows_and_zero_length():
    empty = np.zeros((3, 5), bool)
    adv, ret = A.token_gae(np.zeros((3, 5)), np.ones((3, 5)), empty, gamma=1.0, lam=1.0)
    assert np.all(adv == 0) and np.all(ret == 0)
    out = A.multiscale_advantages(
        np.zeros((3, 5)),
        np.ones((3, 5)),
        empty,
        np.full((3, 5), -1),
        gamma_turn=1.0,
        lam_turn=1.0,
        gamma_token=1.0,
        lam_token=1.0,
        beta=1.0,
    )
    assert np.all(out == 0)
    adv, _ = A.turn_gae(
        np.zeros((2, 0)),
        np.zeros((2, 0)),
        np.zeros((2, 0), bool),
        np.zeros((2, 0), int),
        gamma=1.0,
        lam=1.0,
    )
    assert adv.shape == (2, 0)
    assert A.group_advantages(np.zeros(0), np.zeros(0, int)).shape == (0,)
    np.testing.assert_allclose(A.group_advantages([3.0], [0]), [0.0])


def test_bootstrap_enters_only_through_the_last_turn():
    # Truncated, V after the last token = 2.0: δ1 = 1 + .9*2 - .3 = 2.5; A0 = .17 + .72*2.5.
    adv, _ = A.turn_gae(REW, VAL, MASK, TID, gamma=0.9, lam=0.8, bootstrap_value=np.array([2.0]))
    np.testing.assert_allclose(adv, [[0, 1.97, 1.97, 0, 2.5, 2.5, 0]], atol=1e-6)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="baseline"):
        A.group_advantages([1.0, 2.0], [0, 0], baseline="median")
    with pytest.raises(ValueError, match="scale"):
        A.group_advantages([1.0, 2.0], [0, 0], scale="mad")
    with pytest.raises(ValueError, match="reduce"):
        A.turn_log_ratio(VAL, VAL, MASK, TID, reduce="max")
    with pytest.raises(ValueError, match="horizon"):
        A.trace_turn_credit(np.zeros((1, 3)), np.ones((1, 3), bool), horizon=0)
    with pytest.raises(ValueError, match="terminal_fill"):
        A.trace_turn_advantages(
            np.zeros(1), np.zeros((1, 1)), np.ones((1, 2), bool), MASK, TID, terminal_fill="mean"
        )
    with pytest.raises(ValueError, match="method"):
        A.token_gae(REW, VAL, MASK, gamma=1.0, lam=1.0, method="chunky")


def test_public_api_is_exported_and_documented():
    for name in A.__all__:
        fn = getattr(A, name)
        assert fn.__doc__ and len(fn.__doc__) > 80, name
