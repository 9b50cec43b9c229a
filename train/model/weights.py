"""Hugging Face checkpoints in and out: ``load_pretrained`` and ``save_pretrained``.

A checkpoint folder holds ``config.json`` and one ``model.safetensors`` or several shards named
by ``model.safetensors.index.json`` (float32, float16 or bfloat16 on disk). Loading builds the
model abstractly (no weights allocated), then reads the files tensor by tensor with NumPy (never
PyTorch), checks each name and shape against ``config.json``, and places each tensor on its
device (with the sharding the caller computed, if any) as soon as it is read: there is never a
full host copy of the model.

The name table is small: Hugging Face ``[out, in]`` linear weights become nnx ``[in, out]`` kernels
(a transpose), per-expert MoE weights are stacked into ``[experts, ...]`` parameters. A tied
checkpoint (``tie_word_embeddings: true``) may still ship ``lm_head.weight`` (the official
Qwen3-0.6B, 1.7B and 4B do): it is checked against the embedding, tensor row block by row block,
and must equal it within bfloat16 rounding; the embedding is used (and a checkpoint whose two differ
is refused). A critic (`train.model.qwen3.Qwen3ValueModel`) reads the same folders (its
trunk; ``lm_head.weight`` is not part of it) plus ``value_head.weight``/``value_head.bias`` when an
exported critic has them.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from train.model.qwen3 import ModelConfig, Qwen3ForCausalLM

__all__ = [
    "load_pretrained",
    "save_pretrained",
    "read_config",
    "checkpoint_files",
    "CheckpointError",
]


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
    """The `ModelConfig` of a checkpoint folder's ``config.json``."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise CheckpointError(f"{path}: no config.json")
    return ModelConfig.from_hf(json.loads(file.read_text()), **overrides)


def _segment(cfg: ModelConfig, layer: int, name: str) -> tuple[int, int]:
    """(stack, entry) of a model layer: which `train.model.qwen3.DecoderStack` holds it,
    and where."""
    for s, (first, count) in enumerate(cfg.layer_segments()):
        if first <= layer < first + count:
            return s, layer - first
    raise CheckpointError(f"{name}: unexpected tensor (the config has {cfg.num_layers} layers)")


def _hf_to_nnx(name: str, cfg: ModelConfig) -> tuple[tuple, bool, tuple[int, ...]]:
    """(nnx path, transpose, index) for a Hugging Face tensor name; ``index`` is the tensor's
    place in a stacked parameter: (layer entry,) or (layer entry, expert), () otherwise."""
    if name == "model.embed_tokens.weight":
        return ("model", "embed_tokens", "embedding"), False, ()
    if name == "model.norm.weight":
        return ("model", "norm", "weight"), False, ()
    if name == "lm_head.weight":
        return ("lm_head_kernel", "kernel"), True, ()
    if name == "value_head.weight":
        return ("value_head", "kernel"), True, ()
    if name == "value_head.bias":
        return ("value_head", "bias"), False, ()
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        for pattern, path, transpose in _LAYER_TABLE:
            mm = re.fullmatch(pattern, rest)
            if mm:
                groups = mm.groups()
                filled = tuple(p.format(*groups) for p in path)
                stack, entry = _segment(cfg, layer, name)
                index = (entry, int(groups[0])) if "experts" in pattern else (entry,)
                return ("model", "layers", stack, "layer", *filled), transpose, index
    raise CheckpointError(f"{name}: unexpected tensor (no parameter of this architecture)")


_NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}


