"""One training step of a Qwen3-shaped model: tokens/s and model FLOPs utilisation.

    python benchmarks/train_step.py                          # Qwen3-0.6B shape, 8k, bfloat16
    python benchmarks/train_step.py --layers 2 --seq 1024    # a CPU-sized check of the script

A random model (float32 weights, ``--dtype`` compute, ``--remat`` per layer) takes the actor's
update on ``--rows`` rows of ``--seq`` tokens (``--action-share`` of them sampled tokens, the rest
prompt and observations): the jitted loss and gradient of the clipped policy loss with the
chunked log-prob kernel, then the AdamW update, timed over ``--reps`` after a compile. Model
FLOPs per token (PaLM's accounting: no recomputation counted): 6 x the non-embedding parameters,
plus 6 x vocab x width for the LM head on action tokens, plus 12 x layers x heads x head width x
the mean causal context (seq / 2) for attention. MFU = achieved model FLOP/s over
``--peak-tflops`` per device (989: an H100/H200's dense bfloat16).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mpo_jax import algorithms
from train.core.learner import ActionRows, Models, UpdateFns, make_optimizer
from train.model.qwen3 import ModelConfig, Qwen3ForCausalLM


def flops_per_token(cfg: ModelConfig, seq: int, action_share: float) -> float:
    """Training FLOPs per token (forward and backward, model FLOPs only)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn_params = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp_params = 3 * d * cfg.intermediate_size
    dense = cfg.num_layers * (attn_params + mlp_params)
    head = cfg.vocab_size * d * action_share
    attention = 12 * cfg.num_layers * cfg.num_heads * hd * seq / 2
    return 6 * (dense + head) + attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mlp", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--action-share", type=float, default=0.3)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--remat", default="full", choices=["none", "full", "dots"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    args = p.parse_args()
    cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=args.mlp,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        rope_theta=1e6,
        tie_word_embeddings=True,
        dtype=jnp.dtype(args.dtype),
        remat=args.remat,
    )
    graphdef, params = nnx.split(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    tx = make_optimizer(1e-6, warmup_steps=0, clip=1.0, weight_decay=0.0)
    fns = UpdateFns(Models(graphdef, None), algorithms.get("grpo"), tx, tx, temperature=1.0)
    opt = fns.init("actor", params)
    rng = np.random.default_rng(0)
    b, t = args.rows, args.seq
    a = max(1, int(t * args.action_share))
    positions = np.sort(rng.choice(np.arange(1, t), size=(b, a), replace=True), axis=1)
    rows = ActionRows(
        tokens=jnp.asarray(rng.integers(0, args.vocab, (b, t)), jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        loss_mask=jnp.ones((b, a), bool),
        turn_ids=jnp.zeros((b, a), jnp.int32),
        old_logp=jnp.full((b, a), -12.0, jnp.float32),
        advantages=jnp.asarray(rng.normal(size=(b, a)), jnp.float32),
    )
    count = float(b * a)

    def step(params, opt):
        (loss, _), grads = fns.actor_grad(params, rows, count, count)
        params, opt, _, _ = fns.apply("actor", params, opt, grads, loss)
        return params, opt

    t0 = time.perf_counter()
    params, opt = step(params, opt)
    jax.block_until_ready(params)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        params, opt = step(params, opt)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    tokens = b * t
    flops = flops_per_token(cfg, t, args.action_share) * tokens
    devices = jax.device_count()
    mfu = flops / seconds / (args.peak_tflops * 1e12 * devices)
    print(
        f"Qwen3 {args.layers} layers, width {args.width}, {args.heads}/{args.kv_heads} heads of "
        f"{args.head_dim}, MLP {args.mlp}, vocab {args.vocab}; {b} x {t} tokens "
        f"({args.action_share:.0%} actions), {args.dtype} compute, remat {args.remat}; "
        f"jax {jax.__version__} on {devices} {jax.devices()[0].platform} device(s); "
        f"median of {args.reps}"
    )
    print("| step s | first step s (compile) | tokens/s | model TFLOP/s | MFU |")
    print("|---|---|---|---|---|")
    print(
        f"| {seconds:.3f} | {compile_s:.1f} | {tokens / seconds:,.0f} | "
        f"{flops / seconds / 1e12:.2f} | {mfu:.1%} |"
    )


if __name__ == "__main__":
    main()
