"""google-tunix's LoRA (qwix) on SmolLM2-135M: one forward+backward and AdamW step a call, timed.

    VENV/bin/python benchmarks/tunix_lora.py --model-path models/smollm2-135m-instruct
        [--batch 2] [--seq 512] [--rank 16] [--reps 5]

Runs in an environment of its own (``pip install google-tunix==0.1.7``: it pins its own jax and
flax), importing nothing of this project, so ``benchmarks/model.py --tunix-python VENV/bin/python``
can run it beside our update on the same rows. The model is tunix's Llama 3 (SmolLM2 is a Llama
with tied embeddings) loaded from the same safetensors; qwix's ``LoraProvider`` puts rank-R
adapters (alpha 2R) on the seven projections of every layer. The loss is the mean next-token
cross-entropy of random rows, the gradient is taken with respect to the adapters alone, and
optax's AdamW updates them: the work our LoRA actor update does, less the policy loss. Prints
``TUNIX_TOKS <tokens a second>`` (median of ``--reps`` after one compiling call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from flax import nnx
from tunix.models.llama3 import model as llama
from tunix.models.llama3 import params as llama_params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    hf = json.loads((Path(args.model_path) / "config.json").read_text())
    cfg = llama.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(hf["rope_theta"]),
        norm_eps=hf["rms_norm_eps"],
        weight_tying=hf.get("tie_word_embeddings", False),
    )
    base = llama_params.create_model_from_safe_tensors(args.model_path, cfg, dtype=jnp.float32)
    b, t = args.batch, args.seq
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(b, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    provider = qwix.LoraProvider(
        module_path=".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*",
        rank=args.rank,
        alpha=2.0 * args.rank,
    )
    model = qwix.apply_lora_to_model(
        base, provider, tokens, positions, None, mask, rngs=nnx.Rngs(0)
    )
    graphdef, adapters, frozen = nnx.split(model, nnx.LoRAParam, ...)
    count = sum(x.size for x in jax.tree.leaves(adapters))
    tx = optax.adamw(1e-4)
    opt = tx.init(adapters)

    def loss_fn(adapters, frozen):
        logits, _ = nnx.merge(graphdef, adapters, frozen)(tokens, positions, None, mask)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    @jax.jit
    def update(adapters, opt, frozen):
        loss, grads = jax.value_and_grad(loss_fn)(adapters, frozen)
        updates, opt = tx.update(grads, opt, adapters)
        return optax.apply_updates(adapters, updates), opt, loss

    times = []
    for rep in range(args.reps + 1):
        t0 = time.perf_counter()
        adapters, opt, loss = update(adapters, opt, frozen)
        jax.block_until_ready(loss)
        if rep:
            times.append(time.perf_counter() - t0)
    rate = b * t / statistics.median(times)
    print(f"qwix LoRA rank {args.rank}: {count:,} adapter numbers, loss {float(loss):.3f}")
    print(f"TUNIX_TOKS {rate:.1f}")


if __name__ == "__main__":
    main()
