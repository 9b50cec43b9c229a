"""Decode throughput of the KV-cache sampler for batch 1, 8 and 64.

    python benchmarks/sampler.py [--layers 4 --width 256 --vocab 151936 --prompt 64 --new 128]

A randomly initialised Qwen3-architecture model (the benchmark size of ``benchmarks/model.py``
unless overridden); each batch size is compiled once, then timed (median of ``--reps``) for
prefill and for decoding ``--new`` tokens per row at temperature 1. The table prints new tokens
per second over the whole batch and per row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from train.engine.sampler import Sampler
from train.model.qwen3 import ModelConfig, Qwen3ForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=0, help="0: width / heads")
    p.add_argument("--mlp", type=int, default=0, help="MLP width; 0: 3 x width")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    dtype = jnp.dtype(args.dtype)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=args.mlp or 3 * args.width,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim or args.width // args.heads,
        rope_theta=1e6,
        tie_word_embeddings=True,
        dtype=dtype,
        param_dtype=dtype,
    )
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    print(
        f"Qwen3 {args.layers} layers, width {args.width}, vocab {args.vocab}, {args.dtype}, "
        f"prompt {args.prompt}, {args.new} new tokens per row, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; median of {args.reps}"
    )
    print("| batch | prefill (s) | decode (s) | decode tok/s | tok/s per row |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = rng.integers(0, args.vocab, size=(batch, args.prompt)).tolist()
        sampler = Sampler(model, batch_size=batch, capacity=args.prompt + args.new)
        prefill, decode = [], []
        for rep in range(args.reps + 1):  # the first round compiles
            t0 = time.perf_counter()
            sampler.start(prompts)
            jax.block_until_ready(sampler.next_logits)
            t1 = time.perf_counter()
            gen = sampler.generate(max_new_tokens=args.new, temperature=1.0, seed=rep)
            t2 = time.perf_counter()
            assert all(len(t) == args.new for t in gen.tokens)
            if rep:
                prefill.append(t1 - t0)
                decode.append(t2 - t1)
        t_pre, t_dec = statistics.median(prefill), statistics.median(decode)
        rate = batch * args.new / t_dec
        print(f"| {batch} | {t_pre:.3f} | {t_dec:.2f} | {rate:,.0f} | {rate / batch:,.0f} |")


if __name__ == "__main__":
    main()
