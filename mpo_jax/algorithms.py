"""The named algorithm presets (docs/design.md §3), and one function that computes their credit.

A preset is a frozen [`Algorithm`][mpo_jax.algorithms.Algorithm]: which estimator, its
hyperparameters (the papers' defaults where they give them; ours, marked, where they are silent),
the ratio level and aggregation of the policy loss, and whether a critic is needed.

    >>> from mpo_jax import algorithms
    >>> algo = algorithms.get("mpo", beta=0.3)            # a preset with an override
    >>> out = algorithms.compute_advantages(algo, batch)   # doctest: +SKIP
    >>> loss, metrics = losses.policy_loss(..., **algo.policy_loss_kwargs())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from mpo_jax import advantages as adv
from mpo_jax.batch import TurnBatch
from mpo_jax.losses import AGGREGATIONS, RATIO_LEVELS, kl_penalty
from mpo_jax.segments import (
    Turns,
    broadcast_trajectory_values,
    broadcast_turn_values,
    float_dtype,
    num_turns,
    place_on_turn_ends,
    trajectory_sums,
    turn_structure,
    turn_sums_per_turn,
)

__all__ = [
    "Algorithm",
    "GAE",
    "Multiscale",
    "Critic",
    "Group",
    "Trace",
    "GiGPO",
    "FAMILIES",
    "LEGACY_OVERRIDES",
    "kwargs_of",
    "Credit",
    "PRESETS",
    "get",
    "compute_advantages",
    "register_estimator",
    "ESTIMATOR_REGISTRY",
]


# -- the families' settings: each field is named as the argument it feeds ----------------------


@dataclasses.dataclass(frozen=True)
class GAE:
    """Token and turn GAE ([`token_gae`][mpo_jax.advantages.token_gae], ``turn_gae``): γ = 1 and
    λ = 0.95 are ours, the usual choice for LLM agents."""

    gamma: float = 1.0
    lam: float = 0.95


@dataclasses.dataclass(frozen=True)
class Multiscale:
    """MPO's MAE ([`multiscale_advantages`][mpo_jax.advantages.multiscale_advantages])."""

    gamma_turn: float = 1.0
    lam_turn: float = 0.95
    gamma_token: float = 1.0
    lam_token: float = 0.95
    beta: float = 0.5  # ours: the MPO paper reports β = 0 costs 6.28 points, not its default


@dataclasses.dataclass(frozen=True)
class Critic:
    """The critic's targets (token-GAE returns, [`token_gae`][mpo_jax.advantages.token_gae]'s
    ``gamma``/``lam``) and its loss ([`value_loss`][mpo_jax.losses.value_loss]'s ``clip``)."""

    gamma: float = 1.0
    lam: float = 0.95
    clip: float | None = 0.2


@dataclasses.dataclass(frozen=True)
class Group:
    """Group outcome advantages ([`group_advantages`][mpo_jax.advantages.group_advantages])."""

    baseline: Literal["mean", "leave_one_out", "loo"] = "mean"
    scale: Literal["std", "none"] = "std"
    eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class Trace:
    """TRACE (paper defaults): [`trace_turn_credit`][mpo_jax.advantages.trace_turn_credit]'s
    ``eps``, ``horizon``, ``gamma``, ``normalize`` and
    [`trace_turn_advantages`][mpo_jax.advantages.trace_turn_advantages]'s ``alpha_out``,
    ``alpha_turn``, ``terminal_fill``."""

    eps: float = 0.1
    horizon: int = 3
    gamma: float = 0.8
    normalize: bool = True
    alpha_out: float = 1.0
    alpha_turn: float = 0.2
    terminal_fill: Literal["zero", "last"] = "zero"

    def credit_kwargs(self) -> dict:
        return dict(eps=self.eps, horizon=self.horizon, gamma=self.gamma, normalize=self.normalize)

    def advantage_kwargs(self) -> dict:
        return dict(
            alpha_out=self.alpha_out, alpha_turn=self.alpha_turn, terminal_fill=self.terminal_fill
        )


@dataclasses.dataclass(frozen=True)
class GiGPO:
    """GiGPO (paper defaults; [`gigpo_advantages`][mpo_jax.advantages.gigpo_advantages])."""

    gamma: float = 0.95
    omega: float = 1.0
    scale: Literal["std", "none"] = "std"
    eps: float = 1e-6


