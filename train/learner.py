"""The device side of the RL step: scoring (log-probs, values, TRACE answer log-probs) and the
jitted actor and critic updates.

Everything here is a pure function of parameter pytrees and arrays; models enter as nnx graphdefs
(``nnx.split``) so that ``jax.jit`` sees plain pytrees. Conventions on [B, T] token arrays:

* ``logp[b, t] = log π(tokens[b, t] | tokens[b, :t])`` at temperature τ (0 at t = 0);
* ``values[b, t] = V(tokens[b, :t])``, the critic's value of the state before token t, read from
  the hidden state at t - 1 (0 at t = 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kernels.logprobs import logprobs_and_entropy
from mpo_jax import losses
from mpo_jax.algorithms import Algorithm
from mpo_jax.batch import TurnBatch

__all__ = [
    "Models",
    "make_optimizer",
    "token_logprobs",
    "token_values",
    "values_and_bootstrap",
    "answer_logprobs",
    "UpdateFns",
    "loss_fields",
    "split_micro",
]


@dataclasses.dataclass(frozen=True)
class Models:
    """Graph definitions of the actor (a causal LM) and the critic (a value model)."""

    actor: Any
    critic: Any


def make_optimizer(
    lr: float, *, warmup_steps: int, updates_per_step: int = 1, clip: float, weight_decay: float
):
    """AdamW with linear warmup over training steps and global-norm clipping, inside
    ``optax.apply_if_finite``: an update whose gradients are not finite is skipped (parameters
    and optimizer state unchanged) however many come in a row.

    Every optimizer update of training step s (from 0) uses lr * min(1, (s + 1) / warmup_steps),
    where a step makes ``updates_per_step`` updates (epochs x minibatches): the first step already
    moves the parameters, warmup counts training steps whatever the minibatching, and
    warmup_steps <= 1 means a constant lr.
    """
    if warmup_steps <= 1:
        schedule = optax.constant_schedule(lr)
    else:
        per = max(int(updates_per_step), 1)

        def schedule(count):
            return lr * jnp.minimum(1.0, (count // per + 1) / warmup_steps)

    inner = optax.chain(
        optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay)
    )
    return optax.apply_if_finite(inner, max_consecutive_errors=2**30)


def _shift_right(x):
    return jnp.pad(x[:, :-1], ((0, 0), (1, 0)))


def token_logprobs(graphdef, params, tokens, *, temperature: float = 1.0):
    """(logp, entropy), each [B, T] float32, under the actor at ``temperature``."""
    model = nnx.merge(graphdef, params)
    hidden = model.model(tokens)
    weight, axis = model.lm_head()
    logp, ent = logprobs_and_entropy(
        hidden[:, :-1], weight, tokens[:, 1:], temperature=temperature, vocab_axis=axis
    )
    pad = ((0, 0), (1, 0))
    return jnp.pad(logp, pad), jnp.pad(ent, pad)


def token_values(graphdef, params, tokens):
    """[B, T] values of the state before each token."""
    model = nnx.merge(graphdef, params)
    return _shift_right(model(tokens))


def values_and_bootstrap(graphdef, params, tokens, lengths):
    """(values [B, T], bootstrap [B]): the values of :func:`token_values` and, per row, the value
    of the whole conversation ``tokens[b, :lengths[b]]`` (the state after its last token), which
    is the bootstrap value of a truncated episode. It is the value the critic reads at the first
    padding position, available even for a row that fills all T positions."""
    model = nnx.merge(graphdef, params)
    after = model(tokens)  # after[b, t] = V(tokens[b, : t + 1])
    last = jnp.clip(lengths - 1, 0, tokens.shape[1] - 1)
    boot = jnp.take_along_axis(after, last[:, None], axis=1)[:, 0]
    return _shift_right(after), jnp.where(lengths > 0, boot, 0)


def answer_logprobs(graphdef, params, tokens, prefix_lengths, answer, answer_len):
    """TRACE's ℓ̄: mean log-prob of the gold answer after each prefix, by the reference model.

    Args:
      tokens: [N, T] conversations; prefix_lengths: [N] how many of them form the prefix.
      answer: [N, A] answer ids (padded); answer_len: [N] their lengths (>= 1).

    Returns:
      [N] mean per-token log-probs of the answer given the prefix.
    """
    n, t = tokens.shape
    a = answer.shape[1]
    seq = jnp.concatenate([tokens, jnp.zeros((n, a), tokens.dtype)], axis=1)
    cols = jnp.arange(a)[None] + prefix_lengths[:, None]
    seq = jax.vmap(lambda s, c, x: s.at[c].set(x))(seq, cols, answer)
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(t + a, dtype=jnp.int32), (n, t + a))
    valid = positions < (prefix_lengths + answer_len)[:, None]
    hidden = model.model(seq, positions, valid)
    weight, axis = model.lm_head()
    prev = jnp.take_along_axis(hidden, (cols - 1)[:, :, None], axis=1)  # predicts each answer id
    logp, _ = logprobs_and_entropy(prev, weight, answer, vocab_axis=axis)
    present = jnp.arange(a)[None] < answer_len[:, None]
    return jnp.sum(jnp.where(present, logp, 0), axis=1) / jnp.maximum(answer_len, 1)


class UpdateFns:
    """Jitted loss-and-gradient functions and the guarded optimizer step for one preset."""

    def __init__(
        self,
        models: Models,
        algo: Algorithm,
        actor_tx,
        critic_tx,
        *,
        temperature,
        entropy_coef: float = 0.0,
    ):
        self.models, self.algo = models, algo
        self.entropy_coef = entropy_coef
        self.actor_tx, self.critic_tx = actor_tx, critic_tx
        self.temperature = temperature
        self.actor_grad = jax.jit(jax.value_and_grad(self._actor_loss, has_aux=True))
        self.critic_grad = jax.jit(jax.value_and_grad(self._critic_loss, has_aux=True))
        self.apply = jax.jit(self._apply, static_argnums=(0,))

    def _actor_loss(self, params, mb: TurnBatch, normalizer, token_count):
        logp, ent = token_logprobs(
            self.models.actor, params, mb.tokens, temperature=self.temperature
        )
        loss, metrics = losses.policy_loss(
            logp,
            mb.old_logp,
            mb.advantages,
            mb.loss_mask,
            mb.turn_ids,
            normalizer=normalizer,
            **self.algo.policy_loss_kwargs(),
        )
        mask = mb.loss_mask
        metrics["entropy_sum"] = jnp.sum(jnp.where(mask, ent, 0))
        if self.entropy_coef:
            loss = loss - self.entropy_coef * metrics["entropy_sum"] / token_count
        if self.algo.kl_coef and not self.algo.kl_in_reward:
            kl = losses.kl_penalty(logp, mb.ref_logp, mask, kind=self.algo.kl_kind)
            kl_sum = jnp.sum(kl)
            loss = loss + self.algo.kl_coef * kl_sum / token_count
            metrics["kl_sum"] = kl_sum
        return loss, metrics

    def _critic_loss(self, params, mb: TurnBatch, normalizer):
        values = token_values(self.models.critic, params, mb.tokens)
        loss, metrics = losses.value_loss(
            values,
            mb.values,
            mb.returns,
            mb.loss_mask,
            mb.turn_ids,
            clip=self.algo.critic.clip,
            normalizer=normalizer,
        )
        return loss, metrics

    def _apply(self, which, params, opt_state, grads, loss):
        """One optimizer step, skipped by ``optax.apply_if_finite`` (parameters and state
        unchanged) if the gradients or the loss are not finite. Returns (params, opt_state,
        applied, grad_norm); the norm is 0 for a skipped step."""
        tx = self.actor_tx if which == "actor" else self.critic_tx
        # a non-finite loss poisons the gradients, so apply_if_finite's one check covers both
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
        updates, new_state = tx.update(grads, opt_state, params)
        ok = new_state.last_finite
        norm = jnp.where(ok, optax.tree.norm(grads), 0.0)
        return optax.apply_updates(params, updates), new_state, ok, norm


def loss_fields(algo: Algorithm) -> tuple[str, ...]:
    """The batch fields the actor and critic losses of ``algo`` read (a fixed structure for
    jit: the ragged TRACE and GiGPO fields stay out)."""
    names = ["tokens", "loss_mask", "turn_ids", "old_logp", "advantages"]
    if algo.kl_coef:
        names.append("ref_logp")
    if algo.needs_critic:
        names += ["values", "returns"]
    return tuple(names)


def split_micro(batch: TurnBatch, parts: int):
    """Splits the rows of a minibatch into ``parts`` micro-batches."""
    for chunk in np.array_split(np.arange(len(batch.tokens)), parts):
        yield batch.take_rows(chunk)
