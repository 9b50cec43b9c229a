"""What a run's models are and where their weights come from.

One place turns a run's configuration (``train.core.config.TrainConfig``) into the chat codec, the
model's `ModelConfig` and initial weights, so that ``train.run``, ``train.export``,
``train.evaluate``, ``train.plan`` and ``train.sft`` agree on them:

* **the source of the initial policy** (`model_source`): ``--init-from`` (a Hugging Face
  folder such as an export, or a run directory whose latest actor is read), else
  ``--model-path`` (a Hugging Face folder), else a tiny random Qwen3-architecture model seeded by
  ``--seed``. The reference model is the same source read again, never a stored copy.
* **the codec** (`run_codec`): the environment's own (the synthetic word tasks), or for the
  chat environments the chat format of ``--tokenizer-path``, else of the source's folder, else
  the bundled Qwen3 tokenizer; checked against the model's vocabulary.
* **precision**: ``--param-dtype`` for the weights, ``--compute-dtype`` (``auto``: bfloat16 on
  GPU/TPU, float32 on CPU) for activations and the KV cache, ``--remat`` per decoder layer.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from train.core.config import TrainConfig, read_run_config
from train.model.lora import is_peft_folder, peft_settings
from train.model.qwen3 import ModelConfig, Qwen3ForCausalLM, Qwen3ValueModel

__all__ = [
    "ModelSource",
    "model_source",
    "compute_dtype",
    "run_codec",
    "model_config",
    "abstract_actor",
    "initial_actor",
    "initial_critic",
    "needs_reference",
    "run_config",
    "restore_model",
    "lora_config",
    "trainable_like",
    "check_base",
    "restore_adapters",
]


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a run's initial policy comes from.

    ``kind``: ``"hf"`` (a Hugging Face folder at ``path``), ``"run"`` (the latest actor of the run
    directory ``path``, whose own configuration is ``run``), ``"peft"`` (a PEFT LoRA folder at
    ``path`` on the base ``base``) or ``"random"`` (a tiny model).
    ``folder`` is the Hugging Face folder behind it (its tokenizer), if any.
    """

    kind: str
    path: str | None = None
    folder: str | None = None
    run: TrainConfig | None = None
    base: ModelSource | None = None  # "peft": the adapters' base model (--model-path)


def _is_hf_folder(path: Path) -> bool:
    config = path / "config.json"
    return config.exists() and "architectures" in json.loads(config.read_text())


def model_source(cfg: TrainConfig) -> ModelSource:
    """The source of ``cfg``'s initial policy (see the module docstring); a path that is neither a
    Hugging Face folder nor a run directory is refused, naming the flag."""
    if cfg.init_from:
        path = Path(cfg.init_from)
        if is_peft_folder(path):  # adapters: their base is --model-path
            if not cfg.model_path:
                raise ValueError(f"init_from: {path} is a PEFT adapter folder; name its base "
                                 "with --model-path")  # fmt: skip
            if not cfg.lora_rank:
                rank = peft_settings(path)[0]
                raise ValueError(
                    f"init_from: {path} holds LoRA adapters of rank {rank}; pass --lora-rank "
                    f"{rank} (and the folder's --lora-targets)"
                )
            base = model_source(dataclasses.replace(cfg, init_from=None))
            return ModelSource("peft", str(path), base.folder, base=base)
        if _is_hf_folder(path):
            return ModelSource("hf", str(path), str(path))
        if (path / "config.json").exists() and (path / "checkpoints").is_dir():
            run = TrainConfig(**read_run_config(path / "config.json"))
            if "sft" in json.loads((path / "config.json").read_text()):
                check_warm_start(cfg, run, path)
            inner = model_source(run)
            return ModelSource("run", str(path), inner.folder, run)
        raise ValueError(
            f"init_from: {path} is neither a Hugging Face folder (config.json with "
            "'architectures') nor a run directory (config.json and checkpoints/)"
        )
    if cfg.model_path:
        path = Path(cfg.model_path)
        if not (path / "config.json").exists():
            what = "does not exist" if not path.exists() else "has no config.json"
            hint = ""
            if path.name == SMOLLM2_FOLDER:
                hint = "; `make smollm2` converts SmolLM2-135M-Instruct into it (the README's)"
            raise ValueError(f"model_path: {path} {what}{hint}")
        return ModelSource("hf", str(path), str(path))
    return ModelSource("random")


def check_warm_start(cfg: TrainConfig, warm: TrainConfig, path: Path) -> None:
    """A warm start (a ``train.sft`` run) serves the game and model it was made for: a run on
    another game, or naming another ``--model-path``, is refused naming both."""

    def game(c: TrainConfig) -> str:
        chosen = c.env_set.get("game")
        return f"{c.env} ({chosen})" if chosen else c.env

    if game(cfg) != game(warm):
        raise ValueError(
            f"init_from: {path} is a warm start made for --env {game(warm)}, not --env "
            f"{game(cfg)}; make one for this game with python -m train.sft --env {cfg.env}"
        )
    if cfg.model_path and warm.model_path and Path(cfg.model_path) != Path(warm.model_path):
        raise ValueError(
            f"init_from: {path} is a warm start of --model-path {warm.model_path}, not "
            f"{cfg.model_path}"
        )


