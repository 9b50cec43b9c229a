"""MPO inside verl: our advantage estimators and turn-level policy loss in verl's registries.

    import mpo_jax.integrations.verl   # or nothing: verl loads it through its plugin entry point

    algorithm.adv_estimator=mpo                              # MAE: turn GAE + centred token trace
    actor_rollout_ref.actor.policy_loss.loss_mode=mpo        # the turn-level importance ratio
    critic.enable=True                                       # mpo and turn_gae need the values
    +algorithm.mpo.beta=0.5 +algorithm.mpo.gamma_turn=1.0 +algorithm.mpo.lam_turn=0.95
    +algorithm.mpo.gamma_token=1.0 +algorithm.mpo.lam_token=0.95

Registered on import (verl 0.9.1's ``register_adv_est`` and ``register_policy_loss``):

- estimators ``mpo``
([`mpo_jax.advantages.multiscale_advantages`][mpo_jax.advantages.multiscale_advantages]),
``turn_gae``
  ([`mpo_jax.advantages.turn_gae`][mpo_jax.advantages.turn_gae]) and ``gigpo``
  ([`mpo_jax.advantages.gigpo_advantages`][mpo_jax.advantages.gigpo_advantages], which verl 0.9.1
  lacks). Their keys live under ``algorithm.mpo`` (defaults: the ``mpo`` preset's,
  [`mpo_jax.algorithms.Multiscale`][mpo_jax.algorithms.Multiscale]); the critic's targets
  (``returns``) are PPO's token-GAE returns with verl's own ``algorithm.gamma`` and
  ``algorithm.lam``, as verl's ``gae`` computes them. Advantages are not whitened (verl's ``gae``
  whitens; MAE keeps every turn's mean at its turn GAE, which a whitening would shift).
- policy losses ``mpo``
([`mpo_jax.losses.policy_loss_per_token`][mpo_jax.losses.policy_loss_per_token] with
``ratio_level="turn"``:
  the turn's summed log-ratio with the stop-gradient, clipped by ``clip_ratio_low/high``, the
  dual clip at ``clip_ratio_c`` as verl's ``vanilla``; aggregated by verl's own ``agg_loss`` over
  ``loss_agg_mode``) and ``mpo_turn_mean`` (the same, each token's loss divided by its turn's
  length and summed per row, rows averaged: every turn of a row weighs the same).

**Turns** are the maximal runs of sampled tokens in ``response_mask`` (verl's multi-turn agent
loop sets it to 0 on tool replies), or an explicit ``turn_ids`` field ([B, R], -1 off turns) when
the batch carries one. A reward verl placed on a tool token (a row cut after a tool reply) is
moved to the last sampled token before it: verl's ``gae`` would drop it.

**Values.** verl's ``compute_advantage`` hands a registered estimator ``token_level_rewards``,
``response_mask``, ``index`` and its config, but the critic's ``values`` only to its own ``gae``.
This module therefore wraps ``compute_advantage`` (in ``verl.trainer.ppo.ray_trainer`` and the v1
trainer's ``verl.trainer.ppo.v1.utils``) so that for the estimators named here it also passes
``values``, ``turn_ids`` and ``step_keys`` from the batch; every other estimator goes to verl's
function unchanged.

Tensors cross to JAX by DLPack (no copy on the CPU, nor on CUDA when JAX has the GPU); the jitted
functions are compiled once per padded shape bucket (rows to a multiple of 8, columns to
[`mpo_jax.batch.padded_length`][mpo_jax.batch.padded_length]).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo import ray_trainer as _ray_trainer

from mpo_jax import advantages as adv
from mpo_jax.algorithms import Multiscale
from mpo_jax.batch import padded_length
from mpo_jax.losses import aggregate, policy_loss_per_token
from mpo_jax.segments import turn_end_mask, turn_sum

__all__ = [
    "ESTIMATORS",
    "LOSSES",
    "MPOSettings",
    "settings_from",
    "turn_ids_from_mask",
    "mpo_advantage",
    "turn_gae_advantage",
    "gigpo_advantage",
    "mpo_policy_loss",
    "mpo_turn_mean_policy_loss",
    "compute_advantage",
]

ESTIMATORS = ("mpo", "turn_gae", "gigpo")
LOSSES = ("mpo", "mpo_turn_mean")
CONFIG_KEY = "algorithm.mpo"
ROW_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class MPOSettings:
    """``algorithm.mpo.*``: MAE's turn and token (γ, λ) and β (defaults: the ``mpo`` preset's),
    and GiGPO's step discount and weight."""

    beta: float = Multiscale.beta
    gamma_turn: float = Multiscale.gamma_turn
    lam_turn: float = Multiscale.lam_turn
    gamma_token: float = Multiscale.gamma_token
    lam_token: float = Multiscale.lam_token
    gigpo_gamma: float = 0.95
    gigpo_omega: float = 1.0


