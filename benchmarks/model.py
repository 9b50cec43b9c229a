"""Qwen3 forward and forward+backward throughput: our flax.nnx model against transformers' PyTorch.

    python benchmarks/model.py [--layers 4 --width 256 --vocab 151936 --batch 8 --seq 512]
    python benchmarks/model.py --model-path models/smollm2-135m-instruct --batch 2 --seq 512
    python benchmarks/model.py --model-path models/smollm2-135m-instruct --batch 2 --seq 512 \
        --lora-rank 16                       # and LoRA: our updates against torch + peft
        [--tunix-python VENV/bin/python]     # and google-tunix's LoRA (benchmarks/tunix_lora.py)

Both sides run the same checkpoint (a random Qwen3 written by transformers, or ``--model-path``:
any folder both load, e.g. the converted SmolLM2) in
float32 on the CPU, each side in a process of its own; forward+backward is the mean next-token
cross-entropy and its gradient with respect to every parameter. The last two rows are the
trainer's own update steps on the same rows (every next token an action token), the actor's and
a critic's, each with its AdamW step, against transformers' forward+backward (no optimizer step
on that side). The table prints tokens/s (median of ``--reps``) and our speed-up; the logits of
both sides are checked equal first.

With ``--lora-rank R`` (alpha 2R, every projection adapted on both sides): torch + peft's LoRA
forward+backward (gradients for the adapters alone) against our LoRA actor update, and our LoRA
actor and critic updates together, per model (one frozen base; the critic's value head trained
in full). ``--tunix-python``: also google-tunix's LoRA (qwix adapters on tunix's Llama 3, the
same rows, rank and projections; forward+backward and an AdamW step) from that environment's
Python (``benchmarks/tunix_lora.py``; tunix pins its own jax and flax), after the other two sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers
from flax import nnx

from kernels.logprobs import token_logprobs
from mpo_jax import algorithms
from train.core.learner import ActionRows, Models, UpdateFns, make_optimizer
from train.model import lora
from train.model.lora import LORA_TARGETS
from train.model.qwen3 import Qwen3ForCausalLM, Qwen3ValueModel
from train.model.weights import load_pretrained


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_ours(model, ids, ref, reps, lora_rank=0):
    """(forward, forward+backward with full logits, forward+backward with chunked log-probs)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_full(params, ids):
        # As transformers' loss: the labels shift, not the logits (slicing [tokens, vocab]
        # logits costs a copy forward and a pad backward), and the last position weighs 0.
        logits = nnx.merge(graphdef, params, rest)(ids).astype(jnp.float32)
        labels = jnp.pad(ids[:, 1:], ((0, 0), (0, 1)))
        weight = jnp.ones(ids.shape, jnp.float32).at[:, -1].set(0.0)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(nll * weight) / jnp.sum(weight)

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
    # LoRA first: the full updates donate the model's own arrays, which LoRA reads as its base
    adapted = time_updates(model, ids, reps, lora_rank=lora_rank) if lora_rank else []
    return times + time_updates(model, ids, reps) + adapted


