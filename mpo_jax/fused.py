"""Single-loop sequential forms of the GAE family (the ``method="sequential"`` path).

The estimators in :mod:`mpo_jax.advantages` are written as compositions of the linear recurrence
of :mod:`mpo_jax.scan`: that form is what the associative (log-depth) strategy needs. Run one
position at a time, though, the composition costs one loop per recurrence (turn starts, turn ends
and next values, turn sums, the two advantage recursions, the turn mean and its fill: six loops
for MAE, two for token GAE), each with its own reads, writes and transposes.

Here the same recursions are one reverse loop each, carrying what a hand-written per-timestep loop
carries (verl's GAE carries the next action token's value and the running advantage):

* :func:`token_gae_loop`: carry ``(V of the next action token, A_{t+1})``; one loop.
* :func:`turn_credit_loop`: turn GAE and, when ``beta`` is not 0, MAE's intra-turn trace. A turn's
  first token is only known once the loop reaches the previous turn's last token, so turn k's
  credit ``A_k`` (and its trace mean) is *emitted* there and a second, forward loop spreads it
  over the turn's tokens: two loops in all, whatever the number of turns.

The formulas are in docs/design.md §3 and in the docstrings of :mod:`mpo_jax.advantages`; these
functions take time-major [T, B] arrays prepared by it and are tested against the float64
reference and the associative form (``tests/test_advantages.py``). ``benchmarks/advantages.py``
measures both forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["token_gae_loop", "turn_credit_loop"]


def token_gae_loop(r, v, mask, boot, *, gamma, lam):
    """Token GAE over action tokens, [T, B] in, advantages [T, B] out (0 off ``mask``).

    Reverse over t: on an action token ``A_t = r_t + γ V_next - V_t + γλ A_next`` and then
    ``V_next, A_next = V_t, A_t``; observation tokens leave the carry as it is.
    """

    def step(carry, x):
        v_next, a_next = carry
        r_t, v_t, m_t = x
        a_t = r_t + gamma * v_next - v_t + gamma * lam * a_next
        carry = (jnp.where(m_t, v_t, v_next), jnp.where(m_t, a_t, a_next))
        return carry, jnp.where(m_t, a_t, 0)

    _, adv = jax.lax.scan(step, (boot, jnp.zeros_like(boot)), (r, v, mask), reverse=True)
    return adv


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
    zero = jnp.zeros_like(boot)

    def close(state):
        cur, v_next, v_next_turn, a_next_turn, _, r_sum, tr_sum, count = state
        a_k = r_sum + gamma_turn * v_next_turn - v_next + gamma_turn * lam_turn * a_next_turn
        c_k = a_k - beta * tr_sum / jnp.maximum(count, 1) if trace_on else a_k
        return a_k, c_k, a_k + v_next  # v_next is V_{s_k} here: the turn's first token

    def step(state, x):
        r_t, v_t, m_t, id_t = x
        cur, v_next, v_next_turn, a_next_turn, a_trace, r_sum, tr_sum, count = state
        is_end = m_t & (id_t != cur)
        emit = is_end & (cur >= 0)
        a_k, c_k, g_k = close(state)
        a_next_turn = jnp.where(emit, a_k, a_next_turn)
        v_next_turn = jnp.where(emit, v_next, v_next_turn)
        r_sum, tr_sum, count = (jnp.where(is_end, 0, s) for s in (r_sum, tr_sum, count))
        if trace_on:
            nxt = jnp.where(is_end, v_next_turn, v_next)
            gam = jnp.where(is_end, gamma_turn, gamma_token)
            a_t = r_t + gam * nxt - v_t + jnp.where(is_end, 0, gamma_token * lam_token) * a_trace
            a_trace = jnp.where(m_t, a_t, a_trace)
            tr_sum = jnp.where(m_t, tr_sum + a_t, tr_sum)
            count = jnp.where(m_t, count + 1, count)
            trace_t = jnp.where(m_t, a_t, 0)
        else:
            trace_t = zero
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
        return state, (trace_t, emit, c_k, g_k)

    ids = jnp.where(mask, turn_ids, -1).astype(jnp.int32)
    init = (jnp.full(boot.shape, -1, jnp.int32), zero, boot, zero, zero, zero, zero, zero)
    final, (trace, emit, c, g) = jax.lax.scan(step, init, (r, v, mask, ids), reverse=True)
    _, c_first, g_first = close(final)

    def spread(fill, x):
        # fill = (c_k, G_k) of the turn being written; the next turn's arrive at its last token.
        trace_t, m_t, emit_t, c_t, g_t = x
        adv = fill[0] + beta * trace_t if trace_on else fill[0]
        out = (jnp.where(m_t, adv, 0), jnp.where(m_t, fill[1], 0))
        return (jnp.where(emit_t, c_t, fill[0]), jnp.where(emit_t, g_t, fill[1])), out

    _, (adv, ret) = jax.lax.scan(spread, (c_first, g_first), (trace, mask, emit, c, g))
    return adv, ret