def settings_from(config: Any) -> tuple[MPOSettings, float, float]:
    """(``algorithm.mpo`` settings, verl's ``algorithm.gamma``, ``algorithm.lam``) from verl's
    algorithm config (an ``AlgoConfig`` or a ``DictConfig``); unknown keys are refused."""
    if config is None:
        return MPOSettings(), 1.0, 1.0
    given = config.get("mpo", None) or {}
    given = dict(given.items()) if hasattr(given, "items") else {}
    known = {f.name for f in dataclasses.fields(MPOSettings)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{CONFIG_KEY}: unknown key(s) {unknown}; known: {sorted(known)}")
    settings = MPOSettings(**{k: float(v) for k, v in given.items()})
    return settings, float(config.get("gamma", 1.0)), float(config.get("lam", 1.0))


# -- crossing between torch and JAX ---------------------------------------------------------------


def _jax_on(device: torch.device) -> bool:
    """Whether JAX can take a tensor on ``device`` as it is (a CUDA tensor needs JAX's GPU)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and jax.default_backend() == "gpu"


def _to_jax(t: torch.Tensor) -> jax.Array:
    """``t`` as a JAX array: DLPack (no copy) where JAX holds the device, else via the host."""
    t = t.detach()
    if not _jax_on(t.device):
        t = t.cpu()
    return jax.dlpack.from_dlpack(t.contiguous())


def _to_torch(a: jax.Array, like: torch.Tensor) -> torch.Tensor:
    out = torch.from_dlpack(a)
    return out.to(device=like.device, dtype=like.dtype)


def _bucket(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // ROW_BUCKET) * ROW_BUCKET, padded_length(cols)


def _pad(x: jax.Array, shape: tuple[int, int], fill=0) -> jax.Array:
    return jnp.pad(
        x, [(0, shape[0] - x.shape[0]), (0, shape[1] - x.shape[1])], constant_values=fill
    )


# -- the batch as our layout ----------------------------------------------------------------------


def turn_ids_from_mask(response_mask: jax.Array) -> jax.Array:
    """Turns as the maximal runs of ``response_mask``: ``0..K-1`` on its tokens, -1 elsewhere."""
    mask = jnp.asarray(response_mask, bool)
    before = jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))
    ids = jnp.cumsum(mask & ~before, axis=1) - 1
    return jnp.where(mask, ids, -1).astype(jnp.int32)


def _onto_sampled_tokens(rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """Each reward on an unsampled token moved to the last sampled token at or before it."""
    t = jnp.arange(mask.shape[1])
    last = jax.lax.cummax(jnp.where(mask, t, -1), axis=1)
    stray = jnp.where(mask, 0, rewards)
    rows = jnp.arange(mask.shape[0])[:, None]
    moved = jnp.zeros_like(rewards).at[rows, jnp.maximum(last, 0)].add(stray)
    return jnp.where(mask, rewards, 0) + jnp.where(mask, moved, 0)


def _check(name: str, fields: dict[str, torch.Tensor | None], response_mask: torch.Tensor) -> None:
    """Shapes equal to ``response_mask``'s, rewards and values finite, no reward stranded before
    the first sampled token: a ``ValueError`` naming the estimator and verl's field."""
    for key, value in fields.items():
        if value is None:
            continue
        if tuple(value.shape) != tuple(response_mask.shape):
            raise ValueError(
                f"algorithm.adv_estimator={name}: {key} has shape {tuple(value.shape)}, "
                f"response_mask {tuple(response_mask.shape)}; they must be equal"
            )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            rows = torch.nonzero(~torch.isfinite(value).all(dim=-1)).flatten().tolist()
            raise ValueError(
                f"algorithm.adv_estimator={name}: {key} holds NaN or inf in row(s) {rows[:8]}; "
                "the advantages would be NaN"
            )
    mask = response_mask != 0
    rewards = fields["token_level_rewards"]
    before_first = (torch.cumsum(mask.int(), dim=1) == 0) & (rewards != 0)
    if bool(before_first.any()):
        rows = torch.nonzero(before_first.any(dim=1)).flatten().tolist()
        raise ValueError(
            f"algorithm.adv_estimator={name}: token_level_rewards has a reward before the first "
            f"sampled token (response_mask) in row(s) {rows[:8]}; no turn can take its credit"
        )


def _layout(rewards, mask, turn_ids, shape):
    """Padded JAX arrays of our layout (docs/design.md §2)."""
    m = _pad(_to_jax(mask != 0), shape, False)
    r = _pad(_to_jax(rewards), shape)
    tid = turn_ids_from_mask(m) if turn_ids is None else _pad(_to_jax(turn_ids.int()), shape, -1)
    return r, m, tid


@functools.partial(jax.jit, static_argnames=("beta_zero",))
def _multiscale(r, v, m, tid, s, gamma, lam, *, beta_zero):
    r = _onto_sampled_tokens(r, m)
    beta = 0.0 if beta_zero else s["beta"]
    a = adv.multiscale_advantages(
        r, v, m, tid, gamma_turn=s["gamma_turn"], lam_turn=s["lam_turn"],
        gamma_token=s["gamma_token"], lam_token=s["lam_token"], beta=beta, method="associative",
    )  # fmt: skip
    _, returns = adv.token_gae(r, v, m, gamma=gamma, lam=lam, method="associative")
    return a, returns


def _values_needed(name: str, values: torch.Tensor | None) -> torch.Tensor:
    if values is None:
        raise ValueError(
            f"algorithm.adv_estimator={name} needs the critic's values (data.batch['values']): "
            "set critic.enable=True, and import mpo_jax.integrations.verl before the trainer "
            "computes advantages (its compute_advantage passes them to this estimator)"
        )
    return values


def _turn_credit(name, token_level_rewards, response_mask, values, config, turn_ids, beta_zero):
    values = _values_needed(name, values)
    _check(name, {"token_level_rewards": token_level_rewards, "values": values}, response_mask)
    settings, gamma, lam = settings_from(config)
    shape = _bucket(*response_mask.shape)
    r, m, tid = _layout(token_level_rewards, response_mask, turn_ids, shape)
    v = _pad(_to_jax(values.to(token_level_rewards.dtype)), shape)
    s = {k: jnp.asarray(x, r.dtype) for k, x in dataclasses.asdict(settings).items()}
    a, returns = _multiscale(r, v, m, tid, s, gamma, lam, beta_zero=beta_zero)
    rows, cols = response_mask.shape
    return (
        _to_torch(a[:rows, :cols], token_level_rewards),
        _to_torch(returns[:rows, :cols], token_level_rewards),
    )


@core_algos.register_adv_est("mpo")
def mpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    index: Any = None,
    values: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MAE ([`mpo_jax.advantages.multiscale_advantages`][mpo_jax.advantages.multiscale_advantages])
    on verl's batch: (advantages, returns), each [B, R], 0 off ``response_mask``; returns are
    token-GAE's with verl's ``algorithm.gamma``/``lam``."""
    return _turn_credit(
        "mpo", token_level_rewards, response_mask, values, config, turn_ids, beta_zero=False
    )


@core_algos.register_adv_est("turn_gae")
def turn_gae_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    index: Any = None,
    values: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn GAE alone ([`mpo_jax.advantages.turn_gae`][mpo_jax.advantages.turn_gae]: MAE at β = 0)
    on verl's batch."""
    return _turn_credit(
        "turn_gae", token_level_rewards, response_mask, values, config, turn_ids, beta_zero=True
    )


@jax.jit
def _gigpo(r, m, tid, keys, groups, gamma, omega):
    r = _onto_sampled_tokens(r, m)
    k = keys.shape[1]
    ends = turn_end_mask(m, tid)  # the last action token of each turn
    per_turn = jnp.where(ends, turn_sum(r, m, tid), 0)
    onehot = (tid[:, :, None] == jnp.arange(k)[None, None, :]) & ends[:, :, None]
    step_rewards = jnp.einsum("btk,bt->bk", onehot.astype(r.dtype), per_turn)
    step_mask = keys >= 0
    a = adv.gigpo_advantages(step_rewards, keys, step_mask, groups, gamma=gamma, omega=omega)
    return jnp.where(m, jnp.take_along_axis(a, jnp.maximum(tid, 0), axis=1), 0)


@core_algos.register_adv_est("gigpo")
def gigpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    index: Any = None,
    step_keys: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO ([`mpo_jax.advantages.gigpo_advantages`][mpo_jax.advantages.gigpo_advantages]) on
    verl's batch: episode groups by ``index`` (verl's ``uid``) plus step groups of turns whose
    ``step_keys`` ([B, K] int, an id of the environment state each turn acted in, -1 where no turn;
    the batch must carry it) are equal. (advantages, advantages): critic-free, as verl's
    ``grpo``."""
    if step_keys is None:
        raise ValueError(
            "algorithm.adv_estimator=gigpo needs data.batch['step_keys'] ([B, K] int: an id of "
            "the environment state each turn acted in, -1 where no turn)"
        )
    if index is None:
        raise ValueError("algorithm.adv_estimator=gigpo needs the groups (non_tensor_batch 'uid')")
    _check("gigpo", {"token_level_rewards": token_level_rewards}, response_mask)
    settings, _, _ = settings_from(config)
    shape = _bucket(*response_mask.shape)
    r, m, tid = _layout(token_level_rewards, response_mask, turn_ids, shape)
    groups = np.unique(np.asarray(index), return_inverse=True)[1].astype(np.int32)
    groups = np.pad(groups, (0, shape[0] - len(groups)), constant_values=-1)
    keys = _to_jax(step_keys.long())
    keys = jnp.pad(keys, [(0, shape[0] - keys.shape[0]), (0, 0)], constant_values=-1)
    a = _gigpo(r, m, tid, keys, jnp.asarray(groups), settings.gigpo_gamma, settings.gigpo_omega)
    rows, cols = response_mask.shape
    out = _to_torch(a[:rows, :cols], token_level_rewards)
    return out, out


# -- verl's compute_advantage, with the fields our estimators read -------------------------------

_VERL_COMPUTE_ADVANTAGE = _ray_trainer.compute_advantage


def compute_advantage(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1,
                      norm_adv_by_std_in_grpo=True, config=None):  # fmt: skip
    """verl's ``compute_advantage`` (same arguments), passing the estimators of this module what
    verl passes only to its own ``gae``: ``values``, and ``turn_ids``/``step_keys`` when the batch
    carries them. Any other estimator: verl's function, unchanged."""
    name = getattr(adv_estimator, "value", adv_estimator)
    if name not in ESTIMATORS:
        return _VERL_COMPUTE_ADVANTAGE(
            data, adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config,
        )  # fmt: skip
    batch = data.batch
    if "response_mask" not in batch.keys():
        batch["response_mask"] = _ray_trainer.compute_response_mask(data)
    extra = {k: batch[k] for k in ("values", "turn_ids", "step_keys") if k in batch.keys()}
    if "step_keys" not in extra and "step_keys" in data.non_tensor_batch:
        extra["step_keys"] = torch.as_tensor(np.stack(data.non_tensor_batch["step_keys"]))
    fn = core_algos.get_adv_estimator_fn(name)
    advantages, returns = fn(
        token_level_rewards=batch["token_level_rewards"],
        response_mask=batch["response_mask"],
        config=config,
        index=data.non_tensor_batch.get("uid"),
        **extra,
    )
    batch["advantages"] = advantages
    batch["returns"] = returns
    return data


