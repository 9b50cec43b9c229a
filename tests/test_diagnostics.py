"""Turn-variance fraction and explained variance."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from mpo_jax import diagnostics as D
from tests.batches import random_batch

M = np.array([[0, 1, 1, 0, 1, 1]], bool)
T = np.array([[-1, 0, 0, -1, 1, 1]], np.int32)


def test_values_constant_within_turns_are_all_between_turn_variance():
    frac, ok = D.turn_variance_fraction(np.array([[9.0, 1, 1, 9, 3, 3]]), M, T)
    np.testing.assert_allclose(frac, [1.0], atol=1e-6)
    assert ok.tolist() == [True]


def test_hand_computed_fraction():
    # Values [0, 2 | 1, 3]: mean 1.5; total Σ(v-μ)² = 2.25+.25+.25+2.25 = 5;
    # turn means 1 and 2: between = 2*(.25) + 2*(.25) = 1 -> fraction .2.
    frac, _ = D.turn_variance_fraction(np.array([[0.0, 0, 2, 0, 1, 3]]), M, T)
    np.testing.assert_allclose(frac, [0.2], atol=1e-6)


def test_undefined_rows_are_flagged_not_nan():
    values = np.array([[0.0, 5, 5, 0, 5, 5], [1.0, 2, 3, 4, 5, 6]])
    mask = np.array([[0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0]], bool)
    tid = np.where(mask, np.array([[-1, 0, 0, -1, 1, 1]] * 2), -1)
    frac, ok = D.turn_variance_fraction(values, mask, tid)
    assert ok.tolist() == [False, False]
    assert np.all(np.asarray(frac) == 0)
    assert float(D.median_turn_variance_fraction(values, mask, tid)) == 0.0


@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_fraction_is_in_unit_interval_and_median_matches_numpy(seed):
    b = random_batch(np.random.default_rng(seed), batch=9)
    frac, ok = D.turn_variance_fraction(b.values, b.loss_mask, b.turn_ids)
    frac, ok = np.asarray(frac), np.asarray(ok)
    assert np.all((frac >= 0) & (frac <= 1))
    expected = float(np.median(frac[ok])) if ok.any() else 0.0
    got = float(D.median_turn_variance_fraction(b.values, b.loss_mask, b.turn_ids))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_explained_variance():
    ret = np.array([1.0, 2.0, 3.0, 4.0])
    m = np.ones(4, bool)
    np.testing.assert_allclose(D.explained_variance(ret, ret, m), 1.0)
    np.testing.assert_allclose(D.explained_variance(np.full(4, 2.5), ret, m), 0.0, atol=1e-6)
    # Residuals 2 (R - mean): four times the return variance -> 1 - 4 = -3.
    np.testing.assert_allclose(D.explained_variance(ret - (ret - 2.5) * 2, ret, m), -3, atol=1e-5)
    assert float(D.explained_variance(ret, np.ones(4), m)) == 0.0


def _flat_reference(rewards, group_ids) -> float:
    returns = np.asarray(rewards).sum(axis=-1)
    groups = {}
    for g, r in zip(np.asarray(group_ids).tolist(), returns.tolist(), strict=True):
        groups.setdefault(g, []).append(r)
    return float(np.mean([len(set(rs)) == 1 for rs in groups.values()]))


def test_flat_group_fraction_by_hand():
    rewards = np.zeros((6, 4))
    rewards[0, 3] = 1.0  # group 7: one win of two -> signal
    rewards[2, 1] = rewards[3, 2] = 1.0  # group 5: every rollout won (same return) -> flat
    groups = np.array([7, 7, 5, 5, 9, 2])  # rows 4 and 5: groups of one -> flat
    assert float(D.flat_group_fraction(rewards, groups)) == pytest.approx(3 / 4)
    assert float(D.flat_group_fraction(np.zeros((4, 3)), np.array([0, 0, 1, 1]))) == 1.0
    rewards[1, 0] = 1.0  # group 7: both returns 1 now -> flat
    assert float(D.flat_group_fraction(rewards, groups)) == 1.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("jit", [False, True])
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_flat_group_fraction_matches_a_reference_on_random_batches(seed, jit, dtype):
    rng = np.random.default_rng(seed)
    b = random_batch(rng, batch=int(rng.integers(1, 12)), dense_rewards=False, dtype=dtype)
    fn = jax.jit(D.flat_group_fraction) if jit else D.flat_group_fraction
    got = float(fn(b.rewards, b.group_ids))
    assert 0.0 <= got <= 1.0
    np.testing.assert_allclose(got, _flat_reference(b.rewards, b.group_ids), rtol=1e-6)


def test_decision_credit_correlation_reads_each_turns_last_token():
    # row 0: turns of 3 and 2 tokens; row 1: one turn of 1 token; -1 = prompt / observation
    turn_ids = np.array([[-1, 0, 0, 0, -1, 1, 1, -1], [-1, -1, 0, -1, -1, -1, -1, -1]])
    mask = turn_ids >= 0
    adv = np.zeros((2, 8))
    adv[0, 3], adv[0, 6], adv[1, 2] = 2.0, -1.0, 0.5  # the turns' last tokens
    adv[0, 1] = 100.0  # not a last token: ignored
    quality = np.array([[1.0, -1.0], [0.0, np.nan]])
    expected = np.corrcoef([2.0, -1.0, 0.5], [1.0, -1.0, 0.0])[0, 1]
    for fn in (D.decision_credit_correlation,
               jax.jit(D.decision_credit_correlation)):  # fmt: skip
        assert float(fn(adv, mask, turn_ids, quality)) == pytest.approx(expected, abs=1e-6)
    # a NaN grade leaves its turn out; nothing to correlate -> NaN
    quality_nan = np.array([[1.0, np.nan], [np.nan, np.nan]])
    assert np.isnan(float(D.decision_credit_correlation(adv, mask, turn_ids, quality_nan)))
    flat = np.array([[1.0, 1.0], [1.0, np.nan]])  # no variance in the grades
    assert np.isnan(float(D.decision_credit_correlation(adv, mask, turn_ids, flat)))
    # the sign follows the credit
    assert float(D.decision_credit_correlation(-adv, mask, turn_ids, quality)) < 0
