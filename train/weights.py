"""Hugging Face checkpoints in and out: ``load_pretrained`` and ``save_pretrained``.

A checkpoint folder holds ``config.json`` and one or many ``*.safetensors`` files (with a
``model.safetensors.index.json`` when sharded). Loading builds the model abstractly (no weights
allocated), then reads the files tensor by tensor with NumPy (never PyTorch), checks each name and
shape against ``config.json``, and places each tensor on its device (with the sharding the caller
computed, if any) as soon as it is read: there is never a full host copy of the model.

The name table is small: Hugging Face ``[out, in]`` linear weights become nnx ``[in, out]`` kernels
(a transpose), per-expert MoE weights are stacked into ``[experts, ...]`` parameters.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from train.qwen3 import ModelConfig, Qwen3ForCausalLM

__all__ = ["load_pretrained", "save_pretrained", "read_config", "CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: the message names the tensor."""


# Hugging Face name (with {i} layer, {j} expert) -> (nnx path, transpose?)
_LAYER_TABLE = [
    (r"input_layernorm\.weight", ("input_layernorm", "weight"), False),
    (r"post_attention_layernorm\.weight", ("post_attention_layernorm", "weight"), False),
    (r"self_attn\.(q|k|v|o)_proj\.weight", ("self_attn", "{0}_proj", "kernel"), True),
    (r"self_attn\.(q|k|v|o)_proj\.bias", ("self_attn", "{0}_proj", "bias"), False),
    (r"self_attn\.(q|k)_norm\.weight", ("self_attn", "{0}_norm", "weight"), False),
    (r"mlp\.(gate|up|down)_proj\.weight", ("mlp", "{0}_proj", "kernel"), True),
    (r"mlp\.gate\.weight", ("mlp", "router", "kernel"), True),
    (r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", ("mlp", "{1}_proj"), True),
]


def read_config(path: str | Path, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint folder's ``config.json``."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise CheckpointError(f"{path}: no config.json")
    return ModelConfig.from_hf(json.loads(file.read_text()), **overrides)


def _hf_to_nnx(name: str) -> tuple[tuple, bool, int | None]:
    """(nnx path, transpose, expert index or None) for a Hugging Face tensor name."""
    if name == "model.embed_tokens.weight":
        return ("model", "embed_tokens", "embedding"), False, None
    if name == "model.norm.weight":
        return ("model", "norm", "weight"), False, None
    if name == "lm_head.weight":
        return ("lm_head_kernel", "kernel"), True, None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        for pattern, path, transpose in _LAYER_TABLE:
            mm = re.fullmatch(pattern, rest)
            if mm:
                groups = mm.groups()
                filled = tuple(p.format(*groups) for p in path)
                expert = int(groups[0]) if "experts" in pattern else None
                return ("model", "layers", layer, *filled), transpose, expert
    raise CheckpointError(f"{name}: unexpected tensor (no parameter of this architecture)")


def _read_bf16(file: Path, name: str) -> np.ndarray:
    """A BF16 tensor, read with the safetensors layout directly (its NumPy API has no bfloat16)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        start, end = header[name]["data_offsets"]
        f.seek(8 + n + start)
        data = f.read(end - start)
    return np.frombuffer(data, ml_dtypes.bfloat16).reshape(header[name]["shape"])


def _iter_tensors(path: Path) -> Iterator[tuple[str, Callable[[], np.ndarray], tuple, str]]:
    """(name, loader, shape, dtype) for every tensor of the folder's safetensors files."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for file in files:
        with safe_open(file, framework="numpy") as f:
            names = list(f.keys())
        with open(file, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name in names:
            info = header[name]
            if info["dtype"] == "BF16":
                loader = lambda file=file, name=name: _read_bf16(file, name)  # noqa: E731
            else:

                def loader(file=file, name=name):
                    with safe_open(file, framework="numpy") as f:
                        return f.get_tensor(name)

            yield name, loader, tuple(info["shape"]), info["dtype"]


def load_pretrained(
    path: str | Path,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    shardings: Any = None,
    model_cls: type = Qwen3ForCausalLM,
) -> Any:
    """Reads a Hugging Face checkpoint folder into our model.

    ``model(input_ids)`` (int32 [B, T], positions 0..T-1, causal) then returns logits
    [B, T, vocab] equal to transformers' (to float32 rounding).

    Args:
      path: folder with ``config.json`` and ``*.safetensors``.
      dtype: the activations' dtype; param_dtype: the parameters' dtype.
      shardings: optional ``{parameter path: jax.sharding.Sharding}`` (e.g.
        ``train.sharding.param_shardings`` of the abstract model); each tensor is placed with
        its sharding as it is read.
      model_cls: :class:`Qwen3ForCausalLM` (default) or another class with the same parameters.

    Raises:
      CheckpointError: a missing or unexpected tensor, or a shape that disagrees with
        ``config.json`` (the message names the tensor), or an unsupported architecture.
    """
    path = Path(path)
    cfg = read_config(path, dtype=dtype, param_dtype=param_dtype)
    abstract = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    placements = dict(shardings) if shardings is not None else {}

    def place(key, array):
        sharding = placements.get(key)
        value = jnp.asarray(array, dtype=param_dtype)
        if sharding is not None:
            value = jax.device_put(value, sharding)
        flat[key] = flat[key].replace(value)

    expected = {k for k, v in flat.items() if isinstance(v, nnx.Param)}
    experts: dict[tuple, np.ndarray] = {}
    filled: set[tuple] = set()
    expert_seen: dict[tuple, set[int]] = {}
    for name, load, shape, _ in _iter_tensors(path):
        key, transpose, expert = _hf_to_nnx(name)
        if key not in flat:
            where = ".".join(map(str, key))
            raise CheckpointError(f"{name}: unexpected tensor (the config has no {where})")
        want = tuple(flat[key].get_value().shape)
        if expert is not None:
            if not 0 <= expert < want[0]:
                raise CheckpointError(f"{name}: expert {expert} but config has {want[0]} experts")
            want = want[1:]
        got = shape[::-1] if transpose else shape
        if tuple(got) != want:
            hf_want = want[::-1] if transpose else want
            raise CheckpointError(
                f"{name}: shape {list(shape)} disagrees with config.json (expected {list(hf_want)})"
            )
        array = load()
        if transpose:
            array = array.T
        if expert is None:
            place(key, array)
            filled.add(key)
        else:
            buf = experts.setdefault(key, np.zeros(flat[key].get_value().shape, array.dtype))
            buf[expert] = array
            expert_seen.setdefault(key, set()).add(expert)
            if len(expert_seen[key]) == buf.shape[0]:
                place(key, experts.pop(key))
                filled.add(key)
    missing = sorted(expected - filled)
    if missing:
        first = missing[0]
        hint = _nnx_to_hf(first)
        raise CheckpointError(
            f"{hint}: missing tensor ({len(missing)} missing in all; config.json expects it)"
        )
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model


def _nnx_to_hf(key: tuple) -> str:
    """A readable Hugging Face name for an nnx path (for error messages and saving)."""
    if key == ("model", "embed_tokens", "embedding"):
        return "model.embed_tokens.weight"
    if key == ("model", "norm", "weight"):
        return "model.norm.weight"
    if key == ("lm_head_kernel", "kernel"):
        return "lm_head.weight"
    layer, rest = key[2], key[3:]
    if rest[:2] == ("mlp", "router"):
        return f"model.layers.{layer}.mlp.gate.weight"
    if rest[0] == "mlp" and len(rest) == 2:
        return f"model.layers.{layer}.mlp.experts.*.{rest[1]}.weight"
    suffix = "weight" if rest[-1] in ("kernel", "weight") else rest[-1]
    return f"model.layers.{layer}." + ".".join(rest[:-1]) + f".{suffix}"


def save_pretrained(model: Any, path: str | Path) -> None:
    """Writes ``config.json`` and ``model.safetensors`` that transformers loads back.

    The value head of a critic is not part of a Hugging Face causal LM and is not written.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = model.cfg
    tensors: dict[str, np.ndarray] = {}
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if key[0] not in ("model", "lm_head_kernel"):
            continue
        value = np.asarray(jax.device_get(var.get_value()))
        name = _nnx_to_hf(key)
        if "experts.*" in name:  # [E, in, out] -> one [out, in] tensor per expert
            for j in range(value.shape[0]):
                tensors[name.replace("*", str(j))] = np.ascontiguousarray(value[j].T)
        else:
            tensors[name] = np.ascontiguousarray(value.T if key[-1] == "kernel" else value)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
