"""The device side of the RL step: scoring (log-probs, values, TRACE answer log-probs) and the
jitted actor and critic updates.

Everything here is a pure function of parameter pytrees and arrays; models enter as nnx graphdefs
(``nnx.split``) so that ``jax.jit`` sees plain pytrees. Parameters are an nnx.State or, for a
LoRA run, [`Adapted`][train.model.lora.Adapted] (a frozen base and the adapters): the gradient
functions then differentiate the adapters alone. The trunk reads whole token rows
``tokens`` [B, T]; everything a loss reads is computed at the action tokens alone, compacted to
[B, A] by `ActionRows` (``positions[b, a]`` is the a-th action token of row b): the
151,936-way softmax of the LM head runs on the tokens the policy sampled, not on prompts,
observations and padding. Conventions at a position p = positions[b, a]:

* ``logp[b, a] = log π(tokens[b, p] | tokens[b, :p])`` at temperature τ;
* ``values[b, a] = V(tokens[b, :p])``, the critic's value of the state before the token, read
  from the hidden state at p - 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding

from kernels.logprobs import logprobs_and_entropy
from mpo_jax import losses
from mpo_jax.algorithms import Algorithm
from mpo_jax.batch import FIELD_FILL, TurnBatch, padded_length
from train.model.context import constrain_tokens
from train.model.lora import Adapted, bind

__all__ = [
    "Models",
    "make_optimizer",
    "token_logprobs",
    "token_values",
    "values_and_bootstrap",
    "ActionRows",
    "answer_logprobs",
    "UpdateFns",
    "loss_fields",
    "split_micro",
    "token_budget_groups",
    "budget_micro_batches",
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


@struct.dataclass
class ActionRows:
    """A micro-batch as the device sees it: whole token rows for the trunk, and every per-token
    field the losses read at the action tokens alone, compacted to [B, A] (order kept; turn ids
    stay consecutive, so every estimator and aggregation reads them as it reads [B, T] rows).

    Attributes:
      tokens: [B, T] int token ids (T: the group's longest row, padded).
      positions: [B, A] int, the column of each action token (0 past a row's last one).
      loss_mask: [B, A] bool, True on real action tokens; turn_ids: [B, A] int (-1 off them).
      old_logp, advantages, ref_logp, values, returns: [B, A] float, where the loss reads them.
      is_weights: [B, A] float, the off-policy correction's behaviour weights, where applied.
    """

    tokens: Any
    positions: Any
    loss_mask: Any
    turn_ids: Any
    old_logp: Any = None
    advantages: Any = None
    ref_logp: Any = None
    values: Any = None
    returns: Any = None
    is_weights: Any = None

    @classmethod
    def of(cls, batch: TurnBatch, names=(), *, width: int | None = None) -> ActionRows:
        """The rows of ``batch`` compacted (host side): ``tokens`` narrowed to ``width`` (default:
        the padded length of the longest row), the ``names`` fields gathered at the action tokens,
        A the padded length of the largest action count."""
        mask = np.asarray(batch.loss_mask, bool)
        counts = mask.sum(axis=1)
        a = padded_length(int(counts.max(initial=1)), minimum=8)
        order = np.argsort(~mask, axis=1, kind="stable")[:, :a]  # action columns first, in order
        if order.shape[1] < a:
            order = np.pad(order, ((0, 0), (0, a - order.shape[1])))
        valid = np.arange(a)[None] < counts[:, None]
        positions = np.where(valid, order, 0).astype(np.int32)
        if width is None:
            width = padded_length(int(batch.row_lengths().max(initial=1)), cap=mask.shape[1])
        fields = {}
        for name in names:
            x = np.take_along_axis(np.asarray(getattr(batch, name)), positions, axis=1)
            fields[name] = np.where(valid, x, FIELD_FILL.get(name, 0)).astype(x.dtype)
        turn_ids = np.where(valid, np.take_along_axis(batch.turn_ids, positions, axis=1), -1)
        return cls(
            tokens=np.asarray(batch.tokens)[:, :width],
            positions=positions,
            loss_mask=valid,
            turn_ids=turn_ids.astype(np.int32),
            **fields,
        )

    def pad_rows(self, rows: int) -> ActionRows:
        """These rows followed by empty ones (no action token: they add nothing to any loss or
        count) up to ``rows``, so that micro-batches of one width share one compiled shape."""
        extra = rows - len(self.tokens)
        if extra <= 0:
            return self
        fills = {"loss_mask": False, "turn_ids": -1, **FIELD_FILL}
        out = {}
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if x is None:
                out[f.name] = None
                continue
            x = np.asarray(x)
            pad = np.full((extra, *x.shape[1:]), fills.get(f.name, 0), x.dtype)
            out[f.name] = np.concatenate([x, pad])
        return ActionRows(**out)

    def scatter(self, values, shape) -> np.ndarray:
        """[B, A] values back to their [B, T] columns (zeros elsewhere), on the host."""
        out = np.zeros(shape, np.float32)
        rows, slots = np.nonzero(np.asarray(self.loss_mask))
        out[rows, np.asarray(self.positions)[rows, slots]] = np.asarray(values)[rows, slots]
        return out


def _before(hidden, positions):
    """[B, A, D]: the hidden state that predicts each position's token (the one at p - 1);
    split over the mesh's ``context`` axis where there is one, so that the LM head and the
    log-probs over the vocabulary run on 1/C of the action tokens a device."""
    picked = jnp.take_along_axis(hidden, jnp.maximum(positions - 1, 0)[..., None], axis=1)
    return constrain_tokens(picked)


def token_logprobs(graphdef, params, tokens, positions, *, temperature: float = 1.0):
    """(logp, entropy) [B, A] float32 of ``tokens[b, positions[b, a]]`` under the actor at
    ``temperature``, given the tokens before it."""
    model = bind(graphdef, params)
    hidden = model.model(tokens)
    weight, axis = model.lm_head()
    targets = jnp.take_along_axis(tokens, positions, axis=1)
    return logprobs_and_entropy(
        _before(hidden, positions), weight, targets, temperature=temperature, vocab_axis=axis
    )


def token_values(graphdef, params, tokens, positions):
    """[B, A] values of the state before each position's token."""
    model = bind(graphdef, params)
    hidden = model.model(tokens)
    return model.value_head(_before(hidden, positions).astype(jnp.float32))[..., 0]


def values_and_bootstrap(graphdef, params, tokens, positions, lengths):
    """(values [B, A], bootstrap [B]): the values of `token_values` and, per row, the value
    of the conversation ``tokens[b, :lengths[b]]`` (the state after its last token), which is
    the bootstrap value of a truncated episode; it exists even for a row filling all T columns."""
    model = bind(graphdef, params)
    hidden = model.model(tokens).astype(jnp.float32)
    values = model.value_head(_before(hidden, positions))[..., 0]
    last = jnp.clip(lengths - 1, 0, tokens.shape[1] - 1)
    after = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
    boot = model.value_head(after)[:, 0, 0]
    return values, jnp.where(lengths > 0, boot, 0)


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
    model = bind(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(t + a, dtype=jnp.int32), (n, t + a))
    valid = positions < (prefix_lengths + answer_len)[:, None]
    hidden = model.model(seq, positions, valid)
    weight, axis = model.lm_head()
    prev = jnp.take_along_axis(hidden, (cols - 1)[:, :, None], axis=1)  # predicts each answer id
    logp, _ = logprobs_and_entropy(prev, weight, answer, vocab_axis=axis)
    present = jnp.arange(a)[None] < answer_len[:, None]
    return jnp.sum(jnp.where(present, logp, 0), axis=1) / jnp.maximum(answer_len, 1)


def _trainable_grad(loss_fn):
    """``value_and_grad`` of ``loss_fn(params, ...)`` with respect to what trains: the whole
    state, or for [`Adapted`][train.model.lora.Adapted] parameters the adapters alone (the frozen
    base gets no gradient, so none is computed or held)."""

    def fn(params, *args):
        if isinstance(params, Adapted):
            on_adapters = lambda adapters: loss_fn(params.replace(adapters=adapters), *args)  # noqa: E731
            return jax.value_and_grad(on_adapters, has_aux=True)(params.adapters)
        return jax.value_and_grad(loss_fn, has_aux=True)(params, *args)

    return fn


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), tree)


