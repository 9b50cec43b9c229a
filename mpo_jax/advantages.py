"""Every advantage estimator of docs/design.md §3, as pure jittable functions on [B, T] arrays.

Notation, per trajectory: the action (``loss_mask``) positions of turn k are S_k, in order;
s_k is the first of them; K turns. Observation tokens carry no reward, value or discount: every
recursion jumps over them. The value after the last action token is 0 (the episode ended) or
``bootstrap_value`` (pass ``jnp.where(truncated, v_after_last, 0)`` for truncated episodes).

Every function accepts NumPy or JAX arrays in float32 or float64 (float64 needs ``jax_enable_x64``),
computes in the wider of its inputs' float dtypes, and runs under ``jax.jit`` with its
hyperparameters passed as Python floats. Outputs are 0 off ``loss_mask``. Internally the arrays
are transposed once to time-major [T, B] and every recursion is
[`mpo_jax.scan.linear_scans_time_major`][mpo_jax.scan.linear_scans_time_major].
"""

from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp

from mpo_jax.fused import token_gae_loop, turn_credit_loop
from mpo_jax.scan import ScanMethod, linear_scans_time_major, reverse_linear_scan
from mpo_jax.segments import (
    Turns,
    TurnStructure,
    broadcast_turn_values,
    check_rows,
    check_same_shape,
    check_token_arrays,
    float_dtype,
    neighbour_action_values_time_major,
    turn_structure_time_major,
    turn_sums_time_major,
)

__all__ = [
    "token_gae",
    "turn_gae",
    "multiscale_advantages",
    "turn_log_ratio",
    "group_advantages",
    "trace_turn_credit",
    "trace_turn_advantages",
    "gigpo_advantages",
    "masked_whiten",
]

ArrayLike = jax.typing.ArrayLike


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------


def _prepare(fn, rewards, values, loss_mask, bootstrap_value, turn_ids=None):
    """Time-major float arrays with off-mask entries zeroed, and the bootstrap carry [B]."""
    check_token_arrays(fn, rewards=rewards, values=values, loss_mask=loss_mask, turn_ids=turn_ids)
    check_rows(fn, jnp.shape(loss_mask)[0], bootstrap_value=bootstrap_value)
    dtype = float_dtype(rewards, values)
    mask = jnp.asarray(loss_mask, bool).T
    r = jnp.where(mask, jnp.asarray(rewards, dtype).T, 0)
    v = jnp.where(mask, jnp.asarray(values, dtype).T, 0)
    boot = (
        jnp.zeros(mask.shape[1:], dtype)
        if bootstrap_value is None
        else jnp.broadcast_to(jnp.asarray(bootstrap_value, dtype), mask.shape[1:])
    )
    return r, v, mask, boot


def _turns_and_next_values(mask, turn_ids, v, boot, turns: Turns | None, method):
    """The time-major turn structure and V at the next action token (``boot`` after the last):
    one reverse loop for both, or only the values when the caller passes its ``turns``."""
    if turns is None:
        return turn_structure_time_major(
            mask, jnp.asarray(turn_ids).T, next_values=v, bootstrap=boot, method=method
        )
    (v_next,) = neighbour_action_values_time_major([v], mask, [boot], reverse=True, method=method)
    return turns.time_major(), v_next


def _turn_delta(r, v, turns: TurnStructure, v_next, gamma, lam, method):
    """Turn GAE in token space: (δ_k on turn ends, its recursion coefficient, V_{s_k} per token).

    A forward pass fills V_{s_k} and accumulates R_k = Σ_{t∈S_k} r_t up to each turn's end; at the
    end token δ_k = R_k + γ V_{s_{k+1}} - V_{s_k} (``v_next`` there is V_{s_{k+1}}). The reverse
    recursion A = δ + γλ A' then acts only at turn ends and passes the carry through everything
    else, so every token of turn k reads A_k.
    """
    start = turns.start.astype(v.dtype)
    zero = jnp.zeros(v.shape[1:], v.dtype)
    v_start, r_sum = linear_scans_time_major(
        [(start * v, 1 - start, zero), (r, 1 - start, zero)], method=method, reverse=False
    )
    delta = jnp.where(turns.end, r_sum + gamma * v_next - v_start, 0)
    coeff = jnp.where(turns.end, gamma * lam, 1).astype(v.dtype)
    return delta, coeff, v_start


