"""LoRA: low-rank adapters on one frozen base, shared by the actor, the critic and the reference.

An adapted projection computes

    y = x W + b + (α / r) · x A B,      A: [d_in, r] (He-uniform), B: [r, d_out] (zero at start)

so a fresh adapter leaves the base's outputs exactly as they were. The layer is flax's own
``nnx.LoRALinear`` (its ``nnx.LoRA`` child holds A and B as ``nnx.LoRAParam``, a ``Param``
subtype that filters apart), with PEFT's scale α / r added, which flax's layer lacks
([`AdaptedLinear`][train.model.lora.AdaptedLinear]). Why nnx's layer and not qwix (tunix's LoRA
library): qwix rewrites a model's ``nnx.Linear`` / ``nnx.Einsum`` calls by interception at trace
time, which our scanned `DecoderStack` and its stacked parameter layout would have to be taught;
the adapted layer as a module keeps the adapters in the model's own state tree, stacked, named and
sharded like every other parameter, at the cost of these few lines. QLoRA (qwix's other half) is
not built.

What is adapted: the projections ``--lora-targets`` names among `LORA_TARGETS` (attention
q/k/v/o, the dense MLP's gate/up/down). MoE experts and the router are never adapted (they stay
frozen); on a MoE layer the MLP names adapt nothing.

One base in memory. The trainer holds the base's parameters once; the actor is
``Adapted(base, actor adapters)``, the critic ``Adapted(base's trunk, critic adapters + value
head)`` (the same arrays, not a copy), and the reference is the base alone under the graph of the
unadapted model. [`bind`][train.model.lora.bind] turns a graph and either kind of parameters into a
model, so every scoring and loss function reads both. Generation runs the merged weights
([`merge_weights`][train.model.lora.merge_weights]: ``W + (α / r) A B``, one copy per published
version).

Checkpoints hold the adapters and the value head (and their optimizer states) and name their
base ([`fingerprint`][train.model.lora.fingerprint]); [`save_peft`][train.model.lora.save_peft] /
[`load_peft`][train.model.lora.load_peft] write and read PEFT's adapter folder
(``adapter_config.json``, ``adapter_model.safetensors``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

__all__ = [
    "LORA_TARGETS",
    "TRAINABLE",
    "AdaptedLinear",
    "Adapted",
    "bind",
    "lora_scale",
    "adapted_names",
    "init_trainable",
    "merge_weights",
    "fingerprint",
    "save_peft",
    "load_peft",
    "is_peft_folder",
    "PEFT_BASE_FILE",
]

# the projections an adapter may sit on, by their (Hugging Face) module names
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

# what a LoRA run trains: the adapters, and the critic's value head in full
TRAINABLE = nnx.Any(nnx.LoRAParam, nnx.PathContains("value_head"))

PEFT_BASE_FILE = "mpo_jax_base.json"  # beside a PEFT folder we write: the base it was made on


def lora_scale(rank: int, alpha: float) -> float:
    """PEFT's scale α / r (α = 0 means α = r: scale 1)."""
    return float(alpha or rank) / rank


class AdaptedLinear(nnx.LoRALinear):
    """``nnx.LoRALinear`` with PEFT's scale: ``x W + b + scale · x A B`` (A, B float32 unless
    given; the adapter's product runs in the layer's compute dtype). A and B carry the
    kernel's logical axis names (``(in, None)`` and ``(None, out)``) for sharding."""

    def __init__(self, d_in, d_out, *, rank: int, scale: float, names, **kwargs):
        eager = {"eager_sharding": False}
        super().__init__(
            d_in,
            d_out,
            lora_rank=rank,
            lora_dtype=kwargs.get("dtype"),
            lora_param_dtype=jnp.float32,
            a_metadata={"out_sharding": (names[0], None), **eager},
            b_metadata={"out_sharding": (None, names[-1]), **eager},
            **kwargs,
        )
        self.scale = scale

    def __call__(self, x):
        y = nnx.Linear.__call__(self, x)
        return y + (self.scale * self.lora(x)).astype(y.dtype)


@struct.dataclass
class Adapted:
    """A model's parameters as a frozen ``base`` (nnx.State) and the trained ``adapters``
    (nnx.State): a pytree, so jitted functions take it whole and differentiate one half."""

    base: Any
    adapters: Any


def bind(graphdef, params) -> nnx.Module:
    """The model of ``graphdef`` over ``params``: an nnx.State, or
    [`Adapted`][train.model.lora.Adapted] (both halves merged; the base's arrays are read, never
    copied)."""
    if isinstance(params, Adapted):
        return nnx.merge(graphdef, params.base, params.adapters)
    return nnx.merge(graphdef, params)