# the folder `make smollm2` writes (the README's real model), named in a refusal that meets it
SMOLLM2_FOLDER = "smollm2-135m-instruct"


def compute_dtype(name: str) -> str:
    """``auto`` -> bfloat16 on an accelerator, float32 on the CPU; else the name itself."""
    if name != "auto":
        return name
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def run_codec(cfg: TrainConfig, env):
    """The codec of ``cfg``'s environment: its own, or for a chat environment the chat format of
    ``--tokenizer-path`` / the source's folder / the bundled Qwen3 tokenizer. A template that
    renders no tools, for an environment that has tools, is said on stderr (the fallback) or
    refused (``--tool-fallback refuse``), naming the template."""
    if not getattr(env, "chat_format", False):
        return env.codec
    from envs.chat import ChatTemplateError, chat_format

    folder = cfg.tokenizer_path or model_source(cfg).folder
    try:
        codec = chat_format(
            folder, enable_thinking=cfg.enable_thinking, tool_fallback=cfg.tool_fallback
        )
    except ChatTemplateError as e:
        if cfg.tokenizer_path:
            raise
        raise ChatTemplateError(f"{e} (pass --tokenizer-path to use another folder's)") from e
    note = codec.tools_note() if env.tools else None
    if note and cfg.tool_fallback == "refuse":
        raise ChatTemplateError(f"{note}, and {cfg.env} has {len(env.tools)} tools")
    if note and jax.process_index() == 0:
        print(note, file=sys.stderr)
    return codec


def model_config(cfg: TrainConfig, codec, source: ModelSource | None = None) -> ModelConfig:
    """The architecture and precision of ``cfg``'s models (from the source's config.json, or
    the tiny flags with the codec's vocabulary; ``codec`` may be None for a checkpoint)."""
    source = source or model_source(cfg)
    precision = dict(
        dtype=jnp.dtype(compute_dtype(cfg.compute_dtype)),
        param_dtype=jnp.dtype(cfg.param_dtype),
        remat=cfg.remat,
    )
    if source.kind == "peft":
        source = source.base
    if source.kind == "run":
        base = model_config(source.run, codec)
        return dataclasses.replace(base, **precision)
    if source.kind == "hf":
        from train.model.weights import read_config

        return read_config(source.path, **precision)
    return ModelConfig(
        vocab_size=codec.vocab_size,
        hidden_size=cfg.width,
        intermediate_size=2 * cfg.width,
        num_layers=cfg.layers,
        num_heads=cfg.heads,
        num_kv_heads=cfg.kv_heads,
        head_dim=cfg.width // cfg.heads,
        rope_theta=1e4,
        tie_word_embeddings=True,
        **precision,
    )


def abstract_actor(mc: ModelConfig) -> Qwen3ForCausalLM:
    """The policy with shapes and dtypes only (no weights allocated)."""
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))


def initial_actor(
    cfg: TrainConfig, mc: ModelConfig, *, shardings: Any = None, log=None
) -> Qwen3ForCausalLM:
    """The run's initial policy, read from its source (placed with ``shardings`` as read)."""
    source = model_source(cfg)
    if source.kind == "peft":  # the base; the trainer puts the folder's adapters on it
        source = source.base
    if source.kind == "hf":
        from train.model.weights import load_pretrained

        kwargs = {} if log is None else {"log": log}
        return load_pretrained(
            source.path,
            dtype=mc.dtype,
            param_dtype=mc.param_dtype,
            remat=mc.remat,
            shardings=shardings,
            **kwargs,
        )
    if source.kind == "run":
        return restore_model(source.path, mc)
    return Qwen3ForCausalLM(mc, rngs=nnx.Rngs(cfg.seed))