def _out(*arrays):
    out = tuple(x.T for x in arrays)
    return out if len(out) > 1 else out[0]


# ----------------------------------------------------------------------------------------------
# The GAE family
# ----------------------------------------------------------------------------------------------


def token_gae(
    rewards: ArrayLike,
    values: ArrayLike,
    loss_mask: ArrayLike,
    *,
    gamma: float,
    lam: float,
    bootstrap_value: ArrayLike | None = None,
    method: ScanMethod = "sequential",
) -> tuple[jax.Array, jax.Array]:
    r"""Token-level GAE over the action tokens (PPO).

    Over the ``loss_mask`` positions $p_0 < \dots < p_{N-1}$ of a trajectory, with
    $V_{p_N}$ = ``bootstrap_value`` (default 0):

    $$\delta_i = r_{p_i} + \gamma V_{p_{i+1}} - V_{p_i}, \qquad
      A_i = \delta_i + \gamma \lambda A_{i+1},$$

    and returns $A + V$. Schulman et al. 2016, arXiv:1506.02438.

    Args:
      rewards: [B, T].
      values: [B, T].
      loss_mask: [B, T].
      gamma: discount (a Python float or a scalar).
      lam: GAE λ (a Python float or a scalar).
      bootstrap_value: [B] value after the last action token; 0 when None.
      method: scan strategy, see [`mpo_jax.scan`][mpo_jax.scan].

    Returns:
      (advantages, returns), each [B, T], 0 off ``loss_mask``.

    Examples:
      >>> import numpy as np
      >>> adv, ret = token_gae(np.array([[0., 0., 1.]]), np.zeros((1, 3)),
      ...                      np.array([[True, False, True]]), gamma=1.0, lam=1.0)
      >>> adv.tolist()
      [[1.0, 0.0, 1.0]]
    """
    r, v, mask, boot = _prepare("token_gae", rewards, values, loss_mask, bootstrap_value)
    if method == "sequential":
        adv = token_gae_loop(r, v, mask, boot, gamma=gamma, lam=lam)
        return _out(adv, jnp.where(mask, adv + v, 0))
    (v_next,) = neighbour_action_values_time_major([v], mask, [boot], reverse=True, method=method)
    delta = jnp.where(mask, r + gamma * v_next - v, 0)
    coeff = jnp.where(mask, gamma * lam, 1).astype(v.dtype)
    (adv,) = linear_scans_time_major([(delta, coeff, jnp.zeros_like(boot))], method=method)
    adv = jnp.where(mask, adv, 0)
    return _out(adv, jnp.where(mask, adv + v, 0))


def turn_gae(
    rewards: ArrayLike,
    values: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    *,
    gamma: float,
    lam: float,
    bootstrap_value: ArrayLike | None = None,
    turns: Turns | None = None,
    method: ScanMethod = "sequential",
) -> tuple[jax.Array, jax.Array]:
    r"""Turn-level GAE (turn-PPO): credit decays per turn, whatever the turn's length.

    With $S_k$ the action tokens of turn $k$, $s_k$ its first token and $V_{s_K}$ =
    ``bootstrap_value`` (default 0):

    $$R_k = \sum_{t \in S_k} r_t, \qquad \delta_k = R_k + \gamma V_{s_{k+1}} - V_{s_k}, \qquad
      A_k = \delta_k + \gamma \lambda A_{k+1}.$$

    Every token of turn $k$ gets $A_k$; returns $G_k = A_k + V_{s_k}$.

    ``turns`` (from [`mpo_jax.segments.turn_structure`][mpo_jax.segments.turn_structure]) skips
    recomputing the structure in the associative form; the sequential form finds turn boundaries
    inside its one loop.

    Returns:
      (advantages, returns), each [B, T], 0 off ``loss_mask``.
    """
    r, v, mask, boot = _prepare("turn_gae", rewards, values, loss_mask, bootstrap_value, turn_ids)
    if method == "sequential":
        ids = jnp.asarray(turn_ids).T
        return _out(*turn_credit_loop(r, v, mask, ids, boot, gamma_turn=gamma, lam_turn=lam))
    structure, v_next = _turns_and_next_values(mask, turn_ids, v, boot, turns, method)
    delta, coeff, v_start = _turn_delta(r, v, structure, v_next, gamma, lam, method)
    (adv,) = linear_scans_time_major([(delta, coeff, jnp.zeros_like(boot))], method=method)
    adv = jnp.where(mask, adv, 0)
    return _out(adv, jnp.where(mask, adv + v_start, 0))


