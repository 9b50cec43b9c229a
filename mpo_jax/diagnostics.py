"""Diagnostics the trainer logs every step: how much of the critic's variance lives between turns,
how well the critic explains the returns, how many groups carry no group-relative signal, and,
where the environment grades each turn's decision, how well an estimator's credit on the decisive
tokens follows that ground truth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mpo_jax.segments import float_dtype, turn_end_mask, turn_mean

__all__ = [
    "turn_variance_fraction",
    "median_turn_variance_fraction",
    "explained_variance",
    "flat_group_fraction",
    "decision_credit_correlation",
]

ArrayLike = jax.typing.ArrayLike


def turn_variance_fraction(
    values: ArrayLike, loss_mask: ArrayLike, turn_ids: ArrayLike
) -> tuple[jax.Array, jax.Array]:
    """Share of each trajectory's critic-value variance that the turn means explain.

    Over a row's action tokens t (N of them) with turn means ``μ_k`` and row mean ``μ``:

        fraction = Σ_k |S_k| (μ_k - μ)² / Σ_t (V_t - μ)²        (between-turn / total)

    token-weighted, in [0, 1]. The MPO paper reports a median of 89.5% for a search agent's critic.

    Returns:
      (fraction [B], defined [B] bool). A row with no action tokens or constant values has no
      variance to split: ``defined`` is False and ``fraction`` is 0 there.
    """
    dtype = float_dtype(values)
    m = jnp.asarray(loss_mask, bool)
    v = jnp.where(m, jnp.asarray(values, dtype), 0)
    n = jnp.sum(m, axis=-1)
    mu = jnp.sum(v, axis=-1) / jnp.maximum(n, 1)
    total = jnp.sum(jnp.where(m, (v - mu[:, None]) ** 2, 0), axis=-1)
    mu_turn = turn_mean(v, m, turn_ids)
    between = jnp.sum(jnp.where(m, (mu_turn - mu[:, None]) ** 2, 0), axis=-1)
    tiny = jnp.finfo(dtype).tiny * 1e3
    defined = total > tiny
    frac = jnp.where(defined, between / jnp.where(defined, total, 1), 0)
    return jnp.clip(frac, 0, 1), defined


def median_turn_variance_fraction(
    values: ArrayLike, loss_mask: ArrayLike, turn_ids: ArrayLike
) -> jax.Array:
    """The median of [`turn_variance_fraction`][mpo_jax.diagnostics.turn_variance_fraction] over
    rows where it is defined (0 if none)."""
    frac, defined = turn_variance_fraction(values, loss_mask, turn_ids)
    n = jnp.sum(defined)
    ordered = jnp.sort(jnp.where(defined, frac, jnp.inf))
    lo = ordered[jnp.maximum((n - 1) // 2, 0)]
    hi = ordered[jnp.maximum(n // 2, 0)]
    return jnp.where(n > 0, 0.5 * (lo + hi), 0.0)


def explained_variance(values: ArrayLike, returns: ArrayLike, mask: ArrayLike) -> jax.Array:
    """``1 - Var[returns - values] / Var[returns]`` over the masked entries (scalar).

    1 is a perfect critic, 0 no better than a constant, negative worse. Returns 0 when the returns
    have no variance (nothing to explain).
    """
    dtype = float_dtype(values, returns)
    m = jnp.asarray(mask, bool)
    v = jnp.asarray(values, dtype)
    r = jnp.asarray(returns, dtype)
    n = jnp.maximum(jnp.sum(m), 1)

    def var(x):
        mean = jnp.sum(jnp.where(m, x, 0)) / n
        return jnp.sum(jnp.where(m, (x - mean) ** 2, 0)) / n

    var_r = var(r)
    ok = var_r > jnp.finfo(dtype).tiny * 1e3
    return jnp.where(ok, 1 - var(r - v) / jnp.where(ok, var_r, 1), 0.0)


def flat_group_fraction(rewards: ArrayLike, group_ids: ArrayLike) -> jax.Array:
    """The share of groups whose rollouts all earned the same return (scalar in [0, 1]).

    With ``R_b = Σ_t rewards[b, t]``, group ``g`` is flat when ``R_b = R_c`` for every ``b, c``
    in it; a group of one is flat. Group-relative credit (GRPO, RLOO, GSPO, GiGPO's episode
    level) is exactly 0 on a flat group's tokens, so at 1 such a preset's policy gradient is 0:
    with a reward only on success, no rollout has succeeded yet (or every one has). The share is
    over groups, not rows: ``Σ_b flat_b / n_b / Σ_b 1 / n_b`` with ``n_b`` the size of row
    ``b``'s group.
    """
    r = jnp.sum(jnp.asarray(rewards), axis=-1)
    g = jnp.asarray(group_ids)
    same = g[:, None] == g[None, :]
    size = jnp.sum(same, axis=1)
    flat_row = jnp.all(jnp.where(same, r[:, None] == r[None, :], True), axis=1)
    weight = 1.0 / size
    return jnp.sum(jnp.where(flat_row, weight, 0.0)) / jnp.maximum(jnp.sum(weight), 1e-12)


def decision_credit_correlation(
    advantages: ArrayLike, loss_mask: ArrayLike, turn_ids: ArrayLike, turn_quality: ArrayLike
) -> jax.Array:
    """Pearson correlation between each turn's credit and a ground-truth grade of its decision.

    The credit of turn k is the advantage on its last action token (the decisive token of the
    synthetic tasks); ``turn_quality[b, k]`` grades turn k of row b (NaN: no grade, left out).
    Over the graded turns (a, q): ``cov(a, q) / (std(a) std(q))``. Returns NaN when fewer than two
    turns are graded or either side has no variance (nothing to correlate).

    Args:
      advantages: [B, T].
      loss_mask: [B, T] (docs/design.md §2 layout).
      turn_ids: [B, T] (docs/design.md §2 layout).
      turn_quality: [B, K] grades, K >= the number of turns of every row.
    """
    q_all = jnp.asarray(turn_quality)
    dtype = float_dtype(advantages, q_all)
    mask = jnp.asarray(loss_mask, bool)
    tid = jnp.asarray(turn_ids)
    ends = turn_end_mask(mask, tid)
    k = jnp.clip(tid, 0, q_all.shape[1] - 1)
    q = jnp.take_along_axis(q_all.astype(dtype), k, axis=1)
    use = ends & jnp.isfinite(q)
    a = jnp.where(use, jnp.asarray(advantages, dtype), 0)
    q = jnp.where(use, q, 0)
    n = jnp.sum(use)
    safe_n = jnp.maximum(n, 1)
    da = jnp.where(use, a - jnp.sum(a) / safe_n, 0)
    dq = jnp.where(use, q - jnp.sum(q) / safe_n, 0)
    denom = jnp.sqrt(jnp.sum(da**2) * jnp.sum(dq**2))
    ok = (n >= 2) & (denom > jnp.finfo(dtype).tiny * 1e3)
    return jnp.where(ok, jnp.sum(da * dq) / jnp.where(ok, denom, 1), jnp.nan)
