"""Peak memory and time of naive vs chunked token log-probs (value and gradient).

    python benchmarks/logprobs.py [--tokens 8192 --vocab 151936 --width 1024 --chunk 512]

The computation is the learner's: ``sum(c · logp + 0.01 · c · entropy)`` and its gradient with
respect to the hidden states and the LM head. Peak memory is read from the compiled program's
memory analysis (temporaries + outputs + arguments, no run needed); time is the median of
``--reps`` runs of the same jitted program.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels.logprobs import logprobs_and_entropy, naive_logprobs_and_entropy


def program(fn, **kw):
    def loss(h, w, y, c):
        logp, ent = fn(h, w, y, **kw)
        return jnp.sum(c * logp) + 0.01 * jnp.sum(c * ent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--reps", type=int, default=1)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(args.tokens, args.width)), jnp.float32)
    w = jnp.asarray(rng.normal(scale=0.03, size=(args.width, args.vocab)), jnp.float32)
    y = jnp.asarray(rng.integers(0, args.vocab, size=args.tokens), jnp.int32)
    c = jnp.asarray(rng.normal(size=args.tokens), jnp.float32)

    rows = []
    for name, fn, kw in (
        ("naive", naive_logprobs_and_entropy, {}),
        (f"chunked ({args.chunk})", logprobs_and_entropy, {"chunk_size": args.chunk}),
    ):
        step = program(fn, **kw)
        compiled = step.lower(h, w, y, c).compile()
        peak = peak_bytes(compiled)
        jax.block_until_ready(compiled(h, w, y, c))
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(h, w, y, c))
            times.append(time.perf_counter() - t0)
        rows.append((name, peak, statistics.median(times)))

    print(
        f"{args.tokens} tokens x vocab {args.vocab} x width {args.width}, float32, value+grad, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, median of {args.reps}"
    )
    print("| method | peak memory (GiB) | time (s) | memory vs naive | time vs naive |")
    print("|---|---|---|---|---|")
    base_peak, base_time = rows[0][1], rows[0][2]
    for name, peak, t in rows:
        print(
            f"| {name} | {peak / 2**30:.2f} | {t:.2f} | {peak / base_peak:.3f} | "
            f"{t / base_time:.2f}x |"
        )


if __name__ == "__main__":
    main()