def multiscale_advantages(
    rewards: ArrayLike,
    values: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    *,
    gamma_turn: float,
    lam_turn: float,
    gamma_token: float,
    lam_token: float,
    beta: float,
    bootstrap_value: ArrayLike | None = None,
    turns: Turns | None = None,
    method: ScanMethod = "sequential",
) -> jax.Array:
    r"""Multiscale advantages (MPO's MAE): turn GAE plus a mean-centred intra-turn trace.

    Turn part: $A_k$ from [`turn_gae`][mpo_jax.advantages.turn_gae] with
    $(\gamma_{turn}, \lambda_{turn})$. Inside turn $k$, over its action tokens
    $t_0 < \dots < t_n$:

    $$\delta_{t_i} = r_{t_i} + \gamma_{tok} V_{t_{i+1}} - V_{t_i} \quad (i < n), \qquad
      \delta_{t_n} = r_{t_n} + \gamma_{turn} V_{s_{k+1}} - V_{t_n},$$

    $$a_{t_i} = \sum_{j=0}^{n-i} (\gamma_{tok} \lambda_{tok})^j \, \delta_{t_{i+j}}, \qquad
      \hat A_t = A_k + \beta \big(a_t - \tfrac{1}{|S_k|} \textstyle\sum_{u \in S_k} a_u\big).$$

    This is the least-squares projection of $A_k + \beta a$ onto {turn mean $= A_k$}: every
    turn's mean advantage is exactly $A_k$ for any $\beta$, and $\beta = 0$ is turn-PPO.
    ``turns``: as in [`turn_gae`][mpo_jax.advantages.turn_gae].

    Returns:
      advantages [B, T], 0 off ``loss_mask``. (The critic's targets stay PPO's: use
      [`token_gae`][mpo_jax.advantages.token_gae]'s returns.)
    """
    r, v, mask, boot = _prepare(
        "multiscale_advantages", rewards, values, loss_mask, bootstrap_value, turn_ids
    )
    if method == "sequential":
        adv, _ = turn_credit_loop(
            r,
            v,
            mask,
            jnp.asarray(turn_ids).T,
            boot,
            gamma_turn=gamma_turn,
            lam_turn=lam_turn,
            gamma_token=gamma_token,
            lam_token=lam_token,
            beta=beta,
        )
        return _out(adv)
    turns, v_next = _turns_and_next_values(mask, turn_ids, v, boot, turns, method)
    delta, coeff, _ = _turn_delta(r, v, turns, v_next, gamma_turn, lam_turn, method)
    zero = jnp.zeros_like(boot)
    if isinstance(beta, int | float) and beta == 0:
        (adv,) = linear_scans_time_major([(delta, coeff, zero)], method=method)
        return _out(jnp.where(mask, adv, 0))
    gamma_next = jnp.where(turns.end, gamma_turn, gamma_token)
    delta_tok = jnp.where(mask, r + gamma_next * v_next - v, 0)
    trace_coeff = jnp.where(mask, jnp.where(turns.end, 0, gamma_token * lam_token), 1)
    adv_turn, trace = linear_scans_time_major(
        [(delta, coeff, zero), (delta_tok, trace_coeff.astype(v.dtype), zero)], method=method
    )
    trace_sum, count = turn_sums_time_major([trace, mask.astype(v.dtype)], turns, method=method)
    trace_mean = trace_sum / jnp.maximum(count, 1)
    adv = adv_turn + beta * (trace - trace_mean)
    return _out(jnp.where(mask, adv, 0))