class UpdateFns:
    """Jitted loss-and-gradient functions and the guarded optimizer step for one preset.

    The optimizer runs in ``opt_dtype`` (its moments are held in it) whatever the parameters'
    dtype: gradients and parameters are cast to it for the update, and the update is added to the
    parameters in float32 before they are cast back (``--param-dtype``/``--opt-dtype``).
    """

    def __init__(
        self,
        models: Models,
        algo: Algorithm,
        actor_tx,
        critic_tx,
        *,
        temperature,
        entropy_coef: float = 0.0,
        opt_dtype: Any = jnp.float32,
    ):
        self.models, self.algo = models, algo
        self.entropy_coef = entropy_coef
        self.actor_tx, self.critic_tx = actor_tx, critic_tx
        self.temperature = temperature
        self.opt_dtype = jnp.dtype(opt_dtype)
        self.actor_grad = jax.jit(_trainable_grad(self._actor_loss))
        self.critic_grad = jax.jit(_trainable_grad(self._critic_loss))
        # parameters and optimizer state are donated: the update writes in place
        self.apply = jax.jit(self._apply, static_argnums=(0,), donate_argnums=(1, 2))
        # micro-batch gradients summed into the accumulator in place (an eager tree.map would
        # hold the old sum, the new one and the micro-batch's gradients at once: one more
        # parameter-sized buffer than the memory plan counts)
        self.accumulate = jax.jit(_add_trees, donate_argnums=(0,))

    def init_fn(self, which, params):
        """The jitted initialiser of ``which``'s optimizer state for ``params`` (arrays or
        ShapeDtypeStructs): its moments placed like the parameters they follow (an fsdp-sharded
        parameter has fsdp-sharded moments: left to itself, XLA replicates a ``zeros_like``),
        its counters replicated over the same devices."""
        tx = self.actor_tx if which == "actor" else self.critic_tx

        def init(params):
            return tx.init(_cast(params, self.opt_dtype))

        shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), params)
        named = [x for x in jax.tree.leaves(shardings) if isinstance(x, NamedSharding)]
        if not named:
            return jax.jit(init)
        replicated = NamedSharding(named[0].mesh, jax.P())
        out = optax.tree_utils.tree_map_params(
            tx,
            lambda _, sharding: sharding,
            jax.eval_shape(init, params),
            shardings,
            transform_non_params=lambda _: replicated,
        )
        return jax.jit(init, out_shardings=out)

    def init(self, which, params):
        """The optimizer state of ``which`` (``actor`` or ``critic``) for ``params``."""
        return self.init_fn(which, params)(params)

    def _actor_loss(self, params, mb: ActionRows, normalizer, token_count):
        logp, ent = token_logprobs(
            self.models.actor, params, mb.tokens, mb.positions, temperature=self.temperature
        )
        loss, metrics = losses.policy_loss(
            logp,
            mb.old_logp,
            mb.advantages,
            mb.loss_mask,
            mb.turn_ids,
            normalizer=normalizer,
            is_weights=mb.is_weights,
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

    def _critic_loss(self, params, mb: ActionRows, normalizer):
        values = token_values(self.models.critic, params, mb.tokens, mb.positions)
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
        grads = _cast(grads, self.opt_dtype)
        updates, new_state = tx.update(grads, opt_state, _cast(params, self.opt_dtype))
        ok = new_state.last_finite
        norm = jnp.where(ok, optax.tree.norm(grads), 0.0)
        new_params = jax.tree.map(
            lambda p, u: (p.astype(jnp.float32) + u.astype(jnp.float32)).astype(p.dtype),
            params,
            updates,
        )
        return new_params, new_state, ok, norm


def loss_fields(algo: Algorithm, *, behaviour: bool = False) -> tuple[str, ...]:
    """The per-token fields the actor and critic losses of ``algo`` read beside tokens, mask and
    turn ids (a fixed structure for jit: the ragged TRACE and GiGPO fields stay out);
    ``behaviour``: the off-policy correction's weights too."""
    names = ["old_logp", "advantages", *(["is_weights"] if behaviour else [])]
    if algo.kl_coef:
        names.append("ref_logp")
    if algo.needs_critic:
        names += ["values", "returns"]
    return tuple(names)


def token_budget_groups(
    lengths: np.ndarray, max_tokens: int, *, multiple: int = 1
) -> list[tuple[np.ndarray, int]]:
    """Rows in micro-batches of at most ``max_tokens`` padded tokens: (row indices, rows to pad
    to) of each.

    Rows are taken longest first; a micro-batch is as wide as
    [`mpo_jax.batch.padded_length`][mpo_jax.batch.padded_length] of its first (longest) row, W, and
    holds up to ``max(1, max_tokens // W)`` rows (rounded down to a multiple of ``multiple``, the
    data-parallel ways, but never below it). Its row count is padded up to a power of two (then to a
    multiple of ``multiple``), never past that cap, so that a run compiles a few shapes per width
    rather than one per row count. A row longer than the budget gets a micro-batch of its own
    (``multiple`` rows)."""
    lengths = np.asarray(lengths)
    order = np.argsort(-lengths, kind="stable")
    out = []
    i = 0
    while i < len(order):
        width = padded_length(int(max(lengths[order[i]], 1)))
        cap = max(multiple, (max(1, max_tokens // width) // multiple) * multiple)
        rows = order[i : i + cap]
        padded = 1 << (len(rows) - 1).bit_length()
        padded = min(-(-padded // multiple) * multiple, cap)
        out.append((rows, max(padded, len(rows))))
        i += len(rows)
    return out


def budget_micro_batches(
    batch: TurnBatch, max_tokens: int, names=(), *, multiple: int = 1
) -> list[tuple[np.ndarray, ActionRows]]:
    """(row indices, their `ActionRows` padded with empty rows) of each micro-batch of
    `token_budget_groups`: what the update and scoring share (``--micro-batch-tokens``)."""
    groups = token_budget_groups(batch.row_lengths(), max_tokens, multiple=multiple)
    return [
        (rows, ActionRows.of(batch.take_rows(rows), names).pad_rows(padded))
        for rows, padded in groups
    ]


def split_micro(batch: TurnBatch, parts: int, names=(), *, max_tokens: int = 0, multiple: int = 1):
    """Splits the rows of a minibatch into micro-batches as `ActionRows`: tokens narrowed
    to the padded length of the micro-batch's longest row (what a loss reads ends at a row's last
    action token), the ``names`` fields compacted to its action tokens. ``parts`` micro-batches of
    equal row counts, or with ``max_tokens`` the groups of `token_budget_groups` (rows of
    similar length together, each micro-batch at most that many padded tokens). The losses are
    sums over micro-batches (normalised by the whole minibatch), so the update is the same
    whichever split is used."""
    if max_tokens:
        for _, micro in budget_micro_batches(batch, max_tokens, names, multiple=multiple):
            yield micro
        return
    for chunk in np.array_split(np.arange(len(batch.tokens)), parts):
        yield ActionRows.of(batch.take_rows(chunk), names)


def _add_trees(acc, grads):
    return jax.tree.map(jnp.add, acc, grads)
