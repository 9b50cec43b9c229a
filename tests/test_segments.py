"""Segment helpers (mpo_jax.segments): turn structure, sums, broadcasts; the structure computed
once and passed along; shape checks at the public entry points."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from mpo_jax import advantages as A
from mpo_jax import batch as B
from mpo_jax import losses as L
from mpo_jax import segments as S
from tests.batches import random_batch

M = np.array([[0, 1, 1, 0, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]], bool)
T = np.array([[-1, 0, 0, -1, 1, -1, 1, 2], [-1] * 8], np.int32)  # turn 1 spans a template token


def test_turn_start_and_end_masks():
    np.testing.assert_array_equal(S.turn_start_mask(M, T)[0], [0, 1, 0, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(S.turn_end_mask(M, T)[0], [0, 0, 1, 0, 0, 0, 1, 1])
    assert not np.any(S.turn_start_mask(M, T)[1])


def test_turn_sum_mean_and_counts():
    x = np.arange(8.0)[None].repeat(2, 0)
    np.testing.assert_allclose(S.turn_sum(x, M, T)[0], [0, 3, 3, 0, 10, 0, 10, 7])
    np.testing.assert_allclose(S.turn_mean(x, M, T)[0], [0, 1.5, 1.5, 0, 5, 0, 5, 7])
    np.testing.assert_array_equal(S.num_turns(M, T), [3, 0])


def test_turn_value_placement():
    per_turn = np.array([[10.0, 20.0, 30.0], [1.0, 2.0, 3.0]])
    np.testing.assert_allclose(
        S.broadcast_turn_values(per_turn, M, T)[0], [0, 10, 10, 0, 20, 0, 20, 30]
    )
    np.testing.assert_allclose(S.place_on_turn_ends(per_turn, M, T)[0], [0, 0, 10, 0, 0, 0, 20, 30])
    np.testing.assert_allclose(S.broadcast_turn_values(per_turn, M, T)[1], 0)
    np.testing.assert_allclose(
        S.broadcast_trajectory_values(np.array([2.0, 3.0]), M)[0], [0, 2, 2, 0, 2, 0, 2, 2]
    )
    np.testing.assert_allclose(S.trajectory_sums(np.ones((2, 8)), M), [5, 0])


def test_the_batch_module_re_exports_the_public_segment_helpers():
    for name in ("Turns", "turn_structure", "turn_sum", "turn_mean", "num_turns", "turn_end_mask"):
        assert getattr(B, name) is getattr(S, name)


def test_turn_structure_holds_the_masks_the_helpers_compute():
    turns = S.turn_structure(M, T)
    np.testing.assert_array_equal(turns.start, S.turn_start_mask(M, T))
    np.testing.assert_array_equal(turns.end, S.turn_end_mask(M, T))
    np.testing.assert_array_equal(turns.mask, M)


def _counting(monkeypatch):
    """Counts every computation of a turn structure, wherever it is called from."""
    calls = []
    original = S.turn_structure_time_major

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    for module in (S, A):
        monkeypatch.setattr(module, "turn_structure_time_major", counted)
    return calls


@pytest.mark.parametrize("aggregation", ["token_mean", "turn_mean_token_mean"])
def test_policy_loss_computes_the_turn_structure_once(monkeypatch, aggregation):
    b = random_batch(np.random.default_rng(0), dtype=np.float32)
    logp = np.random.default_rng(1).normal(size=b.rewards.shape).astype(np.float32)
    calls = _counting(monkeypatch)
    L.policy_loss(logp, logp * 0.9, b.rewards, b.loss_mask, b.turn_ids, aggregation=aggregation)
    assert len(calls) == 1  # ratio, aggregation and the turn clip metric share it
    calls.clear()
    turns = S.turn_structure(b.loss_mask, b.turn_ids)
    calls.clear()
    L.policy_loss(
        logp, logp * 0.9, b.rewards, b.loss_mask, b.turn_ids, aggregation=aggregation, turns=turns
    )
    assert calls == []


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_passing_the_turn_structure_changes_no_number(jit, seed):
    b = random_batch(np.random.default_rng(seed), dtype=np.float32)
    m, tid, r, v = b.loss_mask, b.turn_ids, b.rewards, b.values
    logp = np.random.default_rng(seed + 7).normal(size=r.shape).astype(np.float32)
    turns = S.turn_structure(m, tid)
    mae = dict(gamma_turn=1.0, lam_turn=0.9, gamma_token=0.99, lam_token=0.95, beta=0.5)
    fns = {
        "turn_gae": functools.partial(A.turn_gae, gamma=0.99, lam=0.9, method="associative"),
        "mae": functools.partial(A.multiscale_advantages, method="associative", **mae),
    }
    for name, fn in fns.items():
        fn = jax.jit(fn) if jit else fn
        plain = fn(r, v, m, tid)
        given = fn(r, v, m, tid, turns=turns)
        if jit:
            # Two different programs (one derives the structure, one is handed it): XLA may fuse
            # and reassociate them differently, so equal to a few units in the last place.
            np.testing.assert_array_max_ulp(np.asarray(plain), np.asarray(given), maxulp=4)
        else:
            np.testing.assert_array_equal(np.asarray(plain), np.asarray(given), err_msg=name)
    np.testing.assert_array_equal(
        A.turn_log_ratio(logp, 0.5 * logp, m, tid, reduce="mean"),
        A.turn_log_ratio(logp, 0.5 * logp, m, tid, reduce="mean", turns=turns),
    )
    np.testing.assert_array_equal(S.turn_mean(logp, m, tid), S.turn_mean(logp, m, tid, turns=turns))
    loss, metrics = L.policy_loss(logp, 0.5 * logp, r, m, tid, aggregation="turn_mean_token_mean")
    loss_t, metrics_t = L.policy_loss(
        logp, 0.5 * logp, r, m, tid, aggregation="turn_mean_token_mean", turns=turns
    )
    assert float(loss) == float(loss_t)
    assert {k: float(x) for k, x in metrics.items()} == {k: float(x) for k, x in metrics_t.items()}


def test_public_entry_points_check_shapes_and_name_the_function_and_arguments():
    b = random_batch(np.random.default_rng(3), dtype=np.float32)
    m, tid, r, v = b.loss_mask, b.turn_ids, b.rewards, b.values
    short = v[:, :-1]
    cases = [
        ("token_gae", lambda: A.token_gae(r, short, m, gamma=1.0, lam=1.0)),
        ("turn_gae", lambda: A.turn_gae(r, v, m, tid[:-1], gamma=1.0, lam=1.0)),
        (
            "multiscale_advantages",
            lambda: A.multiscale_advantages(
                r,
                v,
                m,
                tid,
                gamma_turn=1,
                lam_turn=1,
                gamma_token=1,
                lam_token=1,
                beta=0.5,
                bootstrap_value=np.zeros(len(m) + 1),
            ),
        ),
        ("turn_log_ratio", lambda: A.turn_log_ratio(v, short, m, tid)),
        ("policy_loss", lambda: L.policy_loss(v, v, r[None], m, tid)),
        ("value_loss", lambda: L.value_loss(v, v, short, m)),
        ("kl_penalty", lambda: L.kl_penalty(v, short, m)),
        ("aggregate", lambda: L.aggregate(short, m)),
        ("turn_sum", lambda: S.turn_sum(short, m, tid)),
        ("group_advantages", lambda: A.group_advantages(np.zeros(4), np.zeros(3, int))),
        ("masked_whiten", lambda: A.masked_whiten(v, m[:1])),
    ]
    for name, call in cases:
        with pytest.raises(AssertionError, match=name):
            call()
    with pytest.raises(AssertionError, match="rewards, values, loss_mask"):
        A.token_gae(r, short, m, gamma=1.0, lam=1.0)
    with pytest.raises(AssertionError, match="bootstrap_value must be"):
        A.token_gae(r, v, m, gamma=1.0, lam=1.0, bootstrap_value=np.zeros((len(m), 2)))