FAMILIES: dict[str, type] = {
    "gae": GAE,
    "multiscale": Multiscale,
    "critic": Critic,
    "group": Group,
    "trace": Trace,
    "gigpo": GiGPO,
}


def kwargs_of(config) -> dict:
    """A family's settings as keyword arguments of the function it configures."""
    return dataclasses.asdict(config)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One algorithm: credit assignment plus the settings of its clipped update.

    The credit settings live in one config per estimator family (`FAMILIES`), each field
    named as the argument it feeds (``algo.multiscale.beta`` is ``multiscale_advantages(beta=)``),
    so an estimator passes ``**kwargs_of(algo.multiscale)``. The update's settings (ratio level,
    clip range, aggregation) are [`mpo_jax.losses.policy_loss`][mpo_jax.losses.policy_loss]'s
    arguments. KL to the reference: ``kl_coef`` with estimator ``kl_kind``, as a loss term or, with
    ``kl_in_reward``, subtracted from the rewards before credit assignment.

    Override with [`get`][mpo_jax.algorithms.get]: ``get("mpo", beta=0.3)`` (a name that only one
    family has) or ``get("mpo", **{"critic.lam": 1.0})`` (``family.field``, needed for ``gamma``,
    ``lam``, ``eps``, ``scale``, which several families have).
    """

    name: str
    estimator: str  # a name in ESTIMATOR_REGISTRY
    ratio_level: Literal["token", "turn", "sequence"] = "token"
    ratio_reduce: Literal["sum", "mean"] | None = None
    aggregation: str = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    gae: GAE = GAE()
    multiscale: Multiscale = Multiscale()
    critic: Critic = Critic()
    group: Group = Group()
    trace: Trace = Trace()
    gigpo: GiGPO = GiGPO()
    # KL to the reference policy.
    kl_coef: float = 0.0
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False

    def __post_init__(self):
        checks = [
            ("estimator", self.estimator, tuple(sorted(ESTIMATOR_REGISTRY))),
            ("ratio_level", self.ratio_level, RATIO_LEVELS),
            ("aggregation", self.aggregation, AGGREGATIONS),
            ("group.baseline", self.group.baseline, ("mean", "leave_one_out", "loo")),
            ("group.scale", self.group.scale, ("std", "none")),
            ("gigpo.scale", self.gigpo.scale, ("std", "none")),
            ("trace.terminal_fill", self.trace.terminal_fill, ("zero", "last")),
            ("kl_kind", self.kl_kind, ("k1", "k2", "k3")),
        ]
        for field, value, valid in checks:
            if value not in valid:
                raise ValueError(f"{self.name}: {field}={value!r} is not one of {valid}")
        if self.ratio_reduce not in (None, "sum", "mean"):
            raise ValueError(f"{self.name}: ratio_reduce={self.ratio_reduce!r} is not sum/mean")
        if not (self.clip_low >= 0 and self.clip_high >= 0):
            raise ValueError(f"{self.name}: clip_low and clip_high must be >= 0")
        if not isinstance(self.trace.horizon, int) or self.trace.horizon < 1:
            raise ValueError(f"{self.name}: trace.horizon must be an int >= 1")

    @property
    def needs_critic(self) -> bool:
        return _spec(self).needs_critic

    @property
    def needs_groups(self) -> bool:
        return _spec(self).needs_groups

    @property
    def needs_reference_answers(self) -> bool:
        """TRACE scoring: the reference model's log-prob of the gold answer at each boundary."""
        return _spec(self).needs_reference_answers

    def policy_loss_kwargs(self) -> dict:
        """Keyword arguments for [`mpo_jax.losses.policy_loss`][mpo_jax.losses.policy_loss]."""
        return dict(
            ratio_level=self.ratio_level,
            ratio_reduce=self.ratio_reduce,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            aggregation=self.aggregation,
        )


class Credit(NamedTuple):
    """What [`compute_advantages`][mpo_jax.algorithms.compute_advantages] returns: [B, T] arrays, 0
    off ``loss_mask``.

    ``returns`` are the critic's targets (``None`` for critic-free presets); ``rewards`` are the
    rewards the credit was computed from (after a KL-in-reward or TRACE's dense turn rewards).
    """

    advantages: jax.Array
    returns: jax.Array | None
    rewards: jax.Array