def _install_compute_advantage() -> None:
    """Our [`compute_advantage`][mpo_jax.integrations.verl.compute_advantage] where verl's trainers
    look it up."""
    _ray_trainer.compute_advantage = compute_advantage
    try:
        from verl.trainer.ppo.v1 import utils as v1_utils
    except Exception:  # the v1 trainer's own imports (TransferQueue) may be absent
        return
    v1_utils.compute_advantage = compute_advantage


_install_compute_advantage()


# -- the policy losses ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("clip", "turn_mean"))
def _surrogate(logp, old, advantages, mask, tid, weights, *, clip, turn_mean):
    """(ℓ_t, ∂ℓ_t/∂logp_t, clip_frac, turn_clip_frac, approx_kl) of the turn-ratio surrogate
    (``clip``: ε_low, ε_high and the dual clip c; ``turn_mean``: each ℓ_t over its turn's
    length)."""

    def total(lp):
        out, parts = policy_loss_per_token(
            lp, old, advantages, mask, tid, ratio_level="turn",
            clip_low=clip[0], clip_high=clip[1], dual_clip=clip[2], is_weights=weights,
        )  # fmt: skip
        if turn_mean:
            out = out / jnp.maximum(turn_sum(mask.astype(out.dtype), mask, tid), 1)
        return jnp.sum(out), (out, parts["is_clipped"])

    (_, (out, is_clipped)), grad = jax.value_and_grad(total, has_aux=True)(logp)
    n = jnp.maximum(jnp.sum(mask), 1)
    token_lr = jnp.where(mask, logp - old, 0)
    approx_kl = jnp.sum(jnp.where(mask, jnp.expm1(token_lr) - token_lr, 0)) / n
    clipped_share, turns = aggregate(is_clipped.astype(out.dtype), mask, tid,
                                     mode="turn_mean_token_mean")  # fmt: skip
    return out, grad, jnp.sum(is_clipped) / n, clipped_share / jnp.maximum(turns, 1), approx_kl


