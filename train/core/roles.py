"""The run's three roles over their weights: full copies, or one frozen base with adapters.

A run has an actor (the policy it trains and samples), a critic (for critic presets) and a
reference (the initial policy, for a KL term, ``ref_kl`` and TRACE's turn credit). How their
weights are held is this module's one job:

* **full fine-tuning** (``--lora-rank 0``): the actor's and critic's states are trained whole;
  the critic's trunk starts as a copy of the actor's; the reference is a copy of the initial
  actor, kept only where something reads it.
* **LoRA** (``--lora-rank R``): one frozen base. The actor is the base plus the actor's adapters,
  the critic the base's trunk (the same arrays) plus its own adapters and a value head trained in
  full, the reference the base under the unadapted model's graph: no second or third copy of the
  base. The sampler gets merged weights, ``W + (α / r) A B``
  ([`train.model.lora.merge_weights`][train.model.lora.merge_weights]), once per published version
  (measured faster than applying the adapters in its projections: benchmarks/lora_generation.py);
  inference servers get the adapters alone where they load them, else the same merge
  ([`train.engine.weight_sync.WeightPush`][train.engine.weight_sync.WeightPush]).

The trainer's state holds what trains (`Roles.trainable`);
[`Roles.params`][train.core.roles.Roles.params] gives what a scoring or loss function reads, and
[`Roles.sampling`][train.core.roles.Roles.sampling] what generation reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from train.core.build import (
    check_base,
    initial_critic,
    lora_config,
    model_source,
    trainable_like,
)
from train.core.checkpoint import Checkpoints
from train.core.config import TrainConfig
from train.model.lora import (
    Adapted,
    fingerprint,
    init_trainable,
    load_peft,
    lora_scale,
    merge_weights,
)
from train.model.qwen3 import Qwen3ForCausalLM, Qwen3ValueModel

__all__ = ["Roles", "build_roles", "check_resumed_base"]


@dataclasses.dataclass
class Roles:
    """Graph definitions and frozen weights of a run's roles.

    Attributes:
      actor_def, critic_def: the graphs the losses and scoring run (adapted ones for LoRA).
      sample_def: the graph generation runs (the unadapted model for LoRA).
      ref_def, ref_params: the reference's graph and weights (None where nothing reads it).
      frozen: per trained role, the frozen weights beside its trainable ones (LoRA only).
      trainable: the initial trainable state of each trained role (``actor``, ``critic``).
      base: for LoRA, the base's path and fingerprint (a checkpoint records them).
    """

    actor_def: Any
    critic_def: Any
    sample_def: Any
    ref_def: Any
    ref_params: Any
    trainable: dict[str, Any]
    frozen: dict[str, Any] = dataclasses.field(default_factory=dict)
    base: dict[str, str] | None = None
    scale: float = 1.0
    adapted_cfg: Any = None  # LoRA: the adapted model's config (rank, alpha, targets)

    @property
    def lora(self) -> bool:
        return self.base is not None

    def params(self, which: str, trainable):
        """What ``which``'s scoring and loss functions read: its trainable state, beside its
        frozen base for LoRA ([`Adapted`][train.model.lora.Adapted])."""
        return Adapted(self.frozen[which], trainable) if self.lora else trainable

    def sampling(self, actor_trainable):
        """The weights generation reads for this actor (merged for LoRA)."""
        if not self.lora:
            return actor_trainable
        return merge_weights(self.frozen["actor"], actor_trainable, self.scale)

    def pushed(self, actor_trainable) -> Adapted:
        """What a LoRA run hands its servers' push: the base and the actor's adapters apart."""
        return Adapted(self.frozen["actor"], actor_trainable)


def build_roles(
    cfg: TrainConfig,
    actor: Qwen3ForCausalLM,
    *,
    needs_critic: bool,
    needs_reference: bool,
    place: Callable[[Any], Any],
) -> Roles:
    """The roles of ``cfg``'s run around ``actor`` (the initial policy, already placed):
    ``place`` puts a new state on the run's devices. Raises ``ValueError`` for LoRA targets the
    model does not have, or a PEFT ``--init-from`` folder made for another base."""
    actor_def, actor_params = nnx.split(actor)
    if not cfg.lora_rank:
        trainable = {"actor": actor_params}
        critic_def = None
        if needs_critic:
            critic_def, critic_params = nnx.split(initial_critic(cfg, actor))
            trainable["critic"] = place(critic_params)
        ref = jax.tree.map(jnp.copy, actor_params) if needs_reference else None
        return Roles(actor_def, critic_def, actor_def, actor_def, ref, trainable)
    # LoRA: the loaded actor is the base
    mc = lora_config(cfg, actor.cfg)
    base = actor_params
    base_hash = fingerprint(base)
    source = model_source(cfg)
    if source.kind == "peft":
        adapters = load_peft(
            source.path, trainable_like(Qwen3ForCausalLM, mc), mc, base_hash=base_hash
        )
    else:
        adapters = init_trainable(Qwen3ForCausalLM, mc, cfg.seed)
    trainable = {"actor": place(adapters)}
    frozen = {"actor": base}
    lora_actor_def = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0))))
    critic_def = None
    if needs_critic:
        critic_def = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ValueModel(mc, rngs=nnx.Rngs(0))))
        trainable["critic"] = place(init_trainable(Qwen3ValueModel, mc, cfg.seed + 1))
        frozen["critic"] = nnx.State({"model": base["model"]})
    path = (source.base or source).path if source.kind == "peft" else source.path
    return Roles(
        actor_def=lora_actor_def,
        critic_def=critic_def,
        sample_def=actor_def,
        ref_def=actor_def,
        ref_params=base if needs_reference else None,
        trainable=trainable,
        frozen=frozen,
        base={"path": str(path or f"random model, seed {cfg.seed}"), "fingerprint": base_hash},
        scale=lora_scale(mc.lora_rank, mc.lora_alpha),
        adapted_cfg=mc,
    )


def check_resumed_base(roles: Roles, checkpoint_dir) -> None:
    """A resumed LoRA run's adapters belong to the base its latest checkpoint in
    ``checkpoint_dir`` names: ``ValueError``, naming both fingerprints, when the base read now
    differs (nothing to check without LoRA or without a checkpoint)."""
    if not roles.lora or not Path(checkpoint_dir).is_dir():
        return
    checkpoints = Checkpoints(checkpoint_dir, create=False)
    if checkpoints.latest() is None:
        return
    recorded = checkpoints.restore({"base": None})["base"]
    check_base(recorded, roles.base["path"], roles.base["fingerprint"], where="--resume")
