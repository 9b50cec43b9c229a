"""Micro-batches by token budget: every row once, within the budget, and the same update and the
same scores whatever the budget (the losses are sums normalised by the whole minibatch)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpo_jax.batch import padded_length
from train.core import trainer as trainer_module
from train.core.config import parse_args
from train.core.learner import token_budget_groups

TINY = [
    "--layers", "1", "--width", "32", "--heads", "2", "--kv-heads", "1",
    "--prompts-per-step", "4", "--group-size", "2", "--eval-every", "0",
    "--no-progress", "--minibatches", "1", "--env", "synthetic-nav-long", "--preset", "mpo",
]  # fmt: skip


@given(
    st.lists(st.integers(0, 300), min_size=1, max_size=40),
    st.integers(16, 2048),
    st.sampled_from([1, 2, 4]),
)
def test_groups_hold_every_row_once_within_the_budget(lengths, budget, multiple):
    lengths = np.asarray(lengths)
    groups = token_budget_groups(lengths, budget, multiple=multiple)
    rows = np.concatenate([r for r, _ in groups])
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for r, padded in groups:
        width = padded_length(int(max(lengths[r].max(), 1)))
        assert padded >= len(r) and padded % multiple == 0
        assert padded * width <= budget or padded == multiple  # only a too-long row breaks it
        # rows of similar length travel together: a group's rows are the longest left
    first = [lengths[r].max() for r, _ in groups]
    assert first == sorted(first, reverse=True)


def _scored_and_updated(tmp_path, *extra):
    cfg = parse_args([*TINY, "--run-dir", str(tmp_path), *extra])
    trainer = trainer_module.Trainer(cfg)
    rollouts = trainer.rollout(0)
    batch, _ = trainer.score(rollouts)
    from mpo_jax import algorithms

    credit = algorithms.compute_advantages(trainer.algo, batch)
    trainer.update(batch, credit)
    return batch, jax.tree.leaves(trainer.state["actor"]), jax.tree.leaves(trainer.state["critic"])


@pytest.mark.parametrize("budget", ["64", "200"])
def test_the_update_and_the_scores_are_the_same_for_any_budget(tmp_path, budget):
    base_batch, base_actor, base_critic = _scored_and_updated(tmp_path / "base")
    batch, actor, critic = _scored_and_updated(tmp_path / budget, "--micro-batch-tokens", budget)
    for name in ("old_logp", "values"):
        np.testing.assert_allclose(
            getattr(batch, name), getattr(base_batch, name), atol=2e-5, err_msg=name
        )
    for a, b in zip(actor + critic, base_actor + base_critic, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


def test_a_budget_beside_micro_batches_is_refused():
    with pytest.raises(ValueError, match="micro_batch_tokens: sizes micro-batches by tokens"):
        parse_args([*TINY, "--micro-batch-tokens", "256", "--micro-batches", "2"])
    with pytest.raises(ValueError, match="micro_batch_tokens: must be >= 0"):
        parse_args([*TINY, "--micro-batch-tokens", "-1"])
