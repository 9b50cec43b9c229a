"""Generation with LoRA: merged kernels against the adapters applied in every projection.

    python benchmarks/lora_generation.py [--model-path models/smollm2-135m-instruct]
        [--rank 16] [--rows 16] [--prompt 256] [--new 48] [--reps 3]

Two ways for the sampler to run a LoRA actor, on the same base, adapters, prompts and seeds:

- **merged**: once per published version, ``W' = W + (α / r) A B`` for every adapted kernel
  (`train.model.lora.merge_weights`), then the unadapted model over ``W'``: the base's cost a
  token, plus the merge a version.
- **adapters**: the adapted model itself (``x W + (α / r) (x A) B`` in each of the 7 projections of
  every layer): no merge, two thin matrix products more a projection a token.

Rows x prompt tokens are prefilled, then ``--new`` tokens a row are decoded (no stop token, so
both do the same work). The adapters' B is drawn at random (a trained adapter's scale), so the
two ways' first-token log-probabilities are compared (they must agree to float32 rounding). A
training step publishes one version, so "per version" is the merge plus one prefill and decode.
Median of ``--reps`` after a first round that compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from train.engine.sampler import Sampler
from train.model.lora import LORA_TARGETS, init_trainable, lora_scale, merge_weights
from train.model.qwen3 import Qwen3ForCausalLM
from train.model.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]


def random_adapters(cls, mc, seed: int) -> nnx.State:
    """Fresh adapters with B drawn at 0.02 (a fresh B is zero, which would hide the adapters)."""
    adapters = init_trainable(cls, mc, seed)
    key = jax.random.key(seed)
    flat = []
    for i, (path, var) in enumerate(nnx.to_flat_state(adapters)):
        if path[-1] == "lora_b":
            value = var.get_value()
            var = var.replace(0.02 * jax.random.normal(jax.random.fold_in(key, i), value.shape))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def timed(sampler: Sampler, prompts, new: int, seed: int) -> tuple[float, float, np.ndarray]:
    t0 = time.perf_counter()
    sampler.start(prompts)
    first = np.asarray(jax.nn.log_softmax(sampler.next_logits, axis=-1))
    t1 = time.perf_counter()
    gen = sampler.generate(max_new_tokens=new, temperature=1.0, seed=seed)
    t2 = time.perf_counter()
    assert all(len(t) == new for t in gen.tokens), "a row stopped early"
    return t1 - t0, t2 - t1, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    base_model = load_pretrained(args.model_path, log=lambda _: None)
    mc = dataclasses.replace(
        base_model.cfg, lora_rank=args.rank, lora_alpha=2 * args.rank, lora_targets=LORA_TARGETS
    )
    base = nnx.state(base_model)
    adapters = random_adapters(Qwen3ForCausalLM, mc, 0)
    lora_def = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0))))
    scale = lora_scale(args.rank, 2 * args.rank)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, mc.vocab_size, size=(args.rows, args.prompt)).tolist()
    capacity = args.prompt + args.new

    def merged_model():
        merged = merge_weights(base, adapters, scale)
        jax.block_until_ready(merged)
        return nnx.merge(nnx.graphdef(base_model), merged)

    ways = {
        "merged": merged_model,
        "adapters": lambda: nnx.merge(lora_def, base, adapters),
    }
    times = {w: {"prepare": [], "pre": [], "dec": []} for w in ways}
    firsts = {}
    for rep in range(args.reps + 1):  # round 0 compiles
        for way, make in ways.items():  # alternate, so a drifting load reaches both
            t0 = time.perf_counter()
            model = make()
            prepare = time.perf_counter() - t0
            sampler = Sampler(model, batch_size=args.rows, capacity=capacity)
            pre, dec, first = timed(sampler, prompts, args.new, seed=rep)
            firsts[way] = first
            if rep:
                for k, v in (("prepare", prepare), ("pre", pre), ("dec", dec)):
                    times[way][k].append(v)
    gap = float(np.max(np.abs(firsts["merged"] - firsts["adapters"])))
    print(
        f"{Path(args.model_path).name}, LoRA rank {args.rank} on {', '.join(LORA_TARGETS)}; "
        f"{args.rows} rows x {args.prompt} prompt tokens, {args.new} new tokens a row; float32, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}; median of {args.reps}. "
        f"First-token log-prob gap merged vs adapters: {gap:.1e}"
    )
    print("| way | merge a version (s) | prefill (s) | decode (s) | decode tok/s "
          "| per version (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    total = {}
    for way in ways:
        t = {k: statistics.median(v) for k, v in times[way].items()}
        total[way] = t["prepare"] + t["pre"] + t["dec"]
        rate = args.rows * args.new / t["dec"]
        merge = f"{t['prepare']:.3f}" if way == "merged" else "-"
        print(f"| {way} | {merge} | {t['pre']:.3f} | {t['dec']:.2f} | {rate:,.0f} | "
              f"{total[way]:.2f} |")  # fmt: skip
    print(f"adapters / merged, per version: {total['adapters'] / total['merged']:.2f}x")


if __name__ == "__main__":
    jnp.zeros(())  # start the backend before the clock
    main()
