"""The tests' tiny models, defined once.

* :data:`SMALL` and :func:`randomise`: the sizes of every tiny Hugging Face checkpoint the tests
  write, and weights large enough that a wrong detail shows in the logits;
* :func:`save_tiny_qwen3`: the tiny dense Qwen3 checkpoint (the ``tiny_qwen3`` fixture of
  ``tests/conftest.py`` builds it once per session and loads it into our model);
* :func:`tiny_model_config`: the :class:`train.qwen3.ModelConfig` of a tiny flax Qwen3 built
  without a checkpoint (sharding tests and their subprocess script).

torch and transformers are imported where a checkpoint is built, so importing this module (as the
sharding script does) costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from train.qwen3 import ModelConfig

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