def projections(cfg) -> list[str]:
    """The projection names of `LORA_TARGETS` that ``cfg`` has in at least one layer (the
    MLP's only where some layer is dense: MoE experts are not adapted)."""
    dense = any(not cfg.is_moe_layer(layer) for layer in range(cfg.num_layers))
    return [t for t in LORA_TARGETS if t in _ATTENTION or dense]


def adapted_names(cfg) -> list[str]:
    """The module names the adapters of ``cfg`` sit on in at least one layer (an MLP name adapts
    nothing on a model whose every layer is MoE)."""
    present = projections(cfg)
    return [t for t in cfg.lora_targets if t in present]


def check_targets(targets, cfg) -> tuple[str, ...]:
    """``targets`` as a tuple, refused (``ValueError`` naming ``--lora-targets`` and listing the
    model's projection names) when one is not a projection name or names no module of ``cfg``."""
    targets = tuple(targets)
    present = projections(cfg)
    wrong = [t for t in targets if t not in present]
    if wrong or not targets:
        why = (
            ""
            if len(present) > len(_ATTENTION)
            else (" (every layer of this model is MoE: experts are not adapted)")
        )
        raise ValueError(
            f"lora_targets: {wrong or 'none given'} names no module of the model; its "
            f"projection names are {present}{why}"
        )
    return targets


def init_trainable(model_cls, cfg, seed: int) -> nnx.State:
    """The trainable state of a fresh ``model_cls(cfg)``: adapters (A random, B zero) and, for a
    critic, its value head (zero). Compiled as one program whose only outputs are these, so the
    base's own initialisation is never computed or allocated."""

    def make():
        return nnx.state(model_cls(cfg, rngs=nnx.Rngs(seed)), TRAINABLE)

    return jax.jit(make)()


def _adapter_pairs(adapters: nnx.State):
    """(projection path, A, B) of every adapted projection in ``adapters``."""
    flat = dict(nnx.to_flat_state(adapters))
    for path, var in flat.items():
        if path[-1] == "lora_a":
            prefix = path[:-2]
            yield prefix, var.get_value(), flat[(*prefix, "lora", "lora_b")].get_value()


def merge_weights(base: nnx.State, adapters: nnx.State, scale: float) -> nnx.State:
    """The base with every adapted kernel replaced by ``W + scale · A B`` (in float32, cast back
    to W's dtype) and the parameters ``adapters`` trains in full (a critic's value head) added;
    other parameters are the base's own arrays. Stacked layers merge layer by layer
    (A [L, d_in, r], B [L, r, d_out])."""
    flat = dict(nnx.to_flat_state(base))
    for path, var in nnx.to_flat_state(adapters):  # trained in full (a critic's value head)
        if "lora" not in path:
            flat[path] = var
    for prefix, a, b in _adapter_pairs(adapters):
        kernel = flat[(*prefix, "kernel")]
        merged = _merged_kernel(kernel.get_value(), a, b, jnp.float32(scale))
        flat[(*prefix, "kernel")] = kernel.replace(merged)
    return nnx.from_flat_state(sorted(flat.items()))