def turn_log_ratio(
    logp: ArrayLike,
    old_logp: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    *,
    reduce: Literal["sum", "mean"] = "sum",
    turns: Turns | None = None,
    method: ScanMethod = "sequential",
) -> jax.Array:
    r"""The turn log-ratio $L_k = \sum_{t \in S_k} (\log \pi_t - \log \pi^{old}_t)$, broadcast to
    the turn's tokens.

    ``reduce="mean"`` divides by ``|S_k|`` (the geometric-mean ratio of GSPO and ST-PPO).
    Differentiable in ``logp``; unclamped (the policy loss clamps before ``exp``). ``turns``
    ([`mpo_jax.segments.turn_structure`][mpo_jax.segments.turn_structure]) skips recomputing the
    structure.

    Returns:
      [B, T], 0 off ``loss_mask``.
    """
    if reduce not in ("sum", "mean"):
        raise ValueError(f"reduce: unknown reduction {reduce!r}; choose 'sum' or 'mean'")
    check_token_arrays(
        "turn_log_ratio", logp=logp, old_logp=old_logp, loss_mask=loss_mask, turn_ids=turn_ids
    )
    dtype = float_dtype(logp, old_logp)
    mask = jnp.asarray(loss_mask, bool).T
    if turns is None:
        turns, _ = turn_structure_time_major(mask, jnp.asarray(turn_ids).T, method=method)
    else:
        turns = turns.time_major()
    diff = jnp.where(mask, jnp.asarray(logp, dtype).T - jnp.asarray(old_logp, dtype).T, 0)
    if reduce == "mean":
        total, count = turn_sums_time_major([diff, mask.astype(dtype)], turns, method=method)
        total = total / jnp.maximum(count, 1)
    else:
        (total,) = turn_sums_time_major([diff], turns, method=method)
    return _out(total)


# ----------------------------------------------------------------------------------------------
# Group-relative (critic-free) estimators
# ----------------------------------------------------------------------------------------------

_BASELINES = ("mean", "leave_one_out", "loo")  # "loo" is an alias of "leave_one_out"
_SCALES = ("std", "none")


def _grouped_center_scale(x, keys, valid, baseline, scale, eps):
    """Group-normalise the flat array ``x`` [N], elements grouped by equal ``keys`` (int [N] each).

    Sort-based: O(N log N), exact, jittable; invalid elements form no group and get 0. A group of
    one gets 0. std is the unbiased (ddof = 1) standard deviation of the group.
    """
    if baseline not in _BASELINES:
        raise ValueError(f"baseline: unknown baseline {baseline!r}; choose one of {_BASELINES}")
    if scale not in _SCALES:
        raise ValueError(f"scale: unknown scale {scale!r}; choose one of {_SCALES}")
    n = x.shape[0]
    if n == 0:
        return x
    # lexsort: the last key is the primary one; invalid elements sort to the end.
    order = jnp.lexsort(tuple(reversed(keys)) + (~valid,))
    sorted_keys = [k[order] for k in keys]
    sorted_valid = valid[order]
    changed = jnp.zeros(n, bool).at[0].set(True)
    for k in sorted_keys:
        changed = changed | jnp.concatenate([jnp.ones(1, bool), k[1:] != k[:-1]])
    segment = jnp.cumsum(changed) - 1
    segment = jnp.where(sorted_valid, segment, n)  # invalid -> a dropped segment
    xs = jnp.where(sorted_valid, x[order], 0)
    count = jax.ops.segment_sum(sorted_valid.astype(x.dtype), segment, num_segments=n + 1)
    total = jax.ops.segment_sum(xs, segment, num_segments=n + 1)
    cnt, tot = count[segment], total[segment]
    mean = tot / jnp.maximum(cnt, 1)
    if baseline == "mean":
        base = mean
    else:  # leave-one-out mean of the others
        base = (tot - xs) / jnp.maximum(cnt - 1, 1)
    centred = xs - base
    if scale == "std":
        sq = jax.ops.segment_sum(jnp.where(sorted_valid, (xs - mean) ** 2, 0), segment, n + 1)
        std = jnp.sqrt(sq[segment] / jnp.maximum(cnt - 1, 1))
        centred = centred / (std + eps)
    out_sorted = jnp.where(sorted_valid & (cnt > 1), centred, 0)
    return jnp.zeros_like(x).at[order].set(out_sorted)


