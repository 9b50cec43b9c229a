"""The padded turn-segment layout (docs/design.md §2): the batch carrier and its validation.

A batch holds B trajectories padded to T tokens. ``loss_mask`` marks the tokens the policy sampled;
``turn_ids`` numbers the assistant turns 0, 1, ..., K_b - 1 on those tokens and is -1 elsewhere.
Turn boundaries come from ``turn_ids`` only, never from reward positions or runs of the mask, so an
assistant turn may even contain non-sampled tokens (template tokens) without splitting.

This module is the schema ([`TurnBatch`][mpo_jax.batch.TurnBatch], its fields once) and the
host-side validator ([`validate`][mpo_jax.batch.validate]). The segment helpers that compute on the
layout (turn starts and ends, turn sums and means, broadcasts) live in
[`mpo_jax.segments`][mpo_jax.segments]; the public ones are re-exported here, where docs/design.md
names the layout's API.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flax import struct

from mpo_jax.segments import (
    Turns,
    broadcast_trajectory_values,
    broadcast_turn_values,
    num_turns,
    place_on_turn_ends,
    trajectory_sums,
    turn_end_mask,
    turn_mean,
    turn_start_mask,
    turn_structure,
    turn_sum,
    turn_sums_per_turn,
)

__all__ = [
    "TurnBatch",
    "FIELD_FILL",
    "TOKEN_FIELDS",
    "padded_length",
    "pad_width",
    "pad_trailing",
    "validate",
    # re-exported from mpo_jax.segments
    "Turns",
    "turn_structure",
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
]


@struct.dataclass
class TurnBatch:
    """B trajectories padded to T tokens (docs/design.md §2): the one carrier from the rollout to
    the losses. Optional fields may be ``None``.

    Attributes:
      tokens: [B, T] int token ids.
      loss_mask: [B, T] bool, True on tokens the policy sampled.
      turn_ids: [B, T] int, the assistant turn index on ``loss_mask`` tokens, -1 elsewhere.
      rewards: [B, T] float; the outcome on the last ``loss_mask`` token, dense turn rewards on
        each turn's last token, zero elsewhere.
      group_ids: [B] int, rollouts of the same prompt share an id.
      truncated: [B] bool, the episode was cut before it finished, so its outcome is unknown and
        critic presets bootstrap it (the rollout's length budget; not a turn budget that is a
        rule of the task, whose outcome is final).
      values: [B, T] float critic values of the state before each token.
      logp: [B, T] float log-probs under the policy being optimised (where a caller has them).
      old_logp: [B, T] float log-probs of the rollout (behaviour) policy as the learner computes
        them: the denominator of every importance ratio.
      ref_logp: [B, T] float log-probs under the frozen reference policy.
      sampler_logp: [B, T] float log-probs the sampler reported while generating (equal to
        ``old_logp`` up to numerics; the trainer logs the largest gap).
      bootstrap_values: [B] float, the critic's value after the last action token (used when
        truncated).
      boundary_mask: [B, M] bool, a prefix mask over tool-call boundaries (TRACE; 0 is the prompt).
      answer_logprobs: [B, M] float, the reference model's mean per-token log-prob of the gold
        answer at each boundary (TRACE).
      step_keys: [B, K] int, a per-turn environment state key (GiGPO), -1 where no turn.
      advantages, returns: [B, T] float, the credit and the critic's targets once computed.
      is_weights: [B, T] float, the truncated behaviour weights ρ̄ of an off-policy correction
        (``mpo_jax.losses.behaviour_weights``), where the learner applies one.
      policy_version: [B] int, the policy version (updates applied) that sampled the row's turns.
    """

    tokens: Any
    loss_mask: Any
    turn_ids: Any
    rewards: Any
    group_ids: Any
    truncated: Any
    values: Any = None
    logp: Any = None
    old_logp: Any = None
    ref_logp: Any = None
    sampler_logp: Any = None
    bootstrap_values: Any = None
    boundary_mask: Any = None
    answer_logprobs: Any = None
    step_keys: Any = None
    advantages: Any = None
    returns: Any = None
    is_weights: Any = None
    policy_version: Any = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def present(self) -> dict[str, Any]:
        """The fields that are not None."""
        return {n: getattr(self, n) for n in self.field_names() if getattr(self, n) is not None}

    def only(self, *names: str) -> TurnBatch:
        """The same batch with every field outside ``names`` set to None (a view for one
        consumer, e.g. the loss: a jitted function then sees a fixed structure)."""
        unknown = sorted(set(names) - set(self.field_names()))
        if unknown:
            raise ValueError(f"TurnBatch: unknown field(s) {unknown}")
        return self.replace(**{n: None for n in self.field_names() if n not in names})

    def take_rows(self, rows) -> TurnBatch:
        """The batch of the given rows (an index array or slice), every field alike."""
        return self.replace(**{n: v[rows] for n, v in self.present().items()})

    def row_lengths(self) -> np.ndarray:
        """[B] tokens of each row up to and including its last action token (0 for a row without
        one): everything a loss, a value or a log-prob of an action token reads."""
        mask = np.asarray(self.loss_mask)
        t = mask.shape[1]
        return np.where(mask.any(1), t - np.argmax(mask[:, ::-1], axis=1), 0)

    def narrow(self, width: int) -> TurnBatch:
        """The batch with its [B, T] token fields cut (or padded with each field's fill) to
        ``width`` columns; per-row and per-turn fields unchanged. Cutting changes no loss, value
        or log-prob of an action token when ``width`` >= every
        [`row_lengths`][mpo_jax.batch.TurnBatch.row_lengths]."""
        out = {}
        for name in TOKEN_FIELDS:
            x = getattr(self, name)
            if x is not None:
                x = np.asarray(x)
                out[name] = (
                    x[:, :width]
                    if x.shape[1] >= width
                    else pad_width(x, width, FIELD_FILL.get(name, 0))
                )
        return self.replace(**out)

    @classmethod
    def concatenate(cls, batches: list[TurnBatch]) -> TurnBatch:
        """The rows of several batches (on the host, NumPy), in order. Ragged trailing widths
        ([B, M] boundaries, [B, K] step keys) are padded with each field's fill value
        (`FIELD_FILL`); the fields present must be the same in every batch."""
        if not batches:
            raise ValueError("TurnBatch.concatenate: no batches")
        names = list(batches[0].present())
        for b in batches[1:]:
            if list(b.present()) != names:
                raise ValueError(
                    f"TurnBatch.concatenate: fields {list(b.present())} differ from {names}"
                )
        out = {}
        for n in names:
            parts = [np.asarray(getattr(b, n)) for b in batches]
            out[n] = np.concatenate(pad_trailing(parts, FIELD_FILL.get(n, 0)), axis=0)
        return cls(**out)


# The value a field is padded with where rows differ in width: "no turn", "no key", "no boundary".
FIELD_FILL: dict[str, Any] = {"turn_ids": -1, "step_keys": -1, "boundary_mask": False}


def padded_length(n: int, *, cap: int | None = None, minimum: int = 16) -> int:
    """The width a batch whose longest row has ``n`` tokens is padded to: the smallest of the
    buckets 2^k and 3·2^(k-1) (at least ``minimum``) that holds n, and at most ``cap``. Buckets
    keep the number of compiled shapes small (two per doubling) and the padding under a third."""
    width = minimum
    while width < n:
        width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
    return width if cap is None else min(width, max(cap, n))


def pad_width(x: np.ndarray, width: int, fill) -> np.ndarray:
    """``x`` with its second axis padded with ``fill`` up to ``width`` (never cut)."""
    extra = width - x.shape[1]
    if extra <= 0:
        return x
    return np.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)


def pad_trailing(arrays: list[np.ndarray], fill) -> list[np.ndarray]:
    """Pads each array's second axis to the widest (1-d arrays are returned as they are)."""
    if not arrays or arrays[0].ndim < 2:
        return arrays
    width = max(a.shape[1] for a in arrays)
    return [pad_width(a, width, fill) for a in arrays]


# ----------------------------------------------------------------------------------------------
# Validation (host side, NumPy): every rule has its own message naming field, row and rule.
# ----------------------------------------------------------------------------------------------

_TOKEN_FLOAT_FIELDS = (
    "rewards",
    "values",
    "logp",
    "old_logp",
    "ref_logp",
    "sampler_logp",
    "advantages",
    "returns",
    "is_weights",
)
# Every [B, T] field: what [`TurnBatch.narrow`][mpo_jax.batch.TurnBatch.narrow] cuts.
TOKEN_FIELDS = ("tokens", "loss_mask", "turn_ids", *_TOKEN_FLOAT_FIELDS)


def _first_bad_row(bad: np.ndarray) -> tuple[int, int]:
    """(row, column) of the first True in a 2-D boolean array."""
    rows, cols = np.nonzero(bad)
    return int(rows[0]), int(cols[0])


def _check_dtype(name: str, x: np.ndarray, kind: str) -> None:
    kinds = {"int": "iu", "bool": "b", "float": "f"}[kind]
    if x.dtype.kind not in kinds:
        raise ValueError(f"{name}: dtype {x.dtype} is not {kind}")


def _check_shape(name: str, x: np.ndarray, shape: tuple[int, ...]) -> None:
    if x.shape != shape:
        raise ValueError(f"{name}: shape {x.shape}, expected {shape}")


def _check_finite(name: str, x: np.ndarray) -> None:
    bad = ~np.isfinite(x)
    if bad.any():
        if x.ndim == 1:
            raise ValueError(f"{name}[{int(np.nonzero(bad)[0][0])}]: NaN or inf")
        row, col = _first_bad_row(bad.reshape(x.shape[0], -1))
        raise ValueError(f"{name}[{row}]: NaN or inf at position {col}")


def validate(batch: TurnBatch, *, vocab_size: int | None = None) -> None:
    """Checks a batch on the host; raises ``ValueError`` naming the field, the row and the rule.

    Rules: shapes ([B, T] token fields, [B] per-trajectory fields, [B, M] boundary fields, [B, K]
    step keys); dtypes (int ids, bool masks, float numbers); no NaN or inf in any float field;
    token ids inside the vocabulary (when ``vocab_size`` is given); ``turn_ids`` is -1 exactly off
    ``loss_mask``, starts at 0 and rises by 0 or 1 from one action token to the next; rewards are
    zero off ``loss_mask``; ``boundary_mask`` is a prefix mask (True, ..., True, False, ...);
    answer log-probs are <= 0 on boundaries; step keys exist for exactly the turns the row has.
    """
    f = {k: (None if v is None else np.asarray(v)) for k, v in vars(batch).items()}
    tokens = f["tokens"]
    if tokens.ndim != 2:
        raise ValueError(f"tokens: rank {tokens.ndim}, expected [B, T]")
    b, t = tokens.shape
    _check_dtype("tokens", tokens, "int")
    for name, kind in (("loss_mask", "bool"), ("turn_ids", "int")):
        _check_shape(name, f[name], (b, t))
        _check_dtype(name, f[name], kind)
    for name in _TOKEN_FLOAT_FIELDS:
        if f[name] is not None:
            _check_shape(name, f[name], (b, t))
            _check_dtype(name, f[name], "float")
            _check_finite(name, f[name])
    for name, kind in (("group_ids", "int"), ("truncated", "bool")):
        _check_shape(name, f[name], (b,))
        _check_dtype(name, f[name], kind)
    if f["is_weights"] is not None and (f["is_weights"] < 0).any():
        row, col = _first_bad_row(f["is_weights"] < 0)
        raise ValueError(f"is_weights[{row}]: negative weight at position {col}")
    if f["policy_version"] is not None:
        _check_shape("policy_version", f["policy_version"], (b,))
        _check_dtype("policy_version", f["policy_version"], "int")
    if f["bootstrap_values"] is not None:
        _check_shape("bootstrap_values", f["bootstrap_values"], (b,))
        _check_dtype("bootstrap_values", f["bootstrap_values"], "float")
        _check_finite("bootstrap_values", f["bootstrap_values"])

    if vocab_size is not None:
        bad = (tokens < 0) | (tokens >= vocab_size)
        if bad.any():
            row, col = _first_bad_row(bad)
            raise ValueError(
                f"tokens[{row}]: id {int(tokens[row, col])} at position {col} "
                f"is outside the vocabulary [0, {vocab_size})"
            )

    mask, tid = f["loss_mask"], f["turn_ids"]
    off = ~mask & (tid != -1)
    if off.any():
        row, col = _first_bad_row(off)
        raise ValueError(
            f"turn_ids[{row}]: turn {int(tid[row, col])} at position {col} is on a non-action "
            "token (turn ids must be -1 where loss_mask is False)"
        )
    on = mask & (tid < 0)
    if on.any():
        row, col = _first_bad_row(on)
        raise ValueError(
            f"turn_ids[{row}]: {int(tid[row, col])} at position {col} is on a loss_mask token "
            "(action tokens need a turn id >= 0)"
        )
    for row in range(b):
        cols = np.nonzero(mask[row])[0]
        if cols.size == 0:
            continue
        ids = tid[row, cols].astype(np.int64)
        if ids[0] != 0:
            raise ValueError(
                f"turn_ids[{row}]: the first action token (position {int(cols[0])}) has turn "
                f"{int(ids[0])}, expected 0"
            )
        steps = np.diff(ids)
        bad = np.nonzero((steps < 0) | (steps > 1))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"turn_ids[{row}]: turn {int(ids[i + 1])} follows turn {int(ids[i])} at position "
                f"{int(cols[i + 1])} (turn ids must rise by 0 or 1 along the action tokens)"
            )

    stray = ~mask & (f["rewards"] != 0)
    if stray.any():
        row, col = _first_bad_row(stray)
        raise ValueError(
            f"rewards[{row}]: reward {float(f['rewards'][row, col])} at position {col} is on a "
            "non-action token (rewards belong on loss_mask tokens)"
        )

    bmask = f["boundary_mask"]
    if bmask is not None:
        if bmask.ndim != 2 or bmask.shape[0] != b:
            raise ValueError(f"boundary_mask: shape {bmask.shape}, expected [B={b}, M]")
        _check_dtype("boundary_mask", bmask, "bool")
        grows = bmask[:, 1:] & ~bmask[:, :-1]
        if grows.any():
            row, col = _first_bad_row(grows)
            raise ValueError(
                f"boundary_mask[{row}]: boundary {col + 1} is set after an unset boundary {col} "
                "(the mask must be a prefix: True, ..., True, False, ...)"
            )
        lp = f["answer_logprobs"]
        if lp is not None:
            _check_shape("answer_logprobs", lp, bmask.shape)
            _check_dtype("answer_logprobs", lp, "float")
            _check_finite("answer_logprobs", lp)
            pos = bmask & (lp > 0)
            if pos.any():
                row, col = _first_bad_row(pos)
                raise ValueError(
                    f"answer_logprobs[{row}]: {float(lp[row, col])} at boundary {col} is positive "
                    "(a mean log-probability is <= 0)"
                )
    elif f["answer_logprobs"] is not None:
        raise ValueError("answer_logprobs: given without boundary_mask")

    keys = f["step_keys"]
    if keys is not None:
        if keys.ndim != 2 or keys.shape[0] != b:
            raise ValueError(f"step_keys: shape {keys.shape}, expected [B={b}, K]")
        _check_dtype("step_keys", keys, "int")
        turns = np.where(mask, tid, -1).max(axis=1) + 1
        if (turns > keys.shape[1]).any():
            row = int(np.nonzero(turns > keys.shape[1])[0][0])
            raise ValueError(
                f"step_keys[{row}]: the row has {int(turns[row])} turns but step_keys has room for "
                f"{keys.shape[1]}"
            )
        has_turn = np.arange(keys.shape[1])[None, :] < turns[:, None]
        missing = has_turn & (keys < 0)
        if missing.any():
            row, col = _first_bad_row(missing)
            raise ValueError(f"step_keys[{row}]: turn {col} has no state key (got a negative key)")
