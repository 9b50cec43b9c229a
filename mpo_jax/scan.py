r"""One recursion for every estimator: the first-order linear recurrence along the time axis.

Every advantage estimator in this package is a composition of

$$\text{reverse: } y_t = a_t + c_t \, y_{t+1}, \; y_T = \text{init}; \qquad
  \text{forward: } y_t = a_t + c_t \, y_{t-1}, \; y_{-1} = \text{init}$$

with per-position coefficients. Jumping over observation tokens is $a_t = 0, c_t = 1$ (the carry
passes through untouched); a turn boundary is $c_t = 0$ (the carry is cut). One well-tested
primitive then serves token GAE, turn GAE, intra-turn traces, segment sums and forward fills
(rlax's ``truncated_generalized_advantage_estimation`` makes the same point with per-step
discount vectors).

Two evaluation strategies compute the same numbers (up to float rounding):

* ``"sequential"`` (default): one ``lax.scan`` step per position over a time-major [T, ...] array,
  several recurrences sharing one loop. On CPUs XLA's loop costs tens of nanoseconds a step, so this
  runs close to memory bandwidth (see ``benchmarks/advantages.py``); a chunked two-level scan was
  measured slower here and dropped.
* ``"associative"``: ``lax.associative_scan`` (log T depth, about twice the work): the form for
  accelerators, where a long sequential loop leaves the device idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["ScanMethod", "reverse_linear_scan", "forward_linear_scan", "linear_scans_time_major"]

ScanMethod = Literal["sequential", "associative"]
_METHODS = ("sequential", "associative")


def _check_method(method: str) -> None:
    if method not in _METHODS:
        raise ValueError(f"method: unknown scan method {method!r}; choose one of {_METHODS}")


def _associative_time_major(a: jax.Array, c: jax.Array, init: jax.Array) -> jax.Array:
    # Fold the carry into the last step, then compose the affine maps y -> a + c * y.
    a = a.at[-1].add(c[-1] * init)
    c = c.at[-1].set(0)

    def compose(right, left):
        # With reverse=True the accumulation of later (right-hand) positions comes first.
        # Applying `right` then `left`: y = a_l + c_l * (a_r + c_r * y).
        c_r, a_r = right
        c_l, a_l = left
        return c_l * c_r, a_l + c_l * a_r

    _, y = jax.lax.associative_scan(compose, (c, a), reverse=True, axis=0)
    return y


def _affine_step(carry, ac):
    # Module level (not a closure) so that eager calls with equal shapes reuse the compiled loop.
    new = tuple(a_t + c_t * y for y, (a_t, c_t) in zip(carry, ac, strict=True))
    return new, new


def linear_scans_time_major(
    terms: Sequence[tuple[jax.Array, jax.Array, jax.Array]],
    *,
    method: ScanMethod = "sequential",
    reverse: bool = True,
) -> list[jax.Array]:
    """Several independent recurrences ``y_t = a_t + c_t * y_{t±1}`` over a leading time axis.

    Args:
      terms: ``(a, c, init)`` triples; ``a`` and ``c`` are [T, ...] and ``init`` is [...].
        The recurrences share one loop (``"sequential"``), so stacking them costs one pass.
      method: ``"sequential"`` or ``"associative"``.
      reverse: ``True`` runs ``y_t = a_t + c_t * y_{t+1}`` from the end (``y_T = init``);
        ``False`` runs ``y_t = a_t + c_t * y_{t-1}`` from t = 0 (``y_{-1} = init``).

    Returns:
      The list of solutions ``y``, each shaped like its ``a``.
    """
    _check_method(method)
    if not terms or terms[0][0].shape[0] == 0:
        return [a for a, _, _ in terms]
    if method == "associative":
        if not reverse:
            flipped = [(jnp.flip(a, 0), jnp.flip(c, 0), i) for a, c, i in terms]
            return [jnp.flip(_associative_time_major(*t), 0) for t in flipped]
        return [_associative_time_major(a, c, i) for a, c, i in terms]
    inits = tuple(i for _, _, i in terms)
    xs = tuple((a, c) for a, c, _ in terms)
    _, ys = jax.lax.scan(_affine_step, inits, xs, reverse=reverse)
    return list(ys)


def _scan_along(a, c, init, axis, method, reverse, name):
    a = jnp.asarray(a)
    c = jnp.asarray(c, a.dtype)
    if a.shape != c.shape:
        raise ValueError(f"{name}: a has shape {a.shape}, c has shape {c.shape}")
    a_tm, c_tm = jnp.moveaxis(a, axis, 0), jnp.moveaxis(c, axis, 0)
    init = jnp.broadcast_to(jnp.asarray(init, a.dtype), a_tm.shape[1:])
    (y,) = linear_scans_time_major([(a_tm, c_tm, init)], method=method, reverse=reverse)
    return jnp.moveaxis(y, 0, axis)


def reverse_linear_scan(
    a: jax.typing.ArrayLike,
    c: jax.typing.ArrayLike,
    init: jax.typing.ArrayLike = 0.0,
    *,
    axis: int = -1,
    method: ScanMethod = "sequential",
) -> jax.Array:
    """Solves ``y_t = a_t + c_t * y_{t+1}`` backwards along ``axis``, with ``y_T = init``.

    Args:
      a: additive terms, time along ``axis``.
      c: multiplicative coefficients, same shape as ``a``.
      init: the carry entering after the last position; broadcast to ``a`` without ``axis``.
      axis: the time axis.
      method: ``"sequential"`` (default) or ``"associative"``.

    Returns:
      y, same shape and dtype as ``a``.

    Examples:
      >>> import jax.numpy as jnp
      >>> reverse_linear_scan(jnp.array([1.0, 1.0, 1.0]), jnp.array([0.5, 0.5, 0.5]))
      Array([1.75, 1.5 , 1.  ], dtype=float32)
    """
    return _scan_along(a, c, init, axis, method, True, "reverse_linear_scan")


def forward_linear_scan(
    a: jax.typing.ArrayLike,
    c: jax.typing.ArrayLike,
    init: jax.typing.ArrayLike = 0.0,
    *,
    axis: int = -1,
    method: ScanMethod = "sequential",
) -> jax.Array:
    """Solves ``y_t = a_t + c_t * y_{t-1}`` forwards along ``axis``, with ``y_{-1} = init``.

    Examples:
      >>> import jax.numpy as jnp
      >>> forward_linear_scan(jnp.array([1.0, 1.0, 1.0]), jnp.array([0.5, 0.5, 0.5]))
      Array([1.  , 1.5 , 1.75], dtype=float32)
    """
    return _scan_along(a, c, init, axis, method, False, "forward_linear_scan")
