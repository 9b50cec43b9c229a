"""Policy loss (ratio per token, turn or sequence), value loss, KL penalties, entropy, aggregation.

Every loss is computed per token, then aggregated as ``(sum, count)``
([`aggregate`][mpo_jax.losses.aggregate]): the loss is ``sum / count``, or ``sum / normalizer`` when
the caller passes the full batch's count, so that gradient accumulation over micro-batches
reproduces the full-batch gradient exactly.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from mpo_jax.advantages import turn_log_ratio
from mpo_jax.segments import (
    Turns,
    check_same_shape,
    check_token_arrays,
    float_dtype,
    num_turns,
    turn_structure,
    turn_sum,
)

__all__ = [
    "AGGREGATIONS",
    "IS_LEVELS",
    "aggregate",
    "policy_loss",
    "policy_loss_per_token",
    "behaviour_weights",
    "value_loss",
    "kl_penalty",
    "entropy_from_logprobs",
]

ArrayLike = jax.typing.ArrayLike
Aggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "turn_mean_token_mean"
]
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "turn_mean_token_mean")
RATIO_LEVELS = ("token", "turn", "sequence")
IS_LEVELS = RATIO_LEVELS  # the spans a behaviour weight is computed over


def aggregate(
    per_token: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike | None = None,
    *,
    mode: Aggregation = "token_mean",
    turns: Turns | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Aggregates a per-token loss into ``(sum, count)``; the loss is ``sum / count``.

    Modes (verl's names with underscores), over the ``loss_mask`` tokens $\ell_{b,t}$, with $n_b$
    the action tokens of row $b$ and $S_{b,k}$ its turns:

    * ``token_mean``: sum $= \sum_{b,t} \ell_{b,t}$, count = number of tokens.
    * ``seq_mean_token_mean``: sum $= \sum_b \frac{1}{n_b} \sum_t \ell_{b,t}$, count = number of
      non-empty rows.
    * ``seq_mean_token_sum``: sum $= \sum_{b,t} \ell_{b,t}$, count = number of non-empty rows
      (Dr.GRPO).
    * ``turn_mean_token_mean``: sum $= \sum_{b,k} \frac{1}{|S_{b,k}|} \sum_{t \in S_{b,k}}
      \ell_{b,t}$, count = number of turns.

    Each count is a sum over rows, so per-micro-batch counts add up to the full batch's count.
    ``turns`` ([`mpo_jax.segments.turn_structure`][mpo_jax.segments.turn_structure]) skips
    recomputing the turn structure.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation: unknown mode {mode!r}; choose one of {AGGREGATIONS}")
    check_token_arrays("aggregate", per_token=per_token, loss_mask=loss_mask, turn_ids=turn_ids)
    x = jnp.asarray(per_token)
    mask = jnp.asarray(loss_mask, bool)
    x = jnp.where(mask, x, 0)
    dtype = x.dtype
    if mode == "token_mean":
        return jnp.sum(x), jnp.sum(mask).astype(dtype)
    n = jnp.sum(mask, axis=-1)
    rows = jnp.sum(n > 0).astype(dtype)
    if mode == "seq_mean_token_mean":
        return jnp.sum(jnp.sum(x, axis=-1) / jnp.maximum(n, 1)), rows
    if mode == "seq_mean_token_sum":
        return jnp.sum(x), rows
    if turn_ids is None:
        raise ValueError("turn_ids: required by aggregation 'turn_mean_token_mean'")
    turn_size = turn_sum(mask.astype(dtype), mask, turn_ids, turns=turns)
    total = jnp.sum(jnp.where(mask, x / jnp.maximum(turn_size, 1), 0))
    return total, jnp.sum(num_turns(mask, turn_ids)).astype(dtype)


def _ratio_log(logp, old_logp, loss_mask, turn_ids, level, reduce, turns):
    """The log-ratio L of the chosen level, broadcast to tokens (not yet stop-gradiented)."""
    if level == "token":
        return jnp.where(loss_mask, logp - old_logp, 0)
    if level == "turn":
        return turn_log_ratio(logp, old_logp, loss_mask, turn_ids, reduce=reduce, turns=turns)
    diff = jnp.where(loss_mask, logp - old_logp, 0)
    total = jnp.sum(diff, axis=-1, keepdims=True)
    if reduce == "mean":
        total = total / jnp.maximum(jnp.sum(loss_mask, axis=-1, keepdims=True), 1)
    return jnp.where(loss_mask, total, 0)


def policy_loss_per_token(
    logp: ArrayLike,
    old_logp: ArrayLike,
    advantages: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    *,
    ratio_level: Literal["token", "turn", "sequence"] = "turn",
    ratio_reduce: Literal["sum", "mean"] | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float = 20.0,
    turns: Turns | None = None,
    is_weights: ArrayLike | None = None,
) -> tuple[jax.Array, dict]:
    r"""The per-token clipped surrogate $\ell_t$ of [`policy_loss`][mpo_jax.losses.policy_loss],
    before aggregation, 0 off ``loss_mask``.

    Each $\ell_t$ depends on $\log \pi_t$ alone through the gradient path, so the gradient of
    $\sum_t \ell_t$ is each token's own derivative: what a trainer that aggregates in its own way
    (verl's ``agg_loss``) needs.

    Returns:
      (per_token [B, T], parts): parts hold the masked inputs (``mask``, ``logp``, ``old_logp``),
      ``ratio``, ``is_clipped``, ``dual`` and ``turns``, for the metrics.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(
            f"ratio_level: unknown level {ratio_level!r}; choose one of {RATIO_LEVELS}"
        )
    if ratio_reduce is None:
        ratio_reduce = "mean" if ratio_level == "sequence" else "sum"
    if ratio_reduce not in ("sum", "mean"):
        raise ValueError(
            f"ratio_reduce: unknown reduction {ratio_reduce!r}; choose 'sum' or 'mean'"
        )
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip: must be > 1 (or None), got {dual_clip}")
    check_token_arrays(
        "policy_loss",
        logp=logp,
        old_logp=old_logp,
        advantages=advantages,
        loss_mask=loss_mask,
        turn_ids=turn_ids,
    )
    dtype = float_dtype(logp, old_logp, advantages)
    mask = jnp.asarray(loss_mask, bool)
    logp = jnp.where(mask, jnp.asarray(logp, dtype), 0)
    old = jnp.where(mask, jnp.asarray(old_logp, dtype), 0)
    adv = jnp.where(mask, jnp.asarray(advantages, dtype), 0)
    if turns is None:
        turns = turn_structure(mask, turn_ids)

    log_ratio = _ratio_log(logp, old, mask, turn_ids, ratio_level, ratio_reduce, turns)
    log_ratio = jnp.clip(jax.lax.stop_gradient(log_ratio), -log_ratio_clamp, log_ratio_clamp)
    ratio = jnp.exp(log_ratio + logp - jax.lax.stop_gradient(logp))
    unclipped = -ratio * adv
    clipped = -jnp.clip(ratio, 1 - clip_low, 1 + clip_high) * adv
    per_token = jnp.maximum(unclipped, clipped)
    is_clipped = mask & (clipped > unclipped)
    dual = jnp.zeros_like(mask)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = mask & (adv < 0) & (per_token > bound)
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, bound), per_token)
    if is_weights is not None:
        check_same_shape("policy_loss", None, is_weights=is_weights, loss_mask=loss_mask)
        weights = jax.lax.stop_gradient(jnp.asarray(is_weights, dtype))
        per_token = jnp.where(mask, weights * per_token, 0)
    return per_token, {
        "mask": mask,
        "logp": logp,
        "old_logp": old,
        "ratio": ratio,
        "is_clipped": is_clipped,
        "dual": dual,
        "turns": turns,
    }


