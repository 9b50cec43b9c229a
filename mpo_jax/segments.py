"""Segment helpers on the turn layout (docs/design.md §2): where turns start and end, turn sums
and means, broadcasts between tokens, turns and trajectories.

The turn structure is computed once ([`turn_structure`][mpo_jax.segments.turn_structure], one
forward and one reverse scan) and passed along as [`Turns`][mpo_jax.segments.Turns]: every function
here and every turn-level loss and estimator takes ``turns=`` to skip recomputing it. Internally the
helpers work in a time-major [T, B] layout: the estimators in
[`mpo_jax.advantages`][mpo_jax.advantages] transpose once, run every recursion over the leading axis
and transpose back.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from mpo_jax.scan import ScanMethod, linear_scans_time_major

__all__ = [
    "Turns",
    "turn_structure",
    "check_same_shape",
    "check_token_arrays",
    "check_rows",
    "turn_start_mask",
    "turn_end_mask",
    "turn_sum",
    "turn_mean",
    "num_turns",
    "broadcast_turn_values",
    "place_on_turn_ends",
    "broadcast_trajectory_values",
    "trajectory_sums",
    "turn_sums_per_turn",
    "float_dtype",
]

ArrayLike = jax.typing.ArrayLike


def _shape_of(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), bool)  # chex reads the shape only


def check_same_shape(fn: str, rank: int | None, **arrays: Any) -> None:
    """Shape check at a public entry point: the named arrays (None skipped) share one shape, of
    ``rank`` dimensions when given. Raises chex's ``AssertionError`` naming ``fn`` and the
    arguments; shapes are static, so the check costs nothing under ``jax.jit``."""
    named = {k: _shape_of(v) for k, v in arrays.items() if v is not None}
    names = ", ".join(named)
    if rank is not None:
        dims = {1: "[B]", 2: "[B, T]"}.get(rank, f"rank {rank}")
        chex.assert_rank(list(named.values()), rank, custom_message=f"{fn}: {names} must be {dims}")
    chex.assert_equal_shape(
        list(named.values()), custom_message=f"{fn}: {names} must share one shape"
    )


def check_token_arrays(fn: str, **arrays: Any) -> None:
    """[`check_same_shape`][mpo_jax.segments.check_same_shape] for [B, T] token arrays."""
    check_same_shape(fn, 2, **arrays)


def check_rows(fn: str, rows: int, **arrays: Any) -> None:
    """Shape check: the named per-trajectory arrays (None skipped) are [B] with B = ``rows``."""
    for name, v in arrays.items():
        if v is not None:
            chex.assert_shape(
                _shape_of(v),
                (rows,),
                custom_message=f"{fn}: {name} must be [B] with B = {rows}",
            )


# ----------------------------------------------------------------------------------------------
# Time-major internals first, [B, T] public functions below.
# ----------------------------------------------------------------------------------------------


class TurnStructure(NamedTuple):
    """Where turns start and end, time-major [T, B] boolean arrays."""

    mask: jax.Array
    start: jax.Array
    end: jax.Array


def neighbour_action_values_time_major(
    xs: list[jax.Array],
    mask: jax.Array,
    inits: list[jax.Array],
    *,
    reverse: bool,
    method: ScanMethod = "sequential",
) -> list[jax.Array]:
    """For each x: its value at the nearest action token strictly after t (``reverse=True``) or
    strictly before t (``reverse=False``); ``init`` where there is none. [T, B] in and out.

    ``u_t = m_{t±1} x_{t±1} + (1 - m_{t±1}) u_{t±1}``: the recursion passes through observation
    tokens, which is how every estimator here jumps over them. All xs share one loop.
    """

    def shifted(y, fill):
        pad = jnp.full_like(y[:1], fill)
        return jnp.concatenate([y[1:], pad] if reverse else [pad, y[:-1]], axis=0)

    terms = []
    for x, init in zip(xs, inits, strict=True):
        m = mask.astype(x.dtype)
        terms.append((shifted(jnp.where(mask, x, 0), 0), shifted(1 - m, 1), init))
    return linear_scans_time_major(terms, method=method, reverse=reverse)


def turn_structure_time_major(
    loss_mask_tm: jax.Array,
    turn_ids_tm: jax.Array,
    *,
    next_values: jax.Array | None = None,
    bootstrap: jax.Array | None = None,
    method: ScanMethod = "sequential",
) -> tuple[TurnStructure, jax.Array | None]:
    """First and last action token of each turn, from ``turn_ids`` alone ([T, B] inputs).

    A token starts a turn when the previous action token has a different id; it ends a turn when
    the next action token has a different id (or there is none). Optionally also returns, in the
    same loop, the value of ``next_values`` at the next action token (``bootstrap`` after the
    last), which every GAE-style estimator needs.
    """
    mask = loss_mask_tm.astype(bool)
    ids = jnp.where(mask, turn_ids_tm, -1).astype(jnp.float32)  # exact below 2**24
    batch = ids.shape[1:]
    (before,) = neighbour_action_values_time_major(
        [ids], mask, [jnp.full(batch, -1.0, jnp.float32)], reverse=False, method=method
    )
    xs, inits = [ids], [jnp.full(batch, -1.0, jnp.float32)]
    if next_values is not None:
        xs.append(next_values)
        inits.append(bootstrap)
    after = neighbour_action_values_time_major(xs, mask, inits, reverse=True, method=method)
    turns = TurnStructure(mask=mask, start=mask & (ids != before), end=mask & (ids != after[0]))
    return turns, (after[1] if next_values is not None else None)


def turn_sums_time_major(
    xs: list[jax.Array], turns: TurnStructure, *, method: ScanMethod = "sequential"
) -> list[jax.Array]:
    """For each x: ``Σ`` over each turn's action tokens, broadcast back to them ([T, B]).

    A reverse sum cut at turn ends leaves each turn's total on its first token; a forward fill cut
    at turn starts spreads it over the turn. Off-turn positions hold 0. All xs share two loops.
    """
    sums = []
    for x in xs:
        zero = jnp.zeros(x.shape[1:], x.dtype)
        sums.append((jnp.where(turns.mask, x, 0), 1 - turns.end.astype(x.dtype), zero))
    partials = linear_scans_time_major(sums, method=method)
    fills = []
    for p in partials:
        start = turns.start.astype(p.dtype)
        fills.append((start * p, 1 - start, jnp.zeros(p.shape[1:], p.dtype)))
    filled = linear_scans_time_major(fills, method=method, reverse=False)
    return [jnp.where(turns.mask, f, 0) for f in filled]


def float_dtype(*arrays: Any) -> jnp.dtype:
    """The float dtype the estimators compute in: at least float32, float64 when given and x64."""
    dtypes = [jnp.asarray(a).dtype for a in arrays if a is not None]
    dtype = jnp.result_type(*dtypes, jnp.float32)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.float32
    return jax.dtypes.canonicalize_dtype(dtype)


def _to_time_major(x: Any, dtype: Any = None) -> jax.Array:
    return jnp.asarray(x, dtype).T


class Turns(NamedTuple):
    """The turn structure of a [B, T] layout: compute it once with
    [`turn_structure`][mpo_jax.segments.turn_structure] and pass it as ``turns=`` to every helper,
    loss and estimator that needs it.

    Attributes:
      mask: [B, T] bool, the action tokens (``loss_mask``).
      start: [B, T] bool, True on the first action token of every turn.
      end: [B, T] bool, True on the last action token of every turn.
    """

    mask: jax.Array
    start: jax.Array
    end: jax.Array

    def time_major(self) -> TurnStructure:
        return TurnStructure(mask=self.mask.T, start=self.start.T, end=self.end.T)


def turn_structure(loss_mask: ArrayLike, turn_ids: ArrayLike) -> Turns:
    """Where every turn starts and ends, from ``turn_ids`` alone (one forward, one reverse scan).

    A token starts a turn when the previous action token has a different id; it ends a turn when
    the next action token has a different id (or there is none).
    """
    check_token_arrays("turn_structure", loss_mask=loss_mask, turn_ids=turn_ids)
    s, _ = turn_structure_time_major(_to_time_major(loss_mask), _to_time_major(turn_ids))
    return Turns(mask=s.mask.T, start=s.start.T, end=s.end.T)


def _time_major_turns(loss_mask, turn_ids, turns: Turns | None) -> TurnStructure:
    return (turns or turn_structure(loss_mask, turn_ids)).time_major()


def turn_start_mask(
    loss_mask: ArrayLike, turn_ids: ArrayLike, *, turns: Turns | None = None
) -> jax.Array:
    """[B, T] bool: True on the first action token of every turn."""
    return (turns or turn_structure(loss_mask, turn_ids)).start


def turn_end_mask(
    loss_mask: ArrayLike, turn_ids: ArrayLike, *, turns: Turns | None = None
) -> jax.Array:
    """[B, T] bool: True on the last action token of every turn."""
    return (turns or turn_structure(loss_mask, turn_ids)).end


def turn_sum(
    x: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    *,
    turns: Turns | None = None,
    method: ScanMethod = "sequential",
) -> jax.Array:
    """[B, T]: ``Σ_{u ∈ S_k} x_u`` on every action token t of turn k (S_k: the turn's action
    tokens); 0 off ``loss_mask``. Differentiable in ``x``."""
    check_token_arrays("turn_sum", x=x, loss_mask=loss_mask, turn_ids=turn_ids)
    dtype = float_dtype(x)
    s = _time_major_turns(loss_mask, turn_ids, turns)
    (total,) = turn_sums_time_major([_to_time_major(x, dtype)], s, method=method)
    return total.T


def turn_mean(
    x: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    *,
    turns: Turns | None = None,
    method: ScanMethod = "sequential",
) -> jax.Array:
    """[B, T]: ``(1/|S_k|) Σ_{u ∈ S_k} x_u`` on every action token of turn k; 0 off the mask."""
    check_token_arrays("turn_mean", x=x, loss_mask=loss_mask, turn_ids=turn_ids)
    dtype = float_dtype(x)
    s = _time_major_turns(loss_mask, turn_ids, turns)
    total, count = turn_sums_time_major(
        [_to_time_major(x, dtype), s.mask.astype(dtype)], s, method=method
    )
    return jnp.where(s.mask, total / jnp.maximum(count, 1), 0).T


def num_turns(loss_mask: ArrayLike, turn_ids: ArrayLike) -> jax.Array:
    """[B] int32: K_b, the number of assistant turns of each trajectory (0 for padding rows)."""
    ids = jnp.where(jnp.asarray(loss_mask, bool), jnp.asarray(turn_ids), -1)
    return (jnp.max(ids, axis=-1, initial=-1) + 1).astype(jnp.int32)


def broadcast_turn_values(
    per_turn: ArrayLike, loss_mask: ArrayLike, turn_ids: ArrayLike
) -> jax.Array:
    """[B, T]: ``per_turn[b, turn_ids[b, t]]`` on action tokens, 0 elsewhere.

    Args:
      per_turn: [B, K] values, one per turn (turns at index >= K read 0).
    """
    per_turn = jnp.asarray(per_turn)
    mask = jnp.asarray(loss_mask, bool)
    ids = jnp.asarray(turn_ids)
    k = per_turn.shape[-1]
    if k == 0:
        return jnp.zeros(mask.shape, per_turn.dtype)
    inside = mask & (ids >= 0) & (ids < k)
    picked = jnp.take_along_axis(per_turn, jnp.clip(ids, 0, k - 1), axis=-1)
    return jnp.where(inside, picked, 0)


def place_on_turn_ends(
    per_turn: ArrayLike, loss_mask: ArrayLike, turn_ids: ArrayLike, *, turns: Turns | None = None
) -> jax.Array:
    """[B, T]: ``per_turn[b, k]`` on the last action token of turn k, 0 elsewhere.

    The layout for dense turn rewards (docs/design.md §2): e.g. TRACE's turn credit fed to MAE.
    """
    ends = turn_end_mask(loss_mask, turn_ids, turns=turns)
    return jnp.where(ends, broadcast_turn_values(per_turn, loss_mask, turn_ids), 0)


def broadcast_trajectory_values(per_trajectory: ArrayLike, loss_mask: ArrayLike) -> jax.Array:
    """[B, T]: ``per_trajectory[b]`` on every action token of row b, 0 elsewhere."""
    mask = jnp.asarray(loss_mask, bool)
    x = jnp.asarray(per_trajectory)
    return jnp.where(mask, x[:, None], 0).astype(x.dtype)


def trajectory_sums(x: ArrayLike, loss_mask: ArrayLike) -> jax.Array:
    """[B]: ``Σ_t x_t`` over each row's action tokens (e.g. the outcome R_b from ``rewards``)."""
    x = jnp.asarray(x, float_dtype(x))
    return jnp.sum(jnp.where(jnp.asarray(loss_mask, bool), x, 0), axis=-1)


def turn_sums_per_turn(
    x: ArrayLike,
    loss_mask: ArrayLike,
    turn_ids: ArrayLike,
    num_turns: int,
) -> jax.Array:
    """[B, K]: ``Σ_{t∈S_k} x_t`` for k < ``num_turns`` (a static int); turns beyond K are dropped.

    E.g. per-turn rewards from token rewards (GiGPO's step rewards).
    """
    x = jnp.asarray(x, float_dtype(x))
    mask = jnp.asarray(loss_mask, bool)
    ids = jnp.asarray(turn_ids)
    b = x.shape[0]
    keep = mask & (ids >= 0) & (ids < num_turns)
    segment = jnp.where(keep, jnp.arange(b)[:, None] * num_turns + ids, b * num_turns)
    sums = jax.ops.segment_sum(
        jnp.where(keep, x, 0).reshape(-1), segment.reshape(-1), num_segments=b * num_turns + 1
    )
    return sums[:-1].reshape(b, num_turns)