def group_advantages(
    outcomes: ArrayLike,
    group_ids: ArrayLike,
    *,
    baseline: Literal["mean", "leave_one_out", "loo"] = "mean",
    scale: Literal["std", "none"] = "std",
    eps: float = 1e-6,
) -> jax.Array:
    r"""Group-relative outcome advantages (GRPO, Dr.GRPO, RLOO).

    $A_b = (R_b - \mathrm{base}_b) / (\mathrm{std}_g + \epsilon)$, with $\mathrm{base}_b$ the
    mean of b's group (GRPO) or the
    leave-one-out mean of the others (``baseline="leave_one_out"``, alias ``"loo"``: RLOO);
    ``scale="none"`` drops the division (Dr.GRPO, RLOO). std is the unbiased (ddof = 1) group
    standard deviation. A group of one gets 0. With either baseline the advantages of a group sum
    to zero.

    Args:
      outcomes: [B] trajectory returns R_b (e.g.
        [`mpo_jax.batch.trajectory_sums`][mpo_jax.segments.trajectory_sums]).
      group_ids: [B] int; equal ids share a group (any integers, not necessarily contiguous).

    Returns:
      [B] advantages (broadcast to tokens with
      [`mpo_jax.batch.broadcast_trajectory_values`][mpo_jax.segments.broadcast_trajectory_values]).

    Examples:
      >>> group_advantages([1.0, 0.0, 1.0, 0.0], [7, 7, 3, 3], scale="none").tolist()
      [0.5, -0.5, 0.5, -0.5]
    """
    check_same_shape("group_advantages", 1, outcomes=outcomes, group_ids=group_ids)
    x = jnp.asarray(outcomes, float_dtype(outcomes))
    ids = jnp.asarray(group_ids)
    return _grouped_center_scale(x, [ids], jnp.ones(x.shape, bool), baseline, scale, eps)


def gigpo_advantages(
    step_rewards: ArrayLike,
    step_keys: ArrayLike,
    step_mask: ArrayLike,
    group_ids: ArrayLike,
    *,
    gamma: float = 0.95,
    omega: float = 1.0,
    scale: Literal["std", "none"] = "std",
    eps: float = 1e-6,
) -> jax.Array:
    r"""GiGPO per-turn advantages: episode groups plus step groups of identical states.

    Episode part: $A_E(b)$ = [`group_advantages`][mpo_jax.advantages.group_advantages] of
    $R_b = \sum_k r_{b,k}$ by ``group_ids``. Step part: the discounted return from turn $k$,
    $G_{b,k} = \sum_{j \ge k} \gamma^{j-k} r_{b,j}$, normalised within its step group: turns
    $(b, k)$ of the same prompt group whose state keys are equal.
    $A_{b,k} = A_E(b) + \omega A_S(b, k)$ (Feng et al. 2025, arXiv:2505.10978).

    Args:
      step_rewards: [B, K] per-turn rewards (the outcome on the last turn).
      step_keys: [B, K] int, a hash of the environment state each turn acted in.
      step_mask: [B, K] bool, True on the turns that exist.
      group_ids: [B] int prompt groups.

    Returns:
      [B, K] per-turn advantages, 0 where ``step_mask`` is False (broadcast to tokens with
      [`mpo_jax.batch.broadcast_turn_values`][mpo_jax.segments.broadcast_turn_values]).
    """
    check_same_shape(
        "gigpo_advantages", 2, step_rewards=step_rewards, step_keys=step_keys, step_mask=step_mask
    )
    check_rows("gigpo_advantages", jnp.shape(step_mask)[0], group_ids=group_ids)
    dtype = float_dtype(step_rewards)
    mask = jnp.asarray(step_mask, bool)
    r = jnp.where(mask, jnp.asarray(step_rewards, dtype), 0)
    ids = jnp.asarray(group_ids)
    b, k = r.shape
    episode = group_advantages(jnp.sum(r, axis=-1), ids, scale=scale, eps=eps)
    returns = reverse_linear_scan(r, jnp.where(mask, gamma, 1).astype(dtype), axis=-1)
    flat_ids = jnp.broadcast_to(ids[:, None], (b, k)).reshape(-1)
    keys = jnp.asarray(step_keys).reshape(-1)
    step = _grouped_center_scale(
        returns.reshape(-1), [flat_ids, keys], mask.reshape(-1), "mean", scale, eps
    ).reshape(b, k)
    return jnp.where(mask, episode[:, None] + omega * step, 0)


