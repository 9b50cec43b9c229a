"""Presets: each runs end to end under jit; bad names and impossible combinations fail loudly."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
import pytest

from mpo_jax import advantages as A
from mpo_jax import algorithms, losses
from mpo_jax.batch import TurnBatch, num_turns, validate
from tests.batches import random_batch


def full_batch(seed=0) -> TurnBatch:
    rng = np.random.default_rng(seed)
    b = random_batch(rng, batch=8, length=40, dtype=np.float32)
    k = np.asarray(num_turns(b.loss_mask, b.turn_ids))
    keys = np.full((8, 6), -1, np.int32)
    for i in range(8):
        keys[i, : k[i]] = rng.integers(0, 3, size=k[i])  # few states: step groups do form
    m = 6
    n_boundaries = np.minimum(k, m)
    bm = np.arange(m)[None] < n_boundaries[:, None]
    return b.replace(
        ref_logp=b.logp - 0.05,
        step_keys=keys,
        boundary_mask=bm,
        answer_logprobs=np.where(bm, -rng.uniform(0.1, 4, size=(8, m)), 0).astype(np.float32),
    )


def one_step(algo, batch):
    credit = algorithms.compute_advantages(algo, batch)
    loss, metrics = losses.policy_loss(
        batch.logp,
        batch.old_logp,
        credit.advantages,
        batch.loss_mask,
        batch.turn_ids,
        **algo.policy_loss_kwargs(),
    )
    total = loss
    if credit.returns is not None:
        vloss, _ = losses.value_loss(batch.values, batch.values, credit.returns, batch.loss_mask)
        total = total + vloss
    return total, credit.advantages


@pytest.mark.parametrize("name", sorted(algorithms.PRESETS))
def test_every_preset_runs_end_to_end_under_jit(name):
    batch = full_batch()
    validate(batch)
    algo = algorithms.get(name)
    total, advantages = jax.jit(one_step, static_argnums=0)(algo, batch)
    assert np.isfinite(total)
    assert np.all(np.isfinite(advantages))
    assert np.all(np.asarray(advantages)[~batch.loss_mask] == 0)
    assert np.any(np.asarray(advantages) != 0)
    assert (algorithms.compute_advantages(algo, batch).returns is not None) == algo.needs_critic


def test_presets_compute_what_their_estimators_compute():
    b = full_batch(1)
    mpo = algorithms.compute_advantages(algorithms.get("mpo", beta=0.3), b)
    expected = A.multiscale_advantages(
        b.rewards,
        b.values,
        b.loss_mask,
        b.turn_ids,
        gamma_turn=1.0,
        lam_turn=0.95,
        gamma_token=1.0,
        lam_token=0.95,
        beta=0.3,
        bootstrap_value=np.where(b.truncated, b.bootstrap_values, 0),
    )
    np.testing.assert_allclose(mpo.advantages, expected, atol=1e-6)
    _, returns = A.token_gae(
        b.rewards,
        b.values,
        b.loss_mask,
        gamma=1.0,
        lam=0.95,
        bootstrap_value=np.where(b.truncated, b.bootstrap_values, 0),
    )
    np.testing.assert_allclose(mpo.returns, returns, atol=1e-6)
    grpo = algorithms.compute_advantages(algorithms.get("grpo"), b)
    for g in np.unique(b.group_ids):
        rows = b.group_ids == g
        first = np.asarray(grpo.advantages)[rows][b.loss_mask[rows]]
        assert first.size == 0 or np.ptp(first) >= 0  # broadcast per trajectory


def test_mpo_trace_adds_turn_credit_as_dense_rewards():
    b = full_batch(2)
    algo = algorithms.get("mpo_trace")
    credit = algorithms.compute_advantages(algo, b)
    added = np.asarray(credit.rewards) - np.where(b.loss_mask, b.rewards, 0)
    turn_credit = np.asarray(A.trace_turn_credit(b.answer_logprobs, b.boundary_mask))
    assert np.abs(added).sum() > 0
    np.testing.assert_allclose(added.sum(1), 0.2 * turn_credit.sum(1), rtol=1e-5, atol=1e-6)


def test_kl_in_reward_changes_the_rewards():
    b = full_batch(3)
    algo = algorithms.get("ppo", kl_coef=0.1, kl_in_reward=True, kl_kind="k1")
    credit = algorithms.compute_advantages(algo, b)
    expected = np.where(b.loss_mask, b.rewards - 0.1 * (b.old_logp - b.ref_logp), 0)
    np.testing.assert_allclose(credit.rewards, expected, atol=1e-6)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown preset 'ppo2'; choose one of \[.*'mpo'.*\]"):
        algorithms.get("ppo2")
    with pytest.raises(ValueError, match=r"unknown setting 'betta'; valid: \[.*'multiscale.beta'"):
        algorithms.get("mpo", betta=0.1)
    with pytest.raises(ValueError, match=r"'eps' is ambiguous; write one of \['group.eps'"):
        algorithms.get("grpo", eps=0.1)
    with pytest.raises(ValueError, match="group.scale='flat' is not one of"):
        algorithms.get("grpo", **{"group.scale": "flat"})


def test_every_family_setting_is_named_as_the_argument_it_feeds():
    adv = A
    feeds = {
        "gae": [adv.token_gae, adv.turn_gae],
        "multiscale": [adv.multiscale_advantages],
        "critic": [adv.token_gae, losses.value_loss],
        "group": [adv.group_advantages],
        "trace": [adv.trace_turn_credit, adv.trace_turn_advantages],
        "gigpo": [adv.gigpo_advantages],
    }
    for family, config in algorithms.FAMILIES.items():
        arguments = {p for fn in feeds[family] for p in inspect.signature(fn).parameters}
        for field in dataclasses.fields(config):
            assert field.name in arguments, f"{family}.{field.name} feeds no argument"


def test_overrides_reach_the_family_they_name_and_legacy_names_keep_their_meaning():
    mpo = algorithms.get("mpo", beta=0.3, **{"critic.lam": 1.0})
    assert mpo.multiscale.beta == 0.3 and mpo.critic.lam == 1.0
    assert mpo.gae == algorithms.PRESETS["mpo"].gae  # nothing else moved
    old = algorithms.get("mpo", gamma=0.9, critic_lam=0.8, group_eps=1e-3)
    assert (old.gae.gamma, old.multiscale.gamma_turn, old.critic.gamma) == (0.9, 0.9, 0.9)
    assert (old.critic.lam, old.group.eps, old.gigpo.eps) == (0.8, 1e-3, 1e-3)
    b = random_batch(np.random.default_rng(0), dtype=np.float32)
    a = algorithms.compute_advantages(algorithms.get("mpo", beta=0.0), b).advantages
    t = algorithms.compute_advantages(algorithms.get("turn_ppo"), b).advantages
    np.testing.assert_allclose(a, t, atol=1e-6)  # beta reached the estimator
    with pytest.raises(ValueError, match="aggregation='mean' is not one of"):
        algorithms.get("mpo", aggregation="mean")


def test_impossible_combinations_raise():
    b = full_batch()
    with pytest.raises(ValueError, match="grpo: a critic-free preset has no critic targets"):
        algorithms.compute_advantages(algorithms.get("grpo"), b, need_returns=True)
    with pytest.raises(ValueError, match=r"mpo: batch.values is required"):
        algorithms.compute_advantages(algorithms.get("mpo"), b.replace(values=None))
    with pytest.raises(ValueError, match=r"gigpo: batch.step_keys is required"):
        algorithms.compute_advantages(algorithms.get("gigpo"), b.replace(step_keys=None))
    with pytest.raises(ValueError, match=r"trace: batch.boundary_mask is required"):
        algorithms.compute_advantages(algorithms.get("trace"), b.replace(boundary_mask=None))


def test_an_estimator_is_one_registered_function_and_unknown_names_are_refused():

    import jax.numpy as jnp

    batch = random_batch(np.random.default_rng(3), batch=4, length=16, dtype=np.float32)
    name = "test_constant_credit"

    @algorithms.register_estimator(name, needs_critic=False, needs_groups=False)
    def constant(algo, batch, inputs):
        return algorithms.Credit(jnp.where(inputs.mask, 2.0, 0.0), None, inputs.rewards)

    try:
        algo = dataclasses.replace(algorithms.get("grpo"), name="const", estimator=name)
        out = algorithms.compute_advantages(algo, batch)
        np.testing.assert_array_equal(np.asarray(out.advantages), np.where(batch.loss_mask, 2, 0))
        assert not algo.needs_critic
        with pytest.raises(ValueError, match="already registered"):
            algorithms.register_estimator(name, needs_critic=False)(constant)
    finally:
        del algorithms.ESTIMATOR_REGISTRY[name]
    with pytest.raises(ValueError, match=r"estimator='nope' is not one of \("):
        dataclasses.replace(algorithms.get("grpo"), estimator="nope")


def test_leave_one_out_is_the_explanatory_name_of_loo():
    from mpo_jax import advantages

    outcomes, groups = np.array([1.0, 0.0, 0.0, 3.0, 1.0]), np.array([0, 0, 0, 1, 1])
    a = advantages.group_advantages(outcomes, groups, baseline="leave_one_out", scale="none")
    b = advantages.group_advantages(outcomes, groups, baseline="loo", scale="none")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(a), [1.0, -0.5, -0.5, 2.0, -2.0])
    assert algorithms.get("rloo").group.baseline == "leave_one_out"
