"""`validate` rejects each malformed batch kind with its own message; the segment helpers."""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from mpo_jax import batch as B
from tests.batches import random_batch


def good() -> B.TurnBatch:
    b = random_batch(np.random.default_rng(0), batch=4, length=32)
    keys = np.full((4, 6), -1, np.int64)
    k = np.asarray(B.num_turns(b.loss_mask, b.turn_ids))
    for i in range(4):
        keys[i, : k[i]] = np.arange(k[i]) + 10 * i
    bm = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], bool)
    return b.replace(
        boundary_mask=bm,
        answer_logprobs=np.where(bm, -1.5, 0.0),
        step_keys=keys,
        ref_logp=b.logp.copy(),
    )


def action_cell(b: B.TurnBatch, nth: int = 0) -> tuple[int, int]:
    rows, cols = np.nonzero(b.loss_mask)
    return int(rows[nth]), int(cols[nth])


def with_(b: B.TurnBatch, **arrays) -> B.TurnBatch:
    return dataclasses.replace(b, **arrays)


def test_a_valid_batch_passes():
    B.validate(good(), vocab_size=100)


@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_random_batches_are_valid(seed):
    B.validate(random_batch(np.random.default_rng(seed)))


def test_shape_rule():
    b = good()
    with pytest.raises(ValueError, match=r"values: shape \(4, 31\), expected \(4, 32\)"):
        B.validate(with_(b, values=b.values[:, :-1]))
    with pytest.raises(ValueError, match=r"group_ids: shape \(3,\), expected \(4,\)"):
        B.validate(with_(b, group_ids=b.group_ids[:3]))
    with pytest.raises(ValueError, match=r"tokens: rank 1"):
        B.validate(with_(b, tokens=b.tokens[0]))


def test_dtype_rule():
    b = good()
    with pytest.raises(ValueError, match="loss_mask: dtype int64 is not bool"):
        B.validate(with_(b, loss_mask=b.loss_mask.astype(np.int64)))
    with pytest.raises(ValueError, match="turn_ids: dtype float64 is not int"):
        B.validate(with_(b, turn_ids=b.turn_ids.astype(np.float64)))
    with pytest.raises(ValueError, match="rewards: dtype int64 is not float"):
        B.validate(with_(b, rewards=b.rewards.astype(np.int64)))


@pytest.mark.parametrize("field", ["rewards", "values", "logp", "old_logp", "ref_logp"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rule(field, bad):
    b = good()
    x = getattr(b, field).copy()
    x[2, 5] = bad
    with pytest.raises(ValueError, match=rf"{field}\[2\]: NaN or inf at position 5"):
        B.validate(with_(b, **{field: x}))


def test_vocabulary_rule():
    b = good()
    tokens = b.tokens.copy()
    tokens[1, 3] = 100
    with pytest.raises(ValueError, match=r"tokens\[1\]: id 100 at position 3 is outside"):
        B.validate(with_(b, tokens=tokens), vocab_size=100)


def test_turn_id_on_non_action_token_rule():
    b = good()
    row, col = np.argwhere(~b.loss_mask)[3]
    tid = b.turn_ids.copy()
    tid[row, col] = 0
    with pytest.raises(
        ValueError, match=rf"turn_ids\[{row}\]: turn 0 at position {col} is on a non"
    ):
        B.validate(with_(b, turn_ids=tid))


def test_missing_turn_id_on_action_token_rule():
    b = good()
    row, col = action_cell(b)
    tid = b.turn_ids.copy()
    tid[row, col] = -1
    with pytest.raises(ValueError, match=rf"turn_ids\[{row}\]: -1 at position {col} is on a loss"):
        B.validate(with_(b, turn_ids=tid))


def one_row(mask, turn_ids) -> B.TurnBatch:
    m = np.array([mask], bool)
    t = m.shape[1]
    return B.TurnBatch(
        tokens=np.zeros((1, t), np.int32),
        loss_mask=m,
        turn_ids=np.array([turn_ids], np.int32),
        rewards=np.zeros((1, t)),
        group_ids=np.zeros(1, np.int32),
        truncated=np.zeros(1, bool),
    )


def test_turn_ids_that_skip_rule():
    b = one_row([0, 1, 1, 0, 1, 0], [-1, 0, 0, -1, 2, -1])
    with pytest.raises(ValueError, match=r"turn_ids\[0\]: turn 2 follows turn 0 at position 4"):
        B.validate(b)


def test_turn_ids_that_go_back_rule():
    b = one_row([0, 1, 1, 0, 1, 1], [-1, 0, 1, -1, 0, 1])
    with pytest.raises(ValueError, match=r"turn_ids\[0\]: turn 0 follows turn 1 at position 4"):
        B.validate(b)


def test_turn_ids_that_do_not_start_at_zero_rule():
    b = one_row([0, 1, 1], [-1, 1, 1])
    with pytest.raises(ValueError, match=r"turn_ids\[0\]: the first action token .* turn 1"):
        B.validate(b)


def test_reward_on_non_action_token_rule():
    # verl's pitfall: the outcome placed on the observation / EOS token after the last action.
    b = good()
    row, col = np.argwhere(~b.loss_mask)[2]
    r = b.rewards.copy()
    r[row, col] = 1.0
    with pytest.raises(ValueError, match=rf"rewards\[{row}\]: reward 1.0 at position {col} is on"):
        B.validate(with_(b, rewards=r))


def test_boundary_mask_not_a_prefix_rule():
    b = good()
    bm = b.boundary_mask.copy()
    bm[1] = [True, False, True]
    with pytest.raises(ValueError, match=r"boundary_mask\[1\]: boundary 2 is set after an unset"):
        B.validate(with_(b, boundary_mask=bm))


def test_positive_answer_logprob_rule():
    b = good()
    lp = b.answer_logprobs.copy()
    lp[2, 1] = 0.5
    with pytest.raises(ValueError, match=r"answer_logprobs\[2\]: 0.5 at boundary 1 is positive"):
        B.validate(with_(b, answer_logprobs=lp))


def test_step_keys_rules():
    b = good()
    keys = b.step_keys.copy()
    row = int(np.argmax(np.asarray(B.num_turns(b.loss_mask, b.turn_ids))))
    keys[row, 0] = -1
    with pytest.raises(ValueError, match=rf"step_keys\[{row}\]: turn 0 has no state key"):
        B.validate(with_(b, step_keys=keys))
    with pytest.raises(ValueError, match=r"step_keys\[\d\]: the row has \d turns but"):
        B.validate(with_(b, step_keys=b.step_keys[:, :1]))


# ------------------------------------------------------------------------------------------------
# Segment helpers
# ------------------------------------------------------------------------------------------------