# ----------------------------------------------------------------------------------------------
# TRACE: turn credit from a frozen reference model's belief in the gold answer
# ----------------------------------------------------------------------------------------------


def trace_turn_credit(
    answer_logprobs: ArrayLike,
    boundary_mask: ArrayLike,
    *,
    eps: float = 0.1,
    horizon: int = 3,
    gamma: float = 0.8,
    normalize: bool = True,
) -> jax.Array:
    r"""TRACE's turn credit: how much each turn moved the reference model toward the gold answer.

    With $\bar\ell_k$ the reference's mean per-token log-prob of the gold answer at boundary $k$
    ($k = 0$ is the prompt): $d_k = -\bar\ell_k + \epsilon$, $V_k = \log(d_0 / d_k)$,
    $\delta_k = V_{k+1} - V_k = \log(d_k / d_{k+1})$ (so the deltas telescope), and

    $$c_k = \sum_{j < H} \gamma^j \delta_{k+j} \quad \text{over the deltas that exist,}$$

    divided by the sum of the same weights when ``normalize``. $d_k$ uses
    $\max(-\bar\ell_k, 0)$ so a rounding-positive log-prob cannot reach a log of a
    non-positive number.

    Args:
      answer_logprobs: [B, M] mean log-probs ℓ̄_k (<= 0) at each boundary.
      boundary_mask: [B, M] bool prefix mask of the boundaries that exist.
      horizon: H, a Python int >= 1.

    Returns:
      [B, M-1]: entry k is the credit of turn k (the move from boundary k to k+1); 0 where
      boundary k+1 does not exist.
    """
    if not isinstance(horizon, int) or horizon < 1:
        raise ValueError(f"horizon: must be a Python int >= 1, got {horizon!r}")
    check_same_shape(
        "trace_turn_credit", 2, answer_logprobs=answer_logprobs, boundary_mask=boundary_mask
    )
    dtype = float_dtype(answer_logprobs)
    mask = jnp.asarray(boundary_mask, bool)
    lp = jnp.where(mask, jnp.asarray(answer_logprobs, dtype), 0)
    log_d = jnp.log(jnp.maximum(-lp, 0) + eps)
    delta = log_d[:, :-1] - log_d[:, 1:]
    exists = mask[:, :-1] & mask[:, 1:]
    delta = jnp.where(exists, delta, 0)
    m = delta.shape[-1]
    credit = jnp.zeros_like(delta)
    weight = jnp.zeros_like(delta)
    for j in range(min(horizon, m)):
        shifted = jnp.pad(delta[:, j:], ((0, 0), (0, j)))
        present = jnp.pad(exists[:, j:], ((0, 0), (0, j))).astype(dtype)
        credit = credit + gamma**j * shifted
        weight = weight + gamma**j * present
    if normalize:
        credit = credit / jnp.where(exists, weight, 1)
    return jnp.where(exists, credit, 0)


_TERMINAL_FILLS = ("zero", "last")


