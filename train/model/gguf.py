"""GGUF files (llama.cpp's format) as Hugging Face folders that `load_pretrained` reads.

    folder = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2")

A GGUF file holds a model's hyperparameters and tokenizer as metadata and its tensors, often
quantized (Q4_1, Q8_0, ...). The ``gguf`` package (llama.cpp's own reader; the project's optional
``gguf`` extra) reads both and dequantizes every tensor to float32; this module renames the
tensors to Hugging Face's names, writes ``config.json`` from the metadata and the tokenizer (with
its chat template) through ``transformers``' GGUF tokenizer conversion. The folder is then an
ordinary checkpoint: our loader, transformers, vLLM and SGLang read it alike.

One thing is not a rename. llama.cpp's converter stores a Llama model's q and k projections with
the rotary pairs interleaved (its RoPE rotates adjacent elements; Hugging Face's rotates the two
halves of each head), so for ``llama`` the rows of each head are put back:
``w.reshape(heads, head_dim // 2, 2, in).swapaxes(1, 2).reshape(out, in)``, the inverse of the
permutation llama.cpp applied. Qwen2 and Qwen3 files are stored unpermuted.

What the dequantized weights are: the quantized model's weights exactly (a Q4_1 file gives the
Q4_1 model in float32, not the original float weights it was quantized from).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from train.model.weights import write_safetensors

__all__ = ["GGUFError", "convert_gguf", "read_gguf_config", "SUPPORTED_GGUF_ARCHITECTURES"]

# GGUF ``general.architecture`` -> (Hugging Face architecture, q/k rows interleaved by llama.cpp)
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# GGUF tensor name (after ``blk.N.``) -> Hugging Face name (after ``model.layers.N.``)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into a checkpoint (the message names the file and
    the field or tensor)."""


def _reader(path: Path):
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - the extra is installed by the project's install
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'mpo-jax[gguf]' "
            "(the project's install step does this)"
        ) from e
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on a file that is not GGUF
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, default: Any = None, *, path: Path | None = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None and path is not None:
            raise GGUFError(f"{path}: metadata field {key!r} is missing")
        return default
    return field.contents()


def read_gguf_config(path: str | Path) -> dict:
    """The ``config.json`` dict of a GGUF file, from its metadata (``{arch}.block_count``,
    ``.embedding_length``, ``.feed_forward_length``, ``.attention.head_count[_kv]``,
    ``.attention.key_length``, ``.rope.freq_base``, ``.attention.layer_norm_rms_epsilon``,
    ``.context_length``; the vocabulary from the tokenizer's token list). Tied embeddings when the
    file has no ``output.weight``."""
    path = Path(path)
    return _config(_reader(path), path)


def _config(reader, path: Path) -> dict:
    arch = _field(reader, "general.architecture", path=path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{path}: general.architecture={arch!r} is not supported; "
            f"supported: {sorted(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    if f"{arch}.rope.scaling.type" in reader.fields or any(
        t.name == "rope_freqs.weight" for t in reader.tensors
    ):
        raise GGUFError(
            f"{path}: RoPE scaling (rope_freqs / {arch}.rope.scaling.*) is not supported"
        )
    hf_arch, _ = SUPPORTED_GGUF_ARCHITECTURES[arch]
    hidden = int(_field(reader, f"{arch}.embedding_length", path=path))
    heads = int(_field(reader, f"{arch}.attention.head_count", path=path))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else None, path=path)
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": [hf_arch],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length", path=path)),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count", path=path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10_000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    return config


def _hf_name(name: str, path: Path) -> str:
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    match = _BLOCK.match(name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise GGUFError(f"{path}: tensor {name!r} has no Hugging Face counterpart here")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's rotary interleave of a q/k projection ([heads * head_dim, in] or the
    [heads * head_dim] bias): each head's rows (2i, 2i+1) go back to (i, i + head_dim/2)."""
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _tensors(reader, config: dict, path: Path, np_dtype) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    _, interleaved = SUPPORTED_GGUF_ARCHITECTURES[config["model_type"]]
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, path)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ne0 (inner) first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if interleaved and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config["num_attention_heads"])
        elif interleaved and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config["num_key_value_heads"])
        if not np.all(np.isfinite(w)):
            raise GGUFError(f"{path}: tensor {t.name!r} holds NaN or inf after dequantization")
        out[name] = w.astype(np_dtype)
    if "model.embed_tokens.weight" not in out:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    return out


def convert_gguf(path: str | Path, out: str | Path, *, dtype: str = "float32") -> Path:
    """Writes the Hugging Face folder of a GGUF file: ``config.json``, ``model.safetensors``
    (dequantized, in ``dtype``: float32, bfloat16 or float16), the tokenizer and its chat template
    (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) and
    ``generation_config.json``. Returns the folder.

    Raises:
      FileNotFoundError: no file at ``path``.
      GGUFError: not GGUF, an unsupported architecture or RoPE scaling, a missing metadata field,
        a tensor with no Hugging Face counterpart or non-finite values.
      ValueError: an unknown ``dtype``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(_DTYPES)}, got {dtype!r}")
    path, out = Path(path), Path(out)
    reader = _reader(path)
    config = _config(reader, path)
    np_dtype = np.dtype(_DTYPES[dtype])
    tensors = _tensors(reader, config, path, np_dtype)
    if tensors["model.embed_tokens.weight"].shape[0] != config["vocab_size"]:
        raise GGUFError(
            f"{path}: token_embd.weight has {tensors['model.embed_tokens.weight'].shape[0]} rows "
            f"but the vocabulary has {config['vocab_size']} tokens"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors)
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_tokenizer(path, out)
    return out


def _write_tokenizer(path: Path, out: Path) -> None:
    """The file's tokenizer and chat template through transformers' GGUF conversion, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as e:  # transformers raises many kinds here; the file is the cause
        raise GGUFError(f"{path}: the tokenizer in the file does not convert: {e}") from e
    tokenizer.save_pretrained(str(out))