@jax.jit
def _merged_kernel(w, a, b, scale):
    """``W + scale · A B`` in float32, in W's dtype (one program per kernel shape: the base's
    other weights are never copied)."""
    delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def fingerprint(state: nnx.State, samples: int = 4096) -> str:
    """A short hash of a base's weights: every parameter's path, shape, dtype and up to
    ``samples`` of its values taken at a stride (the same bytes however the array is sharded)."""
    digest = hashlib.sha256()
    for path, var in sorted(nnx.to_flat_state(state), key=lambda kv: str(kv[0])):
        x = var.get_value()
        stride = max(1, int(np.prod(x.shape)) // samples)
        sample = np.asarray(jax.device_get(_strided(x, stride)))
        digest.update(f"{'/'.join(map(str, path))}:{x.shape}:{x.dtype}".encode())
        digest.update(sample[:samples].tobytes())
    return digest.hexdigest()[:16]


@functools.partial(jax.jit, static_argnums=1)
def _strided(x, stride: int):
    """Every ``stride``-th value of ``x``, flattened (one program per shape and stride)."""
    return x.reshape(-1)[::stride]


# -- PEFT's adapter folder ------------------------------------------------------------------------


def _hf_names(cfg, adapters: nnx.State):
    """(Hugging Face module name ``model.layers.{i}.{self_attn|mlp}.{proj}``, A [d_in, r],
    B [r, d_out]) of each adapted projection of each layer."""
    segments = cfg.layer_segments()
    for prefix, a, b in _adapter_pairs(adapters):
        at = prefix.index("layers")
        first, count = segments[prefix[at + 1]]
        block, proj = prefix[-2], prefix[-1]
        for j in range(count):
            yield f"model.layers.{first + j}.{block}.{proj}", a[j], b[j]


def save_peft(folder, adapters: nnx.State, cfg, *, base_path: str | None, base_hash: str):
    """Writes ``adapters`` of a model of ``cfg`` as PEFT's LoRA folder: ``adapter_config.json``
    (r, α, the exact modules as a regex) and ``adapter_model.safetensors`` (``lora_A.weight``
    [r, d_in] = Aᵀ, ``lora_B.weight`` [d_out, r] = Bᵀ, under
    ``base_model.model.<module>``), plus `PEFT_BASE_FILE` naming the base."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, modules = {}, []
    for name, a, b in _hf_names(cfg, adapters):
        modules.append(name)
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a, np.float32).T)
        tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b, np.float32).T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.lora_rank,
        "lora_alpha": float(cfg.lora_alpha or cfg.lora_rank),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "target_modules": "|".join(re.escape(m) for m in modules),
        "base_model_name_or_path": base_path,
        "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    base = {"path": base_path, "fingerprint": base_hash, "architecture": cfg.architecture}
    (folder / PEFT_BASE_FILE).write_text(json.dumps(base, indent=2) + "\n")
    return folder


def is_peft_folder(path) -> bool:
    return (Path(path) / "adapter_config.json").exists()


def peft_settings(folder) -> tuple[int, float, tuple[str, ...]]:
    """(rank, α, projection names) of a PEFT LoRA folder; ``ValueError`` naming the folder for
    another kind of adapter."""
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"init_from: {folder} holds a {config.get('peft_type')} adapter, not LoRA")
    targets = config.get("target_modules") or []
    text = targets if isinstance(targets, str) else "|".join(targets)
    names = tuple(t for t in LORA_TARGETS if t in text)
    return int(config["r"]), float(config.get("lora_alpha") or config["r"]), names


def load_peft(
    folder, like: nnx.State, cfg, *, base_hash: str | None = None, flag: str = "init_from"
) -> nnx.State:
    """The adapters of a PEFT LoRA folder in the layout of ``like`` (the abstract adapters of a
    model of ``cfg``). Refused, naming the folder: a folder made on another base (its
    `PEFT_BASE_FILE` fingerprint differs from ``base_hash``) or architecture, a tensor
    whose shape does not fit, a module this model does not adapt or one it lacks (``flag``: the
    command's flag for the folder)."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    side = folder / PEFT_BASE_FILE
    if side.exists():
        made = json.loads(side.read_text())
        if made.get("architecture") not in (None, cfg.architecture):
            raise ValueError(f"{flag}: {folder} was made for a {made['architecture']}, this "
                             f"model is a {cfg.architecture}")  # fmt: skip
        if base_hash and made.get("fingerprint") not in (None, base_hash):
            raise ValueError(f"{flag}: {folder} was made on the base {made.get('path')} "
                             f"(fingerprint {made['fingerprint']}), not this one "
                             f"({base_hash})")  # fmt: skip
    tensors = {
        k.removeprefix("base_model.model.").replace(".default", ""): v
        for k, v in load_file(str(folder / "adapter_model.safetensors")).items()
    }
    segments = cfg.layer_segments()
    flat = dict(nnx.to_flat_state(like))
    used = set()
    for path, var in list(flat.items()):
        if path[-1] not in ("lora_a", "lora_b"):
            continue
        prefix, kind = path[:-2], ("lora_A" if path[-1] == "lora_a" else "lora_B")
        at = prefix.index("layers")
        first, count = segments[prefix[at + 1]]
        rows = []
        for j in range(count):
            key = f"model.layers.{first + j}.{prefix[-2]}.{prefix[-1]}.{kind}.weight"
            if key not in tensors:
                raise ValueError(f"{flag}: {folder} has no {key} (made for another model, "
                                 "or with other --lora-targets)")  # fmt: skip
            used.add(key)
            rows.append(tensors[key].T)
        value = np.stack(rows)
        if value.shape != tuple(var.get_value().shape):
            raise ValueError(f"{flag}: {folder}: {kind} of {prefix[-1]} has shape "
                             f"{value.shape[1:]}, this model's is {var.get_value().shape[1:]} "
                             "(another base or rank)")  # fmt: skip
        flat[path] = var.replace(jnp.asarray(value, var.get_value().dtype))
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{flag}: {folder} adapts modules this run does not: {extra[:3]} "
                         "(set --lora-targets to the folder's)")  # fmt: skip
    return nnx.from_flat_state(sorted(flat.items()))