def _header(file: Path) -> tuple[int, dict]:
    """(data offset, header) of a safetensors file."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _read(file: Path, info: dict, base: int, rows: slice | None = None) -> np.ndarray:
    """A tensor (or a block of its leading rows) read from the safetensors layout directly (its
    NumPy API has no bfloat16)."""
    dtype = np.dtype(_NUMPY_DTYPES[info["dtype"]])
    shape = list(info["shape"])
    start, end = info["data_offsets"]
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else 0
    if rows is not None:
        lo, hi = rows.start, min(rows.stop, shape[0])
        start, end, shape = start + lo * row_bytes, start + hi * row_bytes, [hi - lo, *shape[1:]]
    with open(file, "rb") as f:
        f.seek(base + start)
        data = f.read(end - start)
    return np.frombuffer(data, dtype).reshape(shape)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: those its index names (sharded), else
    ``model.safetensors``, else every ``*.safetensors``. A file the index names must exist."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{index}: names {missing[0]}, which does not exist")
        return [path / n for n in names]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def _iter_tensors(path: Path) -> Iterator[tuple[str, Callable[..., np.ndarray], tuple, str]]:
    """(name, loader, shape, dtype) for every tensor of the folder's safetensors files; the
    loader takes an optional ``rows`` slice (a block of leading rows)."""
    for file in checkpoint_files(path):
        base, header = _header(file)
        for name, info in header.items():
            if name == "__metadata__":
                continue

            def loader(rows=None, file=file, info=info, base=base, name=name):
                if info["dtype"] not in _NUMPY_DTYPES:
                    raise CheckpointError(f"{name}: dtype {info['dtype']} is not supported")
                return _read(file, info, base, rows)

            yield name, loader, tuple(info["shape"]), info["dtype"]


def _check_tied_head(head, embedding, shape, log) -> None:
    """Refuses an ``lm_head.weight`` that differs from the embedding beyond bfloat16 rounding
    (compared block by block of rows: never a second full copy on the host)."""
    worst = 0.0
    for lo in range(0, shape[0], 4096):
        block = slice(lo, lo + 4096)
        a = head(block).astype(np.float32)
        b = embedding(block).astype(np.float32)
        tolerance = 2.0**-8 * np.maximum(np.abs(a), np.abs(b)) + 1e-12
        excess = np.abs(a - b) - tolerance
        worst = max(worst, float(excess.max(initial=-np.inf)))
        if worst > 0:
            raise CheckpointError(
                "lm_head.weight: differs from model.embed_tokens.weight beyond bfloat16 rounding "
                f"(rows {lo}-{lo + len(a) - 1}, by up to {float(np.abs(a - b).max()):.3g}) "
                "although config.json says tie_word_embeddings: true; fix config.json "
                "(tie_word_embeddings: false) or the checkpoint"
            )
    log(
        "lm_head.weight equals model.embed_tokens.weight within bfloat16 rounding "
        "(tie_word_embeddings: true): the embedding is used"
    )


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def load_pretrained(
    path: str | Path,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    shardings: Any = None,
    model_cls: type = Qwen3ForCausalLM,
    remat: str = "none",
    log: Callable[[str], None] = _stderr,
) -> Any:
    """Reads a Hugging Face checkpoint folder into our model.

    ``model(input_ids)`` (int32 [B, T], positions 0..T-1, causal) then returns logits
    [B, T, vocab] equal to transformers' (to float32 rounding).

    Args:
      path: folder with ``config.json`` and ``*.safetensors``.
      dtype: the activations' dtype; param_dtype: the parameters' dtype.
      shardings: optional ``{parameter path: jax.sharding.Sharding}`` (e.g.
        ``train.model.sharding.param_shardings`` of the abstract model); each tensor is placed with
        its sharding as it is read.
      model_cls: `Qwen3ForCausalLM` (default) or `train.model.qwen3.Qwen3ValueModel`
        (the trunk, plus a value head when the folder has one; else the head keeps its init).
      remat: the model's ``remat`` (what each layer keeps for the backward pass).
      log: where notes about the checkpoint go (default: stderr).

    Raises:
      CheckpointError: a missing or unexpected tensor, or a shape that disagrees with
        ``config.json`` (the message names the tensor), a tied ``lm_head.weight`` that is not
        the embedding, or an unsupported architecture.
    """
    path = Path(path)
    cfg = read_config(path, dtype=dtype, param_dtype=param_dtype, remat=remat)
    critic = model_cls is not Qwen3ForCausalLM
    abstract = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    placements = dict(shardings) if shardings is not None else {}

    def place(key, array):
        sharding = placements.get(key)
        value = jnp.asarray(array, dtype=flat[key].get_value().dtype)
        if sharding is not None:
            value = jax.device_put(value, sharding)
        flat[key] = flat[key].replace(value)

    expected = {k for k, v in flat.items() if isinstance(v, nnx.Param)}
    if critic:  # a fresh value head unless the folder is an exported critic
        expected = {k for k in expected if k[0] != "value_head"}
    stacked: dict[tuple, np.ndarray] = {}  # layers (and experts) gathered per parameter
    seen: dict[tuple, set] = {}
    filled: set[tuple] = set()
    tied: dict[str, Any] = {}
    for name, load, shape, _ in _iter_tensors(path):
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or critic):
            tied["head"] = (load, shape)  # checked against the embedding below; not a parameter
            continue
        key, transpose, index = _hf_to_nnx(name, cfg)
        if key[0] == "value_head" and critic:
            if key not in flat:
                raise CheckpointError(f"{name}: unexpected tensor")
            expected.add(key)
        if key not in flat:
            where = ".".join(map(str, key))
            raise CheckpointError(f"{name}: unexpected tensor (the config has no {where})")
        full = tuple(flat[key].get_value().shape)
        if len(index) == 2 and not 0 <= index[1] < full[1]:
            raise CheckpointError(f"{name}: expert {index[1]} but config has {full[1]} experts")
        want = full[len(index) :]
        got = shape[::-1] if transpose else shape
        if tuple(got) != want:
            hf_want = want[::-1] if transpose else want
            raise CheckpointError(
                f"{name}: shape {list(shape)} disagrees with config.json (expected {list(hf_want)})"
            )
        if name == "model.embed_tokens.weight":
            tied["embedding"] = load
        array = load()
        if transpose:
            array = array.T
        if not index:
            place(key, array)
            filled.add(key)
            continue
        buf = stacked.setdefault(key, np.zeros(full, array.dtype))
        buf[index] = array
        seen.setdefault(key, set()).add(index)
        if len(seen[key]) == int(np.prod(full[: len(index)])):
            place(key, stacked.pop(key))
            filled.add(key)
    if "head" in tied and cfg.tie_word_embeddings and "embedding" in tied:
        head, head_shape = tied["head"]
        want = tuple(flat[("model", "embed_tokens", "embedding")].get_value().shape)
        if tuple(head_shape) != want:
            raise CheckpointError(
                f"lm_head.weight: shape {list(head_shape)} disagrees with the tied embedding "
                f"(expected {list(want)})"
            )
        _check_tied_head(head, tied["embedding"], head_shape, log)
    if critic:  # a checkpoint without a value head: a fresh one at zero
        for key in flat:
            if key[0] == "value_head" and key not in filled:
                place(key, np.zeros(flat[key].get_value().shape, np.float32))
    missing = sorted(expected - filled)
    if missing:
        key = missing[0]
        names = list(_hf_names(key, cfg, flat[key].get_value().shape))
        have = seen.get(key, set())
        hint = next(name for index, name in names if index not in have)
        raise CheckpointError(
            f"{hint}: missing tensor ({len(missing)} parameter(s) incomplete; config.json "
            "expects it)"
        )
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model


def _hf_names(key: tuple, cfg: ModelConfig, shape) -> Iterator[tuple[tuple, str]]:
    """(index, Hugging Face name) of every tensor a parameter holds: one, or one per stacked
    layer (and expert)."""
    if key == ("model", "embed_tokens", "embedding"):
        yield (), "model.embed_tokens.weight"
    elif key == ("model", "norm", "weight"):
        yield (), "model.norm.weight"
    elif key == ("lm_head_kernel", "kernel"):
        yield (), "lm_head.weight"
    elif key[0] == "value_head":
        yield (), f"value_head.{'weight' if key[-1] == 'kernel' else 'bias'}"
    else:
        first, count = cfg.layer_segments()[key[2]]
        rest = key[4:]
        if rest[:2] == ("mlp", "router"):
            body = "mlp.gate.weight"
        elif rest[0] == "mlp" and len(rest) == 2:  # experts
            body = "mlp.experts.{e}." + rest[1] + ".weight"
        else:
            suffix = "weight" if rest[-1] in ("kernel", "weight") else rest[-1]
            body = ".".join(rest[:-1]) + f".{suffix}"
        for j in range(count):
            if "{e}" in body:
                for e in range(shape[1]):
                    yield (j, e), f"model.layers.{first + j}." + body.format(e=e)
            else:
                yield (j,), f"model.layers.{first + j}.{body}"


_SAFETENSORS_DTYPES = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items()}


def write_safetensors(file: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors layout, written directly (bfloat16 included)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, x in tensors.items():
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[x.dtype],
            "shape": list(x.shape),
            "data_offsets": [offset, offset + x.nbytes],
        }
        offset += x.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x).tobytes())


def _hf_tensors(model: Any, dtype) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, host array) of every tensor, one at a time ([in, out] kernels back to
    [out, in]; stacked layers and experts one tensor each)."""
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if key[0] not in ("model", "lm_head_kernel", "value_head"):
            continue
        value = np.asarray(jax.device_get(var.get_value()))
        if dtype is not None:
            value = value.astype(dtype)
        experts = key[0] == "model" and key[4:5] == ("mlp",) and len(key) == 6
        transpose = key[-1] == "kernel" or experts
        for index, name in _hf_names(key, model.cfg, value.shape):
            tensor = value[index] if index else value
            yield name, tensor.T if transpose else tensor


def save_pretrained(
    model: Any, path: str | Path, *, dtype: Any = None, shard_bytes: int = 5 * 2**30
) -> None:
    """Writes ``config.json`` and the weights as safetensors that transformers loads back: one
    ``model.safetensors``, or shards of at most ``shard_bytes`` with the index
    ``model.safetensors.index.json`` (as Hugging Face shards them).

    ``dtype`` (e.g. ``jnp.bfloat16``) converts the weights on the way out (default: as held).
    A critic (`train.model.qwen3.Qwen3ValueModel`) writes its trunk under the causal LM's
    names and its head as ``value_head.weight``/``value_head.bias``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = model.cfg
    np_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in _hf_tensors(model, np_dtype):
        if shards[-1] and size + value.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(value)
        size += value.nbytes
    if len(shards) == 1:
        write_safetensors(path / "model.safetensors", shards[0])
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(path / file, shard)
            weight_map.update({name: file for name in shard})
            total += sum(x.nbytes for x in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = cfg.to_hf()
    if np_dtype is not None:
        config["torch_dtype"] = np_dtype.name
    (path / "config.json").write_text(json.dumps(config, indent=2))