def _require(algo: Algorithm, batch: TurnBatch, *fields: str) -> None:
    for f in fields:
        if getattr(batch, f) is None:
            raise ValueError(f"{algo.name}: batch.{f} is required by this preset but is None")


def _trace_credit(algo: Algorithm, batch: TurnBatch) -> jax.Array:
    """TRACE's per-turn credit [B, M-1] with the preset's settings."""
    _require(algo, batch, "boundary_mask", "answer_logprobs")
    return adv.trace_turn_credit(
        batch.answer_logprobs, batch.boundary_mask, **algo.trace.credit_kwargs()
    )


# -- the estimators, registered by name -----------------------------------------------------------


class CreditInputs(NamedTuple):
    """What every estimator receives beside the preset and the batch: the action mask, the
    rewards to credit (after a KL-in-reward) and their dtype, whether returns are wanted, and the
    turn structure, computed once per batch for every estimator that needs it."""

    mask: jax.Array
    rewards: jax.Array
    dtype: jnp.dtype
    need_returns: bool
    turns: Turns  # the batch's turn structure, once (unused parts are dropped under jit)


EstimatorFn = Callable[[Algorithm, TurnBatch, CreditInputs], Credit]


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator: its function and what it needs from the batch."""

    fn: EstimatorFn
    needs_critic: bool
    needs_groups: bool = False
    needs_reference_answers: bool = False


ESTIMATOR_REGISTRY: dict[str, EstimatorSpec] = {}


def register_estimator(
    name: str,
    *,
    needs_critic: bool,
    needs_groups: bool = False,
    needs_reference_answers: bool = False,
):
    """Registers ``fn(algo, batch, inputs) -> Credit`` as estimator ``name`` (a decorator).

    Adding an estimator is this decorator on one function and a preset that names it; no
    dispatch code changes.
    """

    def add(fn: EstimatorFn) -> EstimatorFn:
        if name in ESTIMATOR_REGISTRY:
            raise ValueError(f"estimator: {name!r} is already registered")
        ESTIMATOR_REGISTRY[name] = EstimatorSpec(
            fn, needs_critic, needs_groups, needs_reference_answers
        )
        return fn

    return add


def _bootstrap(batch: TurnBatch):
    if batch.bootstrap_values is None:
        return None
    return jnp.where(jnp.asarray(batch.truncated, bool), batch.bootstrap_values, 0)


def _critic_credit(algo: Algorithm, batch: TurnBatch, inputs: CreditInputs, advantages_fn):
    """The critic family's common part: the critic's targets (PPO's token-GAE returns with
    ``algo.critic``'s γ and λ, whatever the actor's credit) and the actor's advantages."""
    _require(algo, batch, "values")
    boot = _bootstrap(batch)
    returns = None
    if inputs.need_returns:
        _, returns = adv.token_gae(
            inputs.rewards,
            batch.values,
            inputs.mask,
            gamma=algo.critic.gamma,
            lam=algo.critic.lam,
            bootstrap_value=boot,
        )
    return Credit(advantages_fn(inputs.rewards, boot), returns, inputs.rewards)


@register_estimator("token_gae", needs_critic=True)
def _token_gae(algo, batch, inputs):
    def advantages(rewards, boot):
        a, _ = adv.token_gae(
            rewards, batch.values, inputs.mask, bootstrap_value=boot, **kwargs_of(algo.gae)
        )
        return a

    return _critic_credit(algo, batch, inputs, advantages)


@register_estimator("turn_gae", needs_critic=True)
def _turn_gae(algo, batch, inputs):
    def advantages(rewards, boot):
        a, _ = adv.turn_gae(
            rewards,
            batch.values,
            inputs.mask,
            batch.turn_ids,
            bootstrap_value=boot,
            turns=inputs.turns,
            **kwargs_of(algo.gae),
        )
        return a

    return _critic_credit(algo, batch, inputs, advantages)


def _multiscale(algo, batch, inputs):
    def advantages(rewards, boot):
        return adv.multiscale_advantages(
            rewards,
            batch.values,
            inputs.mask,
            batch.turn_ids,
            bootstrap_value=boot,
            turns=inputs.turns,
            **kwargs_of(algo.multiscale),
        )

    return _critic_credit(algo, batch, inputs, advantages)


register_estimator("multiscale", needs_critic=True)(_multiscale)


