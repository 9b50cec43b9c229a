"""The tests' tiny models, defined once.

* :data:`SMALL` and :func:`randomise`: the sizes of every tiny Hugging Face checkpoint the tests
  write, and weights large enough that a wrong detail shows in the logits;
* :func:`save_tiny_qwen3`: the tiny dense Qwen3 checkpoint (the ``tiny_qwen3`` fixture of
  ``tests/conftest.py`` builds it once per session and loads it into our model);
* :func:`tiny_model_config`: the :class:`train.model.qwen3.ModelConfig` of a tiny flax Qwen3 built
  without a checkpoint (sharding tests and their subprocess script).

torch and transformers are imported where a checkpoint is built, so importing this module (as the
sharding script does) costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from train.model.qwen3 import ModelConfig

if TYPE_CHECKING:
    import torch

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# The tiny dense Qwen3: two layers, head width 8, tied embeddings.
TINY_QWEN3 = dict(SMALL, num_hidden_layers=2, head_dim=8, tie_word_embeddings=True)


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights large enough that a wrong detail shows in the logits (HF's init is near zero)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    return model.eval()


def save_tiny_qwen3(path: Path, *, seed: int = 3) -> torch.nn.Module:
    """Writes the tiny dense Qwen3 (:data:`TINY_QWEN3`, randomised with ``seed``) to ``path`` as a
    Hugging Face checkpoint; returns the PyTorch model."""
    import transformers

    model = randomise(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY_QWEN3)), seed)
    model.save_pretrained(path)
    return model


# A Qwen3-shaped checkpoint for the real tokenizer: the real vocabulary, two layers, small width.
REAL_VOCAB_QWEN3 = dict(
    vocab_size=151_936,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    tie_word_embeddings=True,
    max_position_embeddings=40_960,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)


def _per_expert(tensors: dict) -> dict:
    """transformers 5 holds a layer's experts fused in memory ([E, 2F, D] gate_up, [E, D, F]
    down); released checkpoints store one [out, in] tensor per expert and projection."""
    out = {}
    for name, x in tensors.items():
        prefix, _, kind = name.rpartition(".experts.")
        if not prefix:
            out[name] = x
            continue
        for j in range(x.shape[0]):
            base = f"{prefix}.experts.{j}"
            if kind == "gate_up_proj":
                gate, up = x[j].chunk(2, dim=0)
                out[f"{base}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{base}.down_proj.weight"] = x[j].contiguous()
    return out


def save_official_qwen3(
    path: Path, *, seed: int = 0, shards: int = 2, moe: bool = False, **overrides
):
    """Writes a random Qwen3 checkpoint with the file shape of the official tied releases
    (Qwen3-0.6B/1.7B/4B): bfloat16 on disk, ``lm_head.weight`` present beside
    ``tie_word_embeddings: true`` (equal to the embedding), ``shards`` safetensors files with
    ``model.safetensors.index.json``, the bundled Qwen3 tokenizer files and chat template, and a
    ``generation_config.json``. Returns the PyTorch model (float32, for reference logits)."""
    import json

    import torch
    import transformers
    from safetensors.torch import save_file

    from envs.chat import tokenizer_dir

    if moe:  # Qwen3-30B-A3B's shape in miniature: untied, experts in every layer
        moe_sizes = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        config = transformers.Qwen3MoeConfig(
            **{**REAL_VOCAB_QWEN3, "tie_word_embeddings": False, **moe_sizes, **overrides}
        )
        model = randomise(transformers.Qwen3MoeForCausalLM(config), seed)
    else:
        config = transformers.Qwen3Config(**{**REAL_VOCAB_QWEN3, **overrides})
        model = randomise(transformers.Qwen3ForCausalLM(config), seed)
    path.mkdir(parents=True, exist_ok=True)
    held = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    tensors = _per_expert(held)
    if config.tie_word_embeddings:  # the official tied releases still ship the head
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    hf = config.to_dict()
    hf.update(architectures=[type(model).__name__], torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [151645, 151643], "pad_token_id": 151643, "do_sample": True})
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (path / name).write_bytes((tokenizer_dir() / name).read_bytes())
    # the reference: the weights as the checkpoint holds them (bfloat16), in float32
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(held[k].float())
    return model.eval()


def tiny_model_config(**overrides) -> ModelConfig:
    """A tiny flax Qwen3 (vocab 64, width 32, 2 layers, 4 heads over 2 KV heads of width 8)."""
    sizes = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
    )
    return ModelConfig(**{**sizes, **overrides})
