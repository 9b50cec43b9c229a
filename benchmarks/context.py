"""Context parallelism measured from compiled programs on 8 fake CPU devices.

    python benchmarks/context.py [--length 32768] [--small-length 8192] [--repeats 3]

1. **Activations against the context size.** The actor's training micro-step (loss and
   gradients, ``--remat full``, bfloat16 compute, one row of ``--length`` tokens, every one an
   action token) of a 2-layer model with Qwen3-8B's widths (hidden 4096, 32 query and 8 KV heads
   of 128, MLP 12288, vocabulary 151,936, untied), compiled on meshes of 8 devices with the
   context axis C = 1, 2, 4, 8 and fsdp over the rest (``--mesh 1,8/C,1,C``). Per device: the
   compiler's temporaries, at ``--length`` and at 1/8 of it; what grows with the row (their
   difference scaled to the whole row: activations and their gradients, without the weights
   fsdp gathers or the vocabulary's fixed-size chunks) and its ratio to C = 1's, against the
   goal of at most 1.3/C; and the bytes the program's collectives move per device, in all
   and for the keys and values each layer gathers (the all-gathers of [B, T, 8, 128] arrays).
2. **The balance of causal attention**: (query block, key block) pairs each device visits at
   ``--length`` tokens and blocks of 512, rows split contiguously against zigzag
   (`train.model.context.visible_blocks`): the slowest device's work over the mean.
3. **A measured step**: the same micro-step (run, not only compiled) of a small model (4
   layers, width 256, 4 heads over 2, the real vocabulary) at ``--small-length`` tokens on the
   8 devices, C = 1 (fsdp 8: the row whole on every device) against C = 8: median wall time
   over ``--repeats`` (8 fake devices share this machine's cores, so the time is the sum of
   the devices' work, not a device's), the compiler's peak per device beside the memory plan's
   training micro-step for the same flags (``train.plan``, which holds the optimizer's state
   beside it as well; C = 1 has no plan: a run refuses one row over 8 data-parallel devices).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

GIB = 2**30
QWEN3_8B_WIDTHS = dict(
    vocab_size=151_936,
    hidden_size=4096,
    intermediate_size=12288,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
    rope_theta=1e6,
)
SMALL = dict(
    vocab_size=151_936,
    hidden_size=256,
    intermediate_size=768,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
    rope_theta=1e6,
)
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "u32": 4, "f16": 2, "s8": 1, "u8": 1}
_COLLECTIVE = re.compile(
    r"= \(?((?:\w+\[[\d,]*\][^ ]*(?:, )?)+)\)? (all-gather|reduce-scatter|all-reduce|all-to-all|"
    r"collective-permute)(?:-start)?\("
)


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", text):
        if dtype in _BYTES:
            total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def collectives(hlo: str) -> dict[str, int]:
    """Bytes each kind of collective produces a device, summed over the program's text (a loop
    body once: the scan over layers is one layer's program), and ``kv``: the all-gathers whose
    result is [.., T, kv_heads, head_dim] (the keys and values)."""
    out: dict[str, int] = {}
    for shapes, kind in _COLLECTIVE.findall(hlo):
        out[kind] = out.get(kind, 0) + _shape_bytes(shapes)
        if kind == "all-gather" and re.search(r"\[\d+,\d+,8,128\]", shapes):
            out["kv"] = out.get("kv", 0) + _shape_bytes(shapes)
    return out


def micro_step(widths: dict, layers: int, length: int, context: int, *, run: bool, repeats=1):
    """(compiled memory analysis, collectives, median seconds or None) of the actor's training
    micro-step on one row of ``length`` tokens over 8 devices with ``context`` of them a row."""
    from mpo_jax import algorithms
    from train.core.learner import ActionRows, Models, UpdateFns, make_optimizer
    from train.model.qwen3 import ModelConfig, Qwen3ForCausalLM
    from train.model.sharding import MeshShape, param_shardings, shard_params

    cfg = ModelConfig(
        **widths, num_layers=layers, remat="full", dtype=jnp.bfloat16, attention="chunked"
    )
    mesh = MeshShape(data=1, fsdp=8 // context, context=context).make()
    tx = make_optimizer(1e-5, warmup_steps=1, clip=1.0, weight_decay=0.0)
    if run:
        model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    else:
        model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        if run:
            params = shard_params(state, mesh)
        else:  # placed by the same rules, as shapes only
            shardings = param_shardings(state, mesh)
            params = nnx.from_flat_state(
                [
                    (p, v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[p])))
                    for p, v in nnx.to_flat_state(state)
                ]
            )
        fns = UpdateFns(Models(graphdef, None), algorithms.get("grpo"), tx, tx, temperature=1.0)
        rng = np.random.default_rng(0)
        t = length
        mask = np.ones((1, t), bool)
        mask[:, :16] = False
        batch = ActionRows(
            tokens=rng.integers(0, widths["vocab_size"], (1, t)).astype(np.int32),
            positions=np.broadcast_to(np.arange(t, dtype=np.int32), (1, t)).copy(),
            loss_mask=mask,
            turn_ids=np.where(mask, np.arange(t)[None] // 512, -1).astype(np.int32),
            old_logp=np.where(mask, -3.0, 0).astype(np.float32),
            advantages=np.where(mask, rng.normal(size=(1, t)), 0).astype(np.float32),
        )
        count = float(mask.sum())
        args = (params, jax.tree.map(jnp.asarray, batch), count, count)
        compiled = fns.actor_grad.lower(*args).compile()
        seconds = None
        if run:
            times = []
            for _ in range(repeats + 1):  # the first call warms up
                start = time.perf_counter()
                jax.block_until_ready(compiled(*args))
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times[1:])
    return compiled.memory_analysis(), collectives(compiled.as_text()), seconds


def plan_peak(length: int, context: int) -> float:
    """The memory plan's peak for the measured step's training micro-step (grpo, one row, the
    same model from a ``config.json``)."""
    import json
    import tempfile

    from train.core.config import parse_args
    from train.model.qwen3 import ModelConfig
    from train.plan import make_plan

    folder = Path(tempfile.mkdtemp())
    hf = ModelConfig(**SMALL, num_layers=4).to_hf()
    (folder / "config.json").write_text(json.dumps(hf))
    flags = ["--model-path", str(folder), "--env", "search",
             "--preset", "grpo", "--no-log-ref-kl", "--max-len", str(length), "--remat", "full",
             "--compute-dtype", "bfloat16", "--prompts-per-step", "1", "--group-size", "8",
             "--minibatches", "8", "--micro-batches", "1", "--eval-every", "0",
             "--mesh", f"1,{8 // context},1,{context}", "--run-dir", os.devnull]  # fmt: skip
    plan = make_plan(parse_args(flags))
    return next(p.peak for p in plan.programs if p.name == "training micro-step (actor)")


def main(argv=None) -> None:
    from train.model.context import visible_blocks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--small-length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--skip-measured", action="store_true")
    args = parser.parse_args(argv)
    assert len(jax.devices()) == 8, jax.devices()

    if not args.skip_large:
        print(f"## Qwen3-8B widths, 2 layers, one row of {args.length} tokens, 8 devices\n")
        short = args.length // 8
        print(f"| mesh (data,fsdp,tensor,context) | temporaries GiB a device | at {short} tokens "
              "| activations GiB (by length) | x C=1 | goal 1.3/C | arguments GiB "
              "| collectives GiB a device | K/V all-gathers GiB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        base = None
        for c in (1, 2, 4, 8):
            memory, moved, _ = micro_step(QWEN3_8B_WIDTHS, 2, args.length, c, run=False)
            small, _, _ = micro_step(QWEN3_8B_WIDTHS, 2, short, c, run=False)
            temp = memory.temp_size_in_bytes
            # what grows with the row: the difference over 7/8 of it, scaled to the whole row
            # (the weights fsdp gathers and the vocabulary's fixed-size chunks cancel out)
            grows = (temp - small.temp_size_in_bytes) * 8 / 7
            base = base or grows
            total = sum(v for k, v in moved.items() if k != "kv")
            print(f"| 1,{8 // c},1,{c} | {temp / GIB:.2f} | {small.temp_size_in_bytes / GIB:.2f} "
                  f"| {grows / GIB:.2f} | {grows / base:.3f} | {1.3 / c:.3f} "
                  f"| {memory.argument_size_in_bytes / GIB:.2f} | {total / GIB:.3f} "
                  f"| {moved.get('kv', 0) / GIB:.3f} |", flush=True)  # fmt: skip

    print(f"\n## Causal attention's work a device, {args.length} tokens, blocks of 512\n")
    print("| C | contiguous: slowest / mean | zigzag: slowest / mean |")
    print("|---|---|---|")
    for c in (2, 4, 8):
        row = [visible_blocks(args.length, c, 512, zigzag=z) for z in (False, True)]
        print(f"| {c} | {row[0].max() / row[0].mean():.3f} | {row[1].max() / row[1].mean():.3f} |")

    n = args.small_length
    if args.skip_measured:
        return
    print(f"\n## A measured step: 4 layers, width 256, one row of {n} tokens, 8 fake devices\n")
    print("| mesh | median s (sum over devices) | compiler's peak GiB a device "
          "| plan's training micro-step GiB | compiler / plan |")  # fmt: skip
    print("|---|---|---|---|---|")
    for c in (1, 8):
        memory, _, seconds = micro_step(SMALL, 4, n, c, run=True, repeats=args.repeats)
        peak = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )
        if c == 1:  # one row cannot split over 8 data-parallel devices: no run to plan
            print(f"| 1,8,1,1 (the row whole on every device) | {seconds:.2f} | {peak / GIB:.3f} "
                  "| (refused: one row over 8 fsdp devices) | |", flush=True)  # fmt: skip
            continue
        planned = plan_peak(n, c)
        print(f"| 1,{8 // c},1,{c} | {seconds:.2f} | {peak / GIB:.3f} | {planned / GIB:.3f} "
              f"| {peak / planned:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