def trace_turn_advantages(
    outcome_advantages: ArrayLike,
    turn_credit: ArrayLike,
    boundary_mask: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    *,
    alpha_out: float = 1.0,
    alpha_turn: float = 0.2,
    terminal_fill: Literal["zero", "last"] = "zero",
) -> jax.Array:
    """TRACE token advantages: ``α_out · A_out(b) + α_turn · c_{turn(t)}`` on action tokens.

    Turn credit is not group-normalised. Turn k reads ``c_k`` from
    [`trace_turn_credit`][mpo_jax.advantages.trace_turn_credit]. Turns with no credit entry
    (typically the final answer turn, which crosses no tool-call boundary) get ``terminal_fill``:
    ``"zero"`` (only the outcome term) or ``"last"`` (repeat the last available turn credit). The
    paper's readings of its terminal fill differ, hence the option.

    Args:
      outcome_advantages: [B] group outcome advantages
        ([`group_advantages`][mpo_jax.advantages.group_advantages]).
      turn_credit: [B, M-1] from [`trace_turn_credit`][mpo_jax.advantages.trace_turn_credit].
      boundary_mask: [B, M] the same prefix mask given to
        [`trace_turn_credit`][mpo_jax.advantages.trace_turn_credit].

    Returns:
      [B, T] advantages, 0 off ``loss_mask``.
    """
    if terminal_fill not in _TERMINAL_FILLS:
        raise ValueError(
            f"terminal_fill: unknown fill {terminal_fill!r}; choose one of {_TERMINAL_FILLS}"
        )
    fn = "trace_turn_advantages"
    check_token_arrays(fn, loss_mask=loss_mask, turn_ids=turn_ids)
    check_rows(fn, jnp.shape(loss_mask)[0], outcome_advantages=outcome_advantages)
    check_same_shape(fn, 2, boundary_mask=boundary_mask)
    chex.assert_equal(
        jnp.shape(turn_credit),
        (jnp.shape(boundary_mask)[0], jnp.shape(boundary_mask)[1] - 1),
        custom_message=f"{fn}: turn_credit must be [B, M - 1] for a boundary_mask of [B, M]",
    )
    dtype = float_dtype(outcome_advantages, turn_credit)
    credit = jnp.asarray(turn_credit, dtype)
    mask = jnp.asarray(loss_mask, bool)
    ids = jnp.asarray(turn_ids)
    n_credit = jnp.maximum(jnp.sum(jnp.asarray(boundary_mask, jnp.int32), axis=-1) - 1, 0)  # [B]
    per_token = broadcast_turn_values(credit, mask, ids)
    if terminal_fill == "last" and credit.shape[-1] > 0:
        last = jnp.take_along_axis(credit, jnp.maximum(n_credit - 1, 0)[:, None], axis=-1)
        last = jnp.where(n_credit[:, None] > 0, last, 0)
        per_token = jnp.where(ids < n_credit[:, None], per_token, last)
    else:
        per_token = jnp.where(ids < n_credit[:, None], per_token, 0)
    out = alpha_out * jnp.asarray(outcome_advantages, dtype)[:, None] + alpha_turn * per_token
    return jnp.where(mask, out, 0)


# ----------------------------------------------------------------------------------------------
# Whitening
# ----------------------------------------------------------------------------------------------


def masked_whiten(
    x: ArrayLike, mask: ArrayLike, *, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
    """``(x - mean) / sqrt(var + ε)`` over the masked entries of the whole batch.

    var is the unbiased (ddof = 1) variance of the masked entries, as in verl and TRL. With
    ``shift_mean=False`` the mean is added back (scale only). Off-mask entries are 0.
    """
    check_same_shape("masked_whiten", None, x=x, mask=mask)
    dtype = float_dtype(x)
    x = jnp.asarray(x, dtype)
    m = jnp.asarray(mask, bool)
    n = jnp.sum(m)
    mean = jnp.sum(jnp.where(m, x, 0)) / jnp.maximum(n, 1)
    var = jnp.sum(jnp.where(m, (x - mean) ** 2, 0)) / jnp.maximum(n - 1, 1)
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(m, out, 0)