def run_config(run_dir: str | Path) -> TrainConfig:
    """A run directory's configuration (refused, naming the folder, where there is none)."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"--run-dir: {run_dir} has no config.json (not a run directory)")
    return TrainConfig(**read_run_config(path))


def restore_model(run_dir: str | Path, mc: ModelConfig, *, step=None, part: str = "actor"):
    """The ``part`` (``actor`` or ``critic``) of a run's checkpoint at ``step`` (default: the
    latest) as a model of config ``mc``, restored alone (no optimizer state is read)."""
    from train.core.checkpoint import Checkpoints

    checkpoints = Checkpoints(Path(run_dir) / "checkpoints", create=False)
    steps = checkpoints.steps()
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no checkpoint")
    if step is not None and step not in steps:
        raise ValueError(f"--step: {run_dir} has checkpoints at steps {steps}, not {step}")
    cls = Qwen3ValueModel if part == "critic" else Qwen3ForCausalLM
    run = run_config(run_dir)
    if run.lora_rank:  # the run's base, re-read, with the checkpoint's adapters merged in
        return _restore_adapted(run, checkpoints, mc, step, cls)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(mc, rngs=nnx.Rngs(0))))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
    params = checkpoints.restore({part: like}, step)[part]
    return nnx.merge(graphdef, params)


def lora_config(cfg: TrainConfig, mc: ModelConfig) -> ModelConfig:
    """``mc`` with ``cfg``'s adapters (``--lora-targets`` checked against the model's
    projections: [`train.model.lora.check_targets`][train.model.lora.check_targets]; ``all``, the
    default, is every projection the model has, so on a model whose every layer is MoE the
    attention projections)."""
    from train.model.lora import check_targets, projections

    names = cfg.lora_target_names()
    if cfg.lora_targets == "all":  # every projection the model has: attention alone on all-MoE
        names = tuple(t for t in names if t in projections(mc))
    targets = check_targets(names, mc)
    return dataclasses.replace(
        mc, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_targets=targets
    )


def trainable_like(cls, mc: ModelConfig) -> nnx.State:
    """The abstract trainable state (adapters, a critic's value head) of ``cls(mc)``."""
    from train.model.lora import TRAINABLE

    abstract = nnx.state(nnx.eval_shape(lambda: cls(mc, rngs=nnx.Rngs(0))), TRAINABLE)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)


def check_base(recorded: dict | None, path: str | None, base_hash: str, *, where: str) -> None:
    """Refuses (``ValueError``) a LoRA checkpoint whose recorded base differs from the one read
    now, naming both."""
    if recorded and recorded.get("fingerprint") not in (None, base_hash):
        raise ValueError(
            f"{where}: its adapters were trained on the base {recorded.get('path')} (fingerprint "
            f"{recorded['fingerprint']}); the base read now, {path}, has fingerprint {base_hash}"
        )


@dataclasses.dataclass(frozen=True)
class RestoredAdapters:
    """A LoRA run's checkpointed ``trainable`` state (adapters; a critic's value head too) with
    the ``base`` it belongs to, re-read from the run's source and checked against the base the
    checkpoint names (``path``, ``fingerprint``); ``mc`` the adapted model's config."""

    base_def: Any
    base: nnx.State
    trainable: nnx.State
    mc: ModelConfig
    path: str | None
    fingerprint: str


def restore_adapters(run: TrainConfig, checkpoints, mc: ModelConfig, step, cls):
    """The `RestoredAdapters` of ``cls`` (the actor or the critic) at ``step``; raises
    ``ValueError`` naming both fingerprints when the base read now is not the checkpoint's."""
    from train.model.lora import fingerprint

    base_def, base = nnx.split(initial_actor(run, mc))
    part = "critic" if cls is Qwen3ValueModel else "actor"
    lmc = lora_config(run, mc)
    restored = checkpoints.restore({part: trainable_like(cls, lmc), "base": None}, step)
    path, base_hash = model_source(run).path, fingerprint(base)
    check_base(restored["base"], path, base_hash, where="checkpoint")
    return RestoredAdapters(base_def, base, restored[part], lmc, path, base_hash)


def _restore_adapted(run: TrainConfig, checkpoints, mc: ModelConfig, step, cls) -> nnx.Module:
    """The run's ``cls`` at ``step`` as a plain model: its adapters merged into the base."""
    from train.model.lora import lora_scale, merge_weights

    r = restore_adapters(run, checkpoints, mc, step, cls)
    plain_def, base = r.base_def, r.base
    if cls is Qwen3ValueModel:
        plain_def = nnx.graphdef(nnx.eval_shape(lambda: cls(mc, rngs=nnx.Rngs(0))))
        base = nnx.State({"model": base["model"]})
    merged = merge_weights(base, r.trainable, lora_scale(r.mc.lora_rank, r.mc.lora_alpha))
    return nnx.merge(plain_def, merged)


def initial_critic(cfg: TrainConfig, actor: Qwen3ForCausalLM) -> Qwen3ValueModel:
    """The critic: ``--critic-from``'s trunk (and value head, for an exported critic), else a copy
    of the policy's trunk; a fresh value head at zero."""
    if cfg.critic_from:
        from train.model.weights import load_pretrained

        mc = actor.cfg
        return load_pretrained(
            cfg.critic_from,
            dtype=mc.dtype,
            param_dtype=mc.param_dtype,
            remat=mc.remat,
            model_cls=Qwen3ValueModel,
        )
    return Qwen3ValueModel.from_policy(actor, rngs=nnx.Rngs(cfg.seed + 1))


def needs_reference(cfg: TrainConfig, algo) -> bool:
    """Whether anything reads the reference model: a KL term, ``ref_kl`` logging, TRACE."""
    return bool(algo.kl_coef or cfg.log_ref_kl or algo.needs_reference_answers)
