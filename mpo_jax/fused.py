"""Single-loop sequential forms of the GAE family (the ``method="sequential"`` path).

The estimators in [`mpo_jax.advantages`][mpo_jax.advantages] are written as compositions of the
linear recurrence of [`mpo_jax.scan`][mpo_jax.scan]: that form is what the associative (log-depth)
strategy needs. Run one position at a time, though, the composition costs one loop per recurrence
(turn starts, turn ends and next values, turn sums, the two advantage recursions, the turn mean and
its fill: six loops for MAE, two for token GAE), each with its own reads, writes and transposes.

Here the same recursions are one reverse loop each, carrying what a hand-written per-timestep loop
carries (verl's GAE carries the next action token's value and the running advantage):

* [`token_gae_loop`][mpo_jax.fused.token_gae_loop]: carry ``(V of the next action token, A_{t+1})``;
one loop.
* [`turn_credit_loop`][mpo_jax.fused.turn_credit_loop]: turn GAE and, when ``beta`` is not 0, MAE's
intra-turn trace. A turn's
  first token is only known once the loop reaches the previous turn's last token, so turn k's
  credit ``A_k`` (and its trace mean) is *emitted* there and a second, forward loop spreads it
  over the turn's tokens: two loops in all, whatever the number of turns.

The formulas are in docs/design.md §3 and in the docstrings of
[`mpo_jax.advantages`][mpo_jax.advantages]; these functions take time-major [T, B] arrays prepared
by it and are tested against the float64 reference and the associative form
(``tests/test_advantages.py``). ``benchmarks/advantages.py`` measures both forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["token_gae_loop", "turn_credit_loop"]


# The loop bodies are module-level functions with the hyperparameters in the carry (not closed
# over), so eager calls with equal shapes reuse one compiled loop whatever γ, λ and β are.


def _gae_step(carry, x):
    (gamma, gamma_lam), v_next, a_next = carry
    r_t, v_t, m_t = x
    a_t = r_t + gamma * v_next - v_t + gamma_lam * a_next
    carry = ((gamma, gamma_lam), jnp.where(m_t, v_t, v_next), jnp.where(m_t, a_t, a_next))
    return carry, jnp.where(m_t, a_t, 0)


def token_gae_loop(r, v, mask, boot, *, gamma, lam):
    """Token GAE over action tokens, [T, B] in, advantages [T, B] out (0 off ``mask``).

    Reverse over t: on an action token ``A_t = r_t + γ V_next - V_t + γλ A_next`` and then
    ``V_next, A_next = V_t, A_t``; observation tokens leave the carry as it is.
    """
    params = (jnp.asarray(gamma, v.dtype), jnp.asarray(gamma * lam, v.dtype))
    init = (params, boot, jnp.zeros_like(boot))
    _, adv = jax.lax.scan(_gae_step, init, (r, v, mask), reverse=True)
    return adv


def _close_turn(params, state):
    """(A_k, c_k = A_k - β mean(trace), G_k = A_k + V_{s_k}) of the turn the state has read."""
    gamma_turn, gamma_lam_turn, _, _, beta = params
    _, v_next, v_next_turn, a_next_turn, _, r_sum, tr_sum, count = state
    a_k = r_sum + gamma_turn * v_next_turn - v_next + gamma_lam_turn * a_next_turn
    return a_k, a_k - beta * tr_sum / jnp.maximum(count, 1), a_k + v_next


def _turn_step(carry, x, *, trace_on):
    params, state = carry
    gamma_turn, _, gamma_token, gamma_lam_token, _ = params
    r_t, v_t, m_t, id_t = x
    cur, v_next, v_next_turn, a_next_turn, a_trace, r_sum, tr_sum, count = state
    is_end = m_t & (id_t != cur)
    emit = is_end & (cur >= 0)
    a_k, c_k, g_k = _close_turn(params, state)
    a_next_turn = jnp.where(emit, a_k, a_next_turn)
    v_next_turn = jnp.where(emit, v_next, v_next_turn)
    r_sum, tr_sum, count = (jnp.where(is_end, 0, x) for x in (r_sum, tr_sum, count))
    if trace_on:
        nxt = jnp.where(is_end, v_next_turn, v_next)
        gam = jnp.where(is_end, gamma_turn, gamma_token)
        a_t = r_t + gam * nxt - v_t + jnp.where(is_end, 0, gamma_lam_token) * a_trace
        a_trace = jnp.where(m_t, a_t, a_trace)
        tr_sum = jnp.where(m_t, tr_sum + a_t, tr_sum)
        count = jnp.where(m_t, count + 1, count)
        trace_t = jnp.where(m_t, a_t, 0)
    else:
        trace_t = jnp.zeros_like(v_t)
    r_sum = jnp.where(m_t, r_sum + r_t, r_sum)
    state = (
        jnp.where(m_t, id_t, cur),
        jnp.where(m_t, v_t, v_next),
        v_next_turn,
        a_next_turn,
        a_trace,
        r_sum,
        tr_sum,
        count,
    )
    return (params, state), (trace_t, emit, c_k, g_k)


def _turn_step_with_trace(carry, x):
    return _turn_step(carry, x, trace_on=True)


def _turn_step_without_trace(carry, x):
    return _turn_step(carry, x, trace_on=False)


def _spread_step(carry, x):
    # carry: (β, (c_k, G_k) of the turn being written); the next turn's arrive at its last token.
    beta, (fill_c, fill_g) = carry
    trace_t, m_t, emit_t, c_t, g_t = x
    out = (jnp.where(m_t, fill_c + beta * trace_t, 0), jnp.where(m_t, fill_g, 0))
    fill = (jnp.where(emit_t, c_t, fill_c), jnp.where(emit_t, g_t, fill_g))
    return (beta, fill), out


def turn_credit_loop(
    r, v, mask, turn_ids, boot, *, gamma_turn, lam_turn, gamma_token=1.0, lam_token=1.0, beta=0.0
):
    """Turn GAE (``beta = 0``) or MAE, [T, B] in; ``(advantages, turn returns)`` out, 0 off mask.

    Reverse loop state per row: the id of the turn being read (``cur``, -1 before any), V of the
    next action token, ``V_{s_{k+1}}`` and ``A_{k+1}`` of the turn after it, and the running
    sums of turn ``cur``: ``R_k``, the trace sum and its token count. At the last action token of
    a new turn (its id differs from ``cur``) turn ``cur`` is complete, and

        A_k = R_k + γ_turn V_{s_{k+1}} - V_{s_k} + γ_turn λ_turn A_{k+1}
        c_k = A_k - β · mean_{S_k}(trace)

    is emitted at that position (the final state closes turn 0). The trace of MAE is
    ``a_t = r_t + γ' V_next - V_t + γ_tok λ_tok a_next`` with ``γ' = γ_turn`` and no carry across
    a turn's end (``V_next`` there is ``V_{s_{k+1}}``). The forward loop then writes
    ``c_k + β a_t`` on every token of turn k, and the turn return ``A_k + V_{s_k}`` (under
    ``jax.jit`` an unused output is dropped from the loop).
    """
    trace_on = not (isinstance(beta, int | float) and beta == 0)
    dtype = v.dtype
    params = tuple(
        jnp.asarray(x, dtype)
        for x in (gamma_turn, gamma_turn * lam_turn, gamma_token, gamma_token * lam_token, beta)
    )
    zero = jnp.zeros_like(boot)
    ids = jnp.where(mask, turn_ids, -1).astype(jnp.int32)
    state = (jnp.full(boot.shape, -1, jnp.int32), zero, boot, zero, zero, zero, zero, zero)
    step = _turn_step_with_trace if trace_on else _turn_step_without_trace
    (_, final), (trace, emit, c, g) = jax.lax.scan(
        step, (params, state), (r, v, mask, ids), reverse=True
    )
    _, c_first, g_first = _close_turn(params, final)
    _, (adv, ret) = jax.lax.scan(
        _spread_step, (params[-1], (c_first, g_first)), (trace, mask, emit, c, g)
    )
    return adv, ret