def time_updates(model, ids, reps, *, lora_rank: int = 0):
    """The trainer's own update of the actor and of the critic on these rows, every next token
    an action token: ``UpdateFns.actor_grad`` (the clipped policy loss on chunked log-probs) or
    ``critic_grad`` (the clipped value loss), then ``UpdateFns.apply`` (AdamW, in place). With
    ``lora_rank``: adapters (alpha 2R, every projection) on one frozen base, as train.run
    holds them (:mod:`train.core.roles`)."""
    b, t = ids.shape
    rng = np.random.default_rng(0)
    actions = (b, t - 1)
    rows = ActionRows(
        tokens=ids,
        positions=jnp.broadcast_to(jnp.arange(1, t, dtype=jnp.int32), actions),
        loss_mask=jnp.ones(actions, bool),
        turn_ids=jnp.zeros(actions, jnp.int32),
        old_logp=jnp.full(actions, -10.0, jnp.float32),
        advantages=jnp.asarray(rng.normal(size=actions), jnp.float32),
        values=jnp.zeros(actions, jnp.float32),
        returns=jnp.asarray(rng.normal(size=actions), jnp.float32),
    )
    count = float(b * (t - 1))
    frozen = {"actor": None, "critic": None}
    if lora_rank:
        mc = dataclasses.replace(model.cfg, lora_rank=lora_rank, lora_alpha=2.0 * lora_rank)
        base = nnx.state(model)
        actor_def = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0))))
        critic_def = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ValueModel(mc, rngs=nnx.Rngs(0))))
        actor = lora.init_trainable(Qwen3ForCausalLM, mc, 0)
        critic = lora.init_trainable(Qwen3ValueModel, mc, 1)
        frozen = {"actor": base, "critic": nnx.State({"model": base["model"]})}
    else:
        critic = Qwen3ValueModel.from_policy(model, rngs=nnx.Rngs(0))
        actor_def, actor = nnx.split(model)
        critic_def, critic = nnx.split(critic)
    tx = make_optimizer(1e-6, warmup_steps=0, clip=1.0, weight_decay=0.0)
    fns = UpdateFns(Models(actor_def, critic_def), algorithms.get("ppo"), tx, tx, temperature=1.0)
    state = {
        "actor": [actor, fns.init("actor", actor)],
        "critic": [critic, fns.init("critic", critic)],
    }

    def update(which):
        params, opt = state[which]
        read = params if frozen[which] is None else lora.Adapted(frozen[which], params)
        if which == "actor":
            (loss, _), grads = fns.actor_grad(read, rows, count, count)
        else:
            (loss, _), grads = fns.critic_grad(read, rows, count)
        params, opt, _, _ = fns.apply(which, params, opt, grads, loss)
        state[which] = [jax.block_until_ready(params), opt]

    return [timed(lambda which=which: update(which), reps) for which in ("actor", "critic")]


def time_torch(torch_model, ids, reps, lora_rank=0):
    def forward():
        with torch.no_grad():
            return torch_model(ids).logits

    def fwd_bwd(model=torch_model):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    times = [timed(forward, reps), timed(fwd_bwd, reps)]
    if lora_rank:  # peft's LoRA: the base frozen, gradients for the adapters alone
        import peft

        config = peft.LoraConfig(
            r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=LORA_TARGETS
        )
        adapted = peft.get_peft_model(torch_model, config)
        times.append(timed(lambda: fwd_bwd(adapted), reps))
    return times


def _config(args) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=3 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.width // args.heads,
        tie_word_embeddings=True,
    )


def _ids(args) -> np.ndarray:
    vocab = args.vocab
    if args.model_path:
        vocab = json.loads(open(f"{args.model_path}/config.json").read())["vocab_size"]
    return np.random.default_rng(0).integers(0, vocab, size=(args.batch, args.seq))