@register_estimator("mpo_trace", needs_critic=True, needs_reference_answers=True)
def _mpo_trace(algo, batch, inputs):
    # TRACE's turn credit as dense rewards on each turn's last token, then MAE.
    credit = _trace_credit(algo, batch)
    turn_rewards = place_on_turn_ends(credit, inputs.mask, batch.turn_ids, turns=inputs.turns)
    rewards = inputs.rewards + algo.trace.alpha_turn * turn_rewards.astype(inputs.dtype)
    return _multiscale(algo, batch, inputs._replace(rewards=rewards))


def _outcome(algo, batch, inputs):
    return adv.group_advantages(
        trajectory_sums(inputs.rewards, inputs.mask),
        batch.group_ids,
        **kwargs_of(algo.group),
    )


@register_estimator("group", needs_critic=False, needs_groups=True)
def _group(algo, batch, inputs):
    outcome = _outcome(algo, batch, inputs)
    return Credit(broadcast_trajectory_values(outcome, inputs.mask), None, inputs.rewards)


@register_estimator("gigpo", needs_critic=False, needs_groups=True)
def _gigpo(algo, batch, inputs):
    _require(algo, batch, "step_keys")
    keys = jnp.asarray(batch.step_keys)
    k = keys.shape[-1]
    step_rewards = turn_sums_per_turn(inputs.rewards, inputs.mask, batch.turn_ids, k)
    step_mask = jnp.arange(k)[None, :] < num_turns(inputs.mask, batch.turn_ids)[:, None]
    per_turn = adv.gigpo_advantages(
        step_rewards,
        keys,
        step_mask,
        batch.group_ids,
        **kwargs_of(algo.gigpo),
    )
    advantages = broadcast_turn_values(per_turn, inputs.mask, batch.turn_ids)
    return Credit(advantages, None, inputs.rewards)


@register_estimator("trace", needs_critic=False, needs_groups=True, needs_reference_answers=True)
def _trace(algo, batch, inputs):
    advantages = adv.trace_turn_advantages(
        _outcome(algo, batch, inputs),
        _trace_credit(algo, batch),
        batch.boundary_mask,
        inputs.mask,
        batch.turn_ids,
        **algo.trace.advantage_kwargs(),
    )
    return Credit(advantages, None, inputs.rewards)


def compute_advantages(
    algo: Algorithm, batch: TurnBatch, *, need_returns: bool | None = None
) -> Credit:
    """Advantages (and the critic's targets) of ``batch`` under preset ``algo``: the registered
    estimator ``algo.estimator`` (`ESTIMATOR_REGISTRY`).

    Critic presets read ``batch.values`` (and ``bootstrap_values`` for truncated rows); group
    presets read ``group_ids``; GiGPO reads ``step_keys``; TRACE presets read ``boundary_mask``
    and ``answer_logprobs``; a KL-in-reward reads ``old_logp`` and ``ref_logp``.

    Args:
      need_returns: ask for critic targets; ``True`` on a critic-free preset is an error.
        Defaults to ``algo.needs_critic``.
    """
    spec = _spec(algo)
    if need_returns is None:
        need_returns = spec.needs_critic
    if need_returns and not spec.needs_critic:
        critics = sorted(n for n, p in PRESETS.items() if p.needs_critic)
        raise ValueError(
            f"{algo.name}: a critic-free preset has no critic targets (returns); "
            f"critic presets are {critics}"
        )
    dtype = float_dtype(batch.rewards, batch.values)
    mask = jnp.asarray(batch.loss_mask, bool)
    rewards = jnp.where(mask, jnp.asarray(batch.rewards, dtype), 0)
    if algo.kl_in_reward and algo.kl_coef:
        _require(algo, batch, "old_logp", "ref_logp")
        kl = kl_penalty(batch.old_logp, batch.ref_logp, mask, kind=algo.kl_kind)
        rewards = rewards - algo.kl_coef * kl.astype(dtype)
    turns = turn_structure(mask, batch.turn_ids)
    return spec.fn(algo, batch, CreditInputs(mask, rewards, dtype, bool(need_returns), turns))


def _spec(algo: Algorithm) -> EstimatorSpec:
    if algo.estimator not in ESTIMATOR_REGISTRY:
        raise ValueError(
            f"{algo.name}: estimator {algo.estimator!r} is not registered; "
            f"registered: {sorted(ESTIMATOR_REGISTRY)}"
        )
    return ESTIMATOR_REGISTRY[algo.estimator]