def policy_loss(
    logp: ArrayLike,
    old_logp: ArrayLike,
    advantages: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    *,
    ratio_level: Literal["token", "turn", "sequence"] = "turn",
    ratio_reduce: Literal["sum", "mean"] | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float = 20.0,
    aggregation: Aggregation = "token_mean",
    normalizer: ArrayLike | None = None,
    turns: Turns | None = None,
    is_weights: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""The clipped surrogate with the importance ratio at token, turn or sequence level.

    With $L$ the log-ratio of the level (token: $\log \pi_t - \log \pi^{old}_t$; turn: its sum
    over the turn $S_k$, MPO; sequence: its mean over the row's action tokens, GSPO), clamped to
    ``±log_ratio_clamp``, and $\mathrm{sg}$ the stop-gradient:

    $$w_t = \exp\big(\mathrm{sg}(L) + \log \pi_t - \mathrm{sg}(\log \pi_t)\big), \qquad
      \ell_t = -\min\big(w_t \hat A_t,\ \mathrm{clip}(w_t, 1 - \epsilon_{low},
      1 + \epsilon_{high}) \hat A_t\big).$$

    In value $w_t$ is the ratio of its level; its gradient is
    $\mathrm{sg}(w_t) \nabla \log \pi_t$, so each token's gradient carries its own advantage
    only, and a turn (or sequence) is clipped as a whole. ``dual_clip`` $= c > 1$ bounds the loss
    of negative-advantage tokens by $-c \hat A_t$ (Ye et al. 2020). ``ratio_reduce`` defaults to
    ``"sum"`` for turns and ``"mean"`` (length-normalised) for
    sequences.

    Args:
      logp: [B, T] log-probs under the policy being optimised (differentiate through this).
      old_logp: [B, T] log-probs under the rollout policy.
      advantages: [B, T].
      loss_mask: [B, T], the layout of docs/design.md §2.
      turn_ids: [B, T], the layout of docs/design.md §2.
      aggregation: see [`aggregate`][mpo_jax.losses.aggregate].
      normalizer: divide the summed loss by this instead of the batch's own count (pass the full
        batch's count when accumulating micro-batches).
      turns: the batch's turn structure
        ([`mpo_jax.segments.turn_structure`][mpo_jax.segments.turn_structure]); computed here,
        once, when not given, and shared by the ratio, the aggregation and the clip metrics.
      is_weights: [B, T] behaviour weights ρ̄
        ([`behaviour_weights`][mpo_jax.losses.behaviour_weights], decoupled PPO): each
        token's clipped term is multiplied by its (stop-gradient) weight, ``ℓ_t ← ρ̄_t ℓ_t``;
        ``old_logp`` is then the proximal policy and the weights correct the gap to the policy
        that sampled. None: no correction (on-policy data).

    Returns:
      (loss, metrics): metrics hold ``loss_sum``, ``loss_count``, ``clip_frac`` (tokens),
      ``turn_clip_frac`` (turns with a clipped token), ``dual_clip_frac``, ``approx_kl``
      (k3 estimate of KL(old || new) from token ratios), ``ratio_mean`` and ``ratio_max``, and
      how far each turn moved whatever the ratio level: ``turn_log_ratio_abs`` (mean over turns
      of |Σ_t log r_t|), its max ``turn_log_ratio_abs_max``, and ``turn_mean_log_ratio_abs``
      (mean over turns of |Σ_t log r_t| / turn length).
    """
    per_token, parts = policy_loss_per_token(
        logp,
        old_logp,
        advantages,
        loss_mask,
        turn_ids,
        ratio_level=ratio_level,
        ratio_reduce=ratio_reduce,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
        turns=turns,
        is_weights=is_weights,
    )
    mask, turns, dtype = parts["mask"], parts["turns"], per_token.dtype
    logp, old, ratio = parts["logp"], parts["old_logp"], parts["ratio"]
    is_clipped, dual = parts["is_clipped"], parts["dual"]
    total, count = aggregate(per_token, mask, turn_ids, mode=aggregation, turns=turns)
    denom = count if normalizer is None else jnp.asarray(normalizer, dtype)
    loss = total / jnp.maximum(denom, 1e-8)

    n_tok = jnp.maximum(jnp.sum(mask), 1)
    ends = turns.end
    clipped_turns = turn_sum(is_clipped.astype(dtype), mask, turn_ids, turns=turns) > 0
    token_log_ratio = logp - old
    value_ratio = jax.lax.stop_gradient(ratio)
    # How far the policy moved, per turn, whatever ratio the loss used: |Σ_t log r_t| (the
    # product ratio's log) and |mean_t log r_t| (the length-normalised one), at turn ends.
    turn_lr = turn_sum(jax.lax.stop_gradient(token_log_ratio), mask, turn_ids, turns=turns)
    turn_len = jnp.maximum(turn_sum(mask.astype(dtype), mask, turn_ids, turns=turns), 1)
    n_turns = jnp.maximum(jnp.sum(ends), 1)
    metrics = {
        "loss_sum": total,
        "loss_count": count,
        "clip_frac": jnp.sum(is_clipped) / n_tok,
        "turn_clip_frac": jnp.sum(ends & clipped_turns) / jnp.maximum(jnp.sum(ends), 1),
        "dual_clip_frac": jnp.sum(dual) / n_tok,
        "approx_kl": jax.lax.stop_gradient(
            jnp.sum(jnp.where(mask, jnp.expm1(token_log_ratio) - token_log_ratio, 0)) / n_tok
        ),
        "ratio_mean": jnp.sum(jnp.where(mask, value_ratio, 0)) / n_tok,
        "ratio_max": jnp.max(jnp.where(mask, value_ratio, -jnp.inf), initial=0.0),
        "turn_log_ratio_abs": jnp.sum(jnp.where(ends, jnp.abs(turn_lr), 0)) / n_turns,
        "turn_log_ratio_abs_max": jnp.max(jnp.where(ends, jnp.abs(turn_lr), 0), initial=0.0),
        "turn_mean_log_ratio_abs": jnp.sum(jnp.where(ends, jnp.abs(turn_lr) / turn_len, 0))
        / n_turns,
    }
    return loss, metrics


def behaviour_weights(
    old_logp: ArrayLike,
    sampler_logp: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    *,
    level: Literal["token", "turn", "sequence"] = "token",
    reduce: Literal["sum", "mean"] = "sum",
    cap: float | None = 2.0,
    mask_bound: float | None = None,
    log_clamp: float = 20.0,
    turns: Turns | None = None,
) -> jax.Array:
    """Truncated importance weights of the proximal policy against the behaviour policy.

    Decoupled PPO (Hilton et al. 2022; AReaL): a token was sampled by the behaviour policy b
    (``sampler_logp``), the update's clipped ratio is taken against the proximal policy p (the
    learner's policy when the update starts, ``old_logp``), and the gap between the two is
    corrected by a stop-gradient weight. With D the log-ratio p − b of the level's span (token:
    the token itself; turn: Σ over the turn S_k, MPO's span; sequence: Σ over the row's action
    tokens; ``reduce="mean"`` divides by the span's length: the geometric mean), clamped to
    ``±log_clamp``:

        ρ = exp(D),   ρ̄ = min(ρ, C)          (C = ``cap``; None: no truncation)

    and with ``mask_bound`` M, every token of a span whose ρ lies outside [1/M, M] gets weight
    0 (dropped rather than truncated). Each token of a span carries its span's weight. Untruncated,
    E_b[ρ f] = E_p[f] for any f of the span (``reduce="sum"``: the exact likelihood ratio of the
    span); truncation trades that unbiasedness for bounded variance (the long-turn product of
    per-token ratios is what explodes: 1.1 per token over 100 tokens is 1.1^100).

    Returns:
      [B, T] weights, 0 off ``loss_mask`` (stop-gradient: neither policy is being optimised).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"level: unknown level {level!r}; choose one of {IS_LEVELS}")
    if reduce not in ("sum", "mean"):
        raise ValueError(f"reduce: unknown reduction {reduce!r}; choose 'sum' or 'mean'")
    if cap is not None and not cap > 0:
        raise ValueError(f"cap: must be > 0 (or None), got {cap}")
    if mask_bound is not None and not mask_bound > 1:
        raise ValueError(f"mask_bound: must be > 1 (or None), got {mask_bound}")
    check_token_arrays(
        "behaviour_weights",
        old_logp=old_logp,
        sampler_logp=sampler_logp,
        loss_mask=loss_mask,
        turn_ids=turn_ids,
    )
    dtype = float_dtype(old_logp, sampler_logp)
    mask = jnp.asarray(loss_mask, bool)
    p = jnp.where(mask, jnp.asarray(old_logp, dtype), 0)
    b = jnp.where(mask, jnp.asarray(sampler_logp, dtype), 0)
    if turns is None and level == "turn":
        turns = turn_structure(mask, turn_ids)
    d = _ratio_log(p, b, mask, turn_ids, level, reduce, turns)
    rho = jnp.exp(jnp.clip(d, -log_clamp, log_clamp))
    weights = rho if cap is None else jnp.minimum(rho, cap)
    if mask_bound is not None:
        weights = jnp.where((rho < 1 / mask_bound) | (rho > mask_bound), 0, weights)
    return jax.lax.stop_gradient(jnp.where(mask, weights, 0))


def value_loss(
    values: ArrayLike,
    old_values: ArrayLike,
    returns: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike | None = None,
    *,
    clip: float | None = 0.2,
    aggregation: Aggregation = "token_mean",
    normalizer: ArrayLike | None = None,
    turns: Turns | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Clipped squared error of the critic to its targets over ``loss_mask`` tokens.

    $$\ell_t = \tfrac12 \max\big((V_t - G_t)^2,\ (V^{old}_t + \mathrm{clip}(V_t - V^{old}_t,
      -c, c) - G_t)^2\big);$$

    ``clip=None`` is the plain $\tfrac12 (V_t - G_t)^2$. Returns (loss, metrics with ``loss_sum``,
    ``loss_count``, ``clip_frac``).
    """
    check_token_arrays(
        "value_loss",
        values=values,
        old_values=old_values,
        returns=returns,
        loss_mask=loss_mask,
        turn_ids=turn_ids,
    )
    dtype = float_dtype(values, old_values, returns)
    mask = jnp.asarray(loss_mask, bool)
    v = jnp.where(mask, jnp.asarray(values, dtype), 0)
    v_old = jnp.where(mask, jnp.asarray(old_values, dtype), 0)
    g = jnp.where(mask, jnp.asarray(returns, dtype), 0)
    err = (v - g) ** 2
    if clip is None:
        per_token = 0.5 * err
        clipped_frac = jnp.zeros((), dtype)
    else:
        v_clip = v_old + jnp.clip(v - v_old, -clip, clip)
        err_clip = (v_clip - g) ** 2
        per_token = 0.5 * jnp.maximum(err, err_clip)
        clipped_frac = jnp.sum(mask & (err_clip > err)) / jnp.maximum(jnp.sum(mask), 1)
    total, count = aggregate(per_token, mask, turn_ids, mode=aggregation, turns=turns)
    denom = count if normalizer is None else jnp.asarray(normalizer, dtype)
    loss = total / jnp.maximum(denom, 1e-8)
    return loss, {"loss_sum": total, "loss_count": count, "clip_frac": clipped_frac}


KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(
    logp: ArrayLike,
    ref_logp: ArrayLike,
    loss_mask: ArrayLike,
    *,
    kind: Literal["k1", "k2", "k3"] = "k3",
    clamp: float | None = 10.0,
) -> jax.Array:
    """Per-token estimates of KL(π || π_ref) from samples of π (Schulman's k1, k2, k3).

    With ``x = logp - ref_logp``: ``k1 = x``; ``k2 = ½ x²``; ``k3 = exp(-x) - 1 + x`` (unbiased,
    non-negative, low variance). Use it as a loss ([`aggregate`][mpo_jax.losses.aggregate]) or as a
    reward (``rewards - β · kl`` on action tokens). ``clamp`` bounds k3 (verl clamps at 10).

    Returns:
      [B, T], 0 off ``loss_mask``.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind: unknown KL estimator {kind!r}; choose one of {KL_KINDS}")
    check_same_shape("kl_penalty", None, logp=logp, ref_logp=ref_logp, loss_mask=loss_mask)
    dtype = float_dtype(logp, ref_logp)
    mask = jnp.asarray(loss_mask, bool)
    x = jnp.where(mask, jnp.asarray(logp, dtype) - jnp.asarray(ref_logp, dtype), 0)
    if kind == "k1":
        kl = x
    elif kind == "k2":
        kl = 0.5 * x**2
    else:
        kl = jnp.expm1(-x) + x
        if clamp is not None:
            kl = jnp.clip(kl, -clamp, clamp)
    return jnp.where(mask, kl, 0)


def entropy_from_logprobs(logprobs: ArrayLike) -> jax.Array:
    """Entropy ``H = -Σ_v p_v log p_v`` of distributions given as log-probs [..., V] -> [...].

    Terms with ``p_v = 0`` (log-prob -inf) contribute 0. Aggregate with
    [`aggregate`][mpo_jax.losses.aggregate].
    """
    lp = jnp.asarray(logprobs)
    p = jnp.exp(lp)
    return -jnp.sum(jnp.where(p > 0, p * lp, 0), axis=-1)