def _side(args) -> None:
    """One side's timings, printed as JSON (run in its own process by :func:`main`)."""
    ids_np = _ids(args)
    if args.side == "torch":
        torch_model = transformers.AutoModelForCausalLM.from_pretrained(
            args.checkpoint, dtype=torch.float32
        ).eval()
        times = time_torch(torch_model, torch.tensor(ids_np), args.reps, args.lora_rank)
    else:
        ref = np.load(f"{args.checkpoint}/ref_logits.npy")
        model = load_pretrained(args.checkpoint, dtype=jnp.float32)
        times = time_ours(model, jnp.asarray(ids_np, jnp.int32), ref, args.reps, args.lora_rank)
    print(json.dumps({"times": list(times), "threads": torch.get_num_threads()}))


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
    p.add_argument("--model-path", help="a Hugging Face folder instead of a random Qwen3")
    p.add_argument("--lora-rank", type=int, default=0, help="also LoRA rows at this rank")
    p.add_argument("--tunix-python", help="with --lora-rank: a Python with google-tunix")
    p.add_argument("--side", choices=("torch", "ours"), help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        return _side(args)

    torch.manual_seed(0)
    if args.model_path:
        torch_model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model_path, dtype=torch.float32
        ).eval()
    else:
        torch_model = transformers.Qwen3ForCausalLM(_config(args)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        torch_model.save_pretrained(tmp)
        with torch.no_grad():
            ref = torch_model(torch.tensor(_ids(args))).logits[:, :4].numpy()
        np.save(f"{tmp}/ref_logits.npy", ref)
        del torch_model
        # Each side in a process of its own, torch first: in one process, whichever side runs
        # second shares the cores with the first one's idle thread pool (measured: torch's
        # forward+backward 342 tok/s alone, 203 after ours in the same process).
        results = {}
        for side in ("torch", "ours"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--side", side, "--checkpoint", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"the {side} side failed:\n{proc.stderr[-3000:]}")
            out = proc.stdout
            results[side] = json.loads(out.strip().splitlines()[-1])
    t_tunix = _time_tunix(args) if args.tunix_python and args.lora_rank else None
    t_fwd, t_fb, t_fb_chunked, t_actor, t_critic, *lora_ours = results["ours"]["times"]
    t_tfwd, t_tfb, *lora_torch = results["torch"]["times"]

    tokens = args.batch * args.seq
    what = args.model_path or f"Qwen3 {args.layers} layers, width {args.width}, vocab {args.vocab}"
    print(
        f"{what}, "
        f"batch {args.batch} x {args.seq}, float32, CPU, {results['torch']['threads']} torch "
        f"threads, jax {jax.__version__}, torch {torch.__version__}; median of {args.reps}, "
        "each side in its own process"
    )
    print("| pass | ours tok/s | transformers tok/s | ours / transformers |")
    print("|---|---|---|---|")
    print(f"| forward | {tokens / t_fwd:,.0f} | {tokens / t_tfwd:,.0f} | {t_tfwd / t_fwd:.2f}x |")
    print(
        f"| forward+backward | {tokens / t_fb:,.0f} | {tokens / t_tfb:,.0f} | {t_tfb / t_fb:.2f}x |"
    )
    rows = [
        ("forward+backward, chunked log-probs", t_fb_chunked),
        ("the trainer's actor update (policy loss, AdamW) vs forward+backward", t_actor),
        ("the trainer's critic update (value loss, AdamW) vs forward+backward", t_critic),
    ]
    for name, seconds in rows:
        print(
            f"| {name} | {tokens / seconds:,.0f} | {tokens / t_tfb:,.0f} | {t_tfb / seconds:.2f}x |"
        )
    if args.lora_rank:
        (t_lactor, t_lcritic), (t_peft,) = lora_ours, lora_torch
        r = args.lora_rank
        rows = [
            (f"LoRA rank {r}: our actor update vs torch + peft forward+backward", t_lactor),
            (f"LoRA rank {r}: our critic update vs torch + peft forward+backward", t_lcritic),
            (f"LoRA rank {r}: our actor + critic updates, per model", (t_lactor + t_lcritic) / 2),
        ]
        for name, seconds in rows:
            print(
                f"| {name} | {tokens / seconds:,.0f} | {tokens / t_peft:,.0f} | "
                f"{t_peft / seconds:.2f}x |"
            )
        print(
            f"| LoRA against full fine-tuning: our actor update | {tokens / t_lactor:,.0f} | "
            f"(full: {tokens / t_actor:,.0f}) | {t_actor / t_lactor:.2f}x |"
        )
        if t_tunix is not None:
            print(
                f"| LoRA rank {r}: our actor update vs google-tunix (qwix) forward+backward+AdamW "
                f"| {tokens / t_lactor:,.0f} | (tunix: {tokens / t_tunix:,.0f}) | "
                f"{t_tunix / t_lactor:.2f}x |"
            )


def _time_tunix(args) -> float:
    """Seconds of one google-tunix LoRA update on the same rows (its own process and Python)."""
    if not args.model_path:
        raise SystemExit("--tunix-python: needs --model-path (tunix loads a Llama folder)")
    script = Path(__file__).with_name("tunix_lora.py")
    cmd = [args.tunix_python, str(script), "--model-path", args.model_path, "--batch",
           str(args.batch), "--seq", str(args.seq), "--rank", str(args.lora_rank), "--reps",
           str(args.reps)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("TUNIX_TOKS ")]
    if proc.returncode or not lines:
        raise SystemExit(f"the tunix side failed:\n{proc.stderr[-3000:]}")
    return args.batch * args.seq / float(lines[-1].split()[1])


if __name__ == "__main__":
    main()
