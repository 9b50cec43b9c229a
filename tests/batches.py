"""Random padded turn-segment batches with the edge cases that break estimators.

Rows mix: empty (padding) rows, one-turn rows, one-token turns, long observations, template tokens
inside a turn (not sampled, so off ``loss_mask`` but inside the turn), rewards anywhere on action
tokens, and groups of one.
"""

from __future__ import annotations

import numpy as np

from mpo_jax.batch import TurnBatch


def random_batch(
    rng: np.random.Generator,
    *,
    batch: int = 6,
    length: int = 48,
    max_turns: int = 5,
    dense_rewards: bool = True,
    dtype=np.float64,
) -> TurnBatch:
    """A valid TurnBatch [batch, length]; every row fits by construction (turns are cut to fit)."""
    loss_mask = np.zeros((batch, length), bool)
    turn_ids = np.full((batch, length), -1, np.int32)
    for b in range(batch):
        kind = rng.random()
        if kind < 0.12:
            continue  # an empty (padding) row
        pos = int(rng.integers(1, 6))  # prompt
        n_turns = 1 if kind < 0.3 else int(rng.integers(1, max_turns + 1))
        for k in range(n_turns):
            turn_len = 1 if rng.random() < 0.3 else int(rng.integers(2, 8))
            placed = 0
            for _ in range(turn_len):
                if pos >= length:
                    break
                if placed and rng.random() < 0.1 and pos + 1 < length:
                    pos += 1  # a template token inside the turn: not sampled
                loss_mask[b, pos] = True
                turn_ids[b, pos] = k
                pos += 1
                placed += 1
            if placed == 0:
                break
            obs = int(rng.integers(0, 4)) if rng.random() < 0.8 else int(rng.integers(8, 20))
            pos += obs
            if pos >= length:
                break
    rewards = np.zeros((batch, length), dtype)
    values = rng.normal(size=(batch, length)).astype(dtype)
    for b in range(batch):
        cols = np.nonzero(loss_mask[b])[0]
        if cols.size == 0:
            continue
        rewards[b, cols[-1]] = float(rng.integers(0, 2))  # the outcome on the last action token
        if dense_rewards:
            extra = cols[rng.random(cols.size) < 0.2]
            rewards[b, extra] += rng.normal(size=extra.size)
    group_ids = rng.integers(0, max(1, batch // 2), size=batch).astype(np.int32)
    truncated = rng.random(batch) < 0.3
    logp = -rng.exponential(size=(batch, length)).astype(dtype)
    old_logp = logp + 0.1 * rng.normal(size=(batch, length)).astype(dtype)
    return TurnBatch(
        tokens=rng.integers(0, 100, size=(batch, length)).astype(np.int32),
        loss_mask=loss_mask,
        turn_ids=turn_ids,
        rewards=rewards,
        group_ids=group_ids,
        truncated=truncated,
        values=values,
        logp=logp,
        old_logp=old_logp,
        bootstrap_values=np.where(truncated, rng.normal(size=batch), 0.0).astype(dtype),
    )