class _WithGradient(torch.autograd.Function):
    """``values`` whose gradient with respect to ``log_prob`` is ``grad`` times the incoming one
    (each ℓ_t depends on its own log-prob only:
    [`mpo_jax.losses.policy_loss_per_token`][mpo_jax.losses.policy_loss_per_token])."""

    @staticmethod
    def forward(ctx, log_prob, values, grad):
        ctx.save_for_backward(grad)
        return values.clone()

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad_output * grad, None, None


def _turn_surrogate(log_prob, old_log_prob, advantages, response_mask, weights, clip, turn_mean):
    """ℓ_t as a torch tensor differentiable in ``log_prob``, and the step's figures."""
    rows, cols = response_mask.shape
    shape = _bucket(rows, cols)
    m = _pad(_to_jax(response_mask != 0), shape, False)
    like = log_prob
    lp = _pad(_to_jax(log_prob), shape)
    old = _pad(_to_jax(old_log_prob.to(like.dtype)), shape)
    a = _pad(_to_jax(advantages.to(like.dtype)), shape)
    w = None if weights is None else _pad(_to_jax(weights.to(like.dtype)), shape)
    out, grad, clipped, turn_clipped, kl = _surrogate(
        lp, old, a, m, turn_ids_from_mask(m), w, clip=clip, turn_mean=turn_mean
    )
    per_token = _WithGradient.apply(
        log_prob, _to_torch(out[:rows, :cols], like), _to_torch(grad[:rows, :cols], like)
    )
    figures = {
        "actor/pg_clipfrac": float(clipped),
        "actor/pg_turn_clipfrac": float(turn_clipped),
        "actor/ppo_kl": float(kl),
    }
    return per_token, figures


