"""Qwen3 forward and forward+backward throughput: our flax.nnx model against transformers' PyTorch.

    python benchmarks/model.py [--layers 4 --width 256 --vocab 151936 --batch 8 --seq 512]

Both sides run the same random checkpoint (written by transformers, read by our loader) in
float32 on the CPU, in one process; forward+backward is the mean next-token cross-entropy and its
gradient with respect to every parameter. The table prints tokens/s (median of ``--reps``) and
our speed-up; the logits of both sides are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from kernels.logprobs import token_logprobs
from train.weights import load_pretrained


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_ours(model, ids, ref, reps):
    """(forward, forward+backward with full logits, forward+backward with chunked log-probs)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_full(params, ids):
        logits = nnx.merge(graphdef, params, rest)(ids)[:, :-1].astype(jnp.float32)
        target = jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)

    def loss_chunked(params, ids):
        # The trainer's path: hidden states, then chunked log-probs (no [tokens, vocab] logits).
        m = nnx.merge(graphdef, params, rest)
        weight, vocab_axis = m.lm_head()
        hidden = m.model(ids)[:, :-1]
        return -jnp.mean(token_logprobs(hidden, weight, ids[:, 1:], vocab_axis=vocab_axis))

    forward = jax.jit(lambda params, ids: nnx.merge(graphdef, params, rest)(ids))
    np.testing.assert_allclose(np.asarray(forward(params, ids)[:, :4]), ref, atol=2e-4)
    times = [timed(lambda: jax.block_until_ready(forward(params, ids)), reps)]
    for loss in (loss_full, loss_chunked):
        step = jax.jit(jax.value_and_grad(loss))
        times.append(timed(lambda step=step: jax.block_until_ready(step(params, ids)), reps))
    return times


def time_torch(torch_model, ids, reps):
    def forward():
        with torch.no_grad():
            return torch_model(ids).logits

    def fwd_bwd():
        torch_model.zero_grad(set_to_none=True)
        torch_model(ids, labels=ids).loss.backward()

    return timed(forward, reps), timed(fwd_bwd, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=3 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.width // args.heads,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    torch_model = transformers.Qwen3ForCausalLM(cfg).eval()
    ids_np = np.random.default_rng(0).integers(0, args.vocab, size=(args.batch, args.seq))
    ids_t = torch.tensor(ids_np)
    ids = jnp.asarray(ids_np, jnp.int32)
    with tempfile.TemporaryDirectory() as tmp:
        torch_model.save_pretrained(tmp)
        model = load_pretrained(tmp)

    with torch.no_grad():
        ref = torch_model(ids_t).logits[:, :4].numpy()
    t_fwd, t_fb, t_fb_chunked = time_ours(model, ids, ref, args.reps)
    del model
    t_tfwd, t_tfb = time_torch(torch_model, ids_t, args.reps)

    tokens = args.batch * args.seq
    print(
        f"Qwen3 {args.layers} layers, width {args.width}, vocab {args.vocab}, "
        f"batch {args.batch} x {args.seq}, float32, CPU, {torch.get_num_threads()} torch threads, "
        f"jax {jax.__version__}, torch {torch.__version__}; median of {args.reps}"
    )
    print("| pass | ours tok/s | transformers tok/s | ours / transformers |")
    print("|---|---|---|---|")
    print(f"| forward | {tokens / t_fwd:,.0f} | {tokens / t_tfwd:,.0f} | {t_tfwd / t_fwd:.2f}x |")
    print(
        f"| forward+backward | {tokens / t_fb:,.0f} | {tokens / t_tfb:,.0f} | {t_tfb / t_fb:.2f}x |"
    )
    print(
        f"| forward+backward, chunked log-probs | {tokens / t_fb_chunked:,.0f} | "
        f"{tokens / t_tfb:,.0f} | {t_tfb / t_fb_chunked:.2f}x |"
    )


if __name__ == "__main__":
    main()