# -- the presets (after the estimators they name) ----------------------------------------------

PRESETS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("ppo", "token_gae"),
        Algorithm("turn_ppo", "turn_gae"),
        Algorithm("mpo", "multiscale", ratio_level="turn"),
        # MPO with the turn ratio length-normalised (the geometric mean of GSPO and ST-PPO): the
        # paper's product ratio over a turn of n tokens moves n times as fast as a token's.
        Algorithm("mpo_turn_mean", "multiscale", ratio_level="turn", ratio_reduce="mean"),
        Algorithm("grpo", "group", aggregation="seq_mean_token_mean"),
        Algorithm("dr_grpo", "group", group=Group(scale="none"), aggregation="seq_mean_token_sum"),
        Algorithm("rloo", "group", group=Group(baseline="leave_one_out", scale="none")),
        # GSPO: sequence ratio, length-normalised, with its much tighter clip range.
        Algorithm(
            "gspo",
            "group",
            ratio_level="sequence",
            ratio_reduce="mean",
            clip_low=3e-4,
            clip_high=4e-4,
            aggregation="seq_mean_token_mean",
        ),
        Algorithm("gigpo", "gigpo"),
        Algorithm("trace", "trace"),
        Algorithm("mpo_trace", "mpo_trace", ratio_level="turn"),
    )
}


# Flat names of the settings before the families existed, mapped to every setting they fed, so a
# saved config.json or an old --algo-set keeps its meaning.
LEGACY_OVERRIDES: dict[str, tuple[str, ...]] = {
    "gamma": ("gae.gamma", "multiscale.gamma_turn", "critic.gamma"),
    "lam": ("gae.lam", "multiscale.lam_turn"),
    "scale": ("group.scale", "gigpo.scale"),
    "group_eps": ("group.eps", "gigpo.eps"),
    "critic_lam": ("critic.lam",),
    "value_clip": ("critic.clip",),
    "trace_eps": ("trace.eps",),
    "trace_horizon": ("trace.horizon",),
    "trace_gamma": ("trace.gamma",),
    "trace_normalize": ("trace.normalize",),
    "gigpo_gamma": ("gigpo.gamma",),
    "gigpo_omega": ("gigpo.omega",),
}


def _setting_paths() -> dict[str, tuple[str, ...]]:
    """Every name an override may use -> the settings it sets (``field`` or ``family.field``)."""
    paths: dict[str, list[str]] = {}
    for f in dataclasses.fields(Algorithm):
        if f.name in FAMILIES:
            for g in dataclasses.fields(FAMILIES[f.name]):
                path = f"{f.name}.{g.name}"
                paths[path] = [path]
                paths.setdefault(g.name, []).append(path)
        paths.setdefault(f.name, []).append(f.name)
    out = {k: tuple(v) for k, v in paths.items()}
    out.update(LEGACY_OVERRIDES)
    return out


def get(name: str, **overrides) -> Algorithm:
    """The preset ``name`` with ``overrides`` applied; unknown names list the valid ones.

    A key is a top-level field (``clip_high``), ``family.field`` (``critic.lam``), a field name
    only one family has (``beta`` = ``multiscale.beta``) or a name of `LEGACY_OVERRIDES`.
    A name several families share (``eps``) must be written ``family.field``.
    """
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    paths = _setting_paths()
    top: dict[str, object] = {}
    families: dict[str, dict[str, object]] = {}
    for key, value in overrides.items():
        if key not in paths:
            valid = sorted(k for k in paths if "." in k or len(paths[k]) == 1)
            raise ValueError(f"{name}: unknown setting {key!r}; valid: {valid}")
        if len(paths[key]) > 1 and key not in LEGACY_OVERRIDES:
            raise ValueError(
                f"{name}: setting {key!r} is ambiguous; write one of {list(paths[key])}"
            )
        for path in paths[key]:
            family, _, field = path.rpartition(".")
            if family:
                families.setdefault(family, {})[field] = value
            else:
                top[field] = value
    algo = dataclasses.replace(PRESETS[name], **top)
    changed = {f: dataclasses.replace(getattr(algo, f), **kv) for f, kv in families.items()}
    return dataclasses.replace(algo, **changed)