def _clip(config) -> tuple[float, float, float]:
    if config is None:
        raise ValueError("actor_rollout_ref.actor.policy_loss.loss_mode=mpo needs the actor config")
    eps = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else eps
    high = config.clip_ratio_high if config.clip_ratio_high is not None else eps
    dual = config.get("clip_ratio_c", 3.0)
    if not dual > 1:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c: must be > 1, got {dual}")
    return float(low), float(high), float(dual)


def _loss(name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
          rollout_is_weights, turn_mean):  # fmt: skip
    for key, value in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        if tuple(value.shape) != tuple(log_prob.shape):
            raise ValueError(
                f"actor_rollout_ref.actor.policy_loss.loss_mode={name}: {key} has shape "
                f"{tuple(value.shape)}, log_prob {tuple(log_prob.shape)}"
            )
    per_token, figures = _turn_surrogate(
        log_prob, old_log_prob, advantages, response_mask, rollout_is_weights, _clip(config),
        turn_mean,
    )  # fmt: skip
    info = dict(getattr(config, "global_batch_info", None) or {})
    mode = "seq-mean-token-sum" if turn_mean else loss_agg_mode
    return core_algos.agg_loss(per_token, response_mask, mode, **info), figures


@core_algos.register_policy_loss("mpo")
def mpo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """MPO's turn-ratio clipped surrogate
    ([`mpo_jax.losses.policy_loss_per_token`][mpo_jax.losses.policy_loss_per_token],
    ``ratio_level="turn"``) aggregated by verl's ``agg_loss`` over ``loss_agg_mode``."""
    return _loss("mpo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights, turn_mean=False)  # fmt: skip


@core_algos.register_policy_loss("mpo_turn_mean")
def mpo_turn_mean_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The ``mpo`` surrogate with every turn weighing the same: ``Σ_rows Σ_k mean_{t∈S_k} ℓ_t``
    over the non-empty rows (verl's ``seq-mean-token-sum`` of the turn-normalised losses, so its
    data-parallel normalisation holds; ``loss_agg_mode`` is not used)."""
    return _loss("mpo_turn_mean", old_log_prob, log_prob, advantages, response_mask,
                 loss_agg_mode, config, rollout_is_weights, turn_mean=True)  # fmt: skip
