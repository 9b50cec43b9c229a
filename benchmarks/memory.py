"""The memory plan checked against a measured training step.

    python benchmarks/memory.py [--layers 4 --max-len 1024 --preset mpo]
    python benchmarks/memory.py --device-memory 3e9   # the plan chooses, the step measures it

A random checkpoint with Qwen3-0.6B's real widths (width 1,024, 16 query and 8 key-value heads
of 128, MLP 3,072, vocabulary 151,936, tied; ``--layers`` of its 28) and the real tokenizer
trains one step on ``search``, in a process of its own: its peak resident memory during the
step, less what the process held before the first weight was built (interpreter, JAX, the
tokenizer, the search index), is the measured peak. Beside it, ``train.plan``'s prediction for
the same flags (one CPU device). The plan assumes worst-case rows (``--max-len`` tokens, every
one an action token); the run's episodes are sized to reach ``--max-len`` (a random policy
never answers and is cut by length), so the two describe the same step.

With ``--device-memory BYTES`` the remat and the micro-batches are left to the plan: it proposes
the settings that fit that many bytes (:func:`train.plan.propose`, as ``train.run`` does at
start-up on an accelerator), and the step is measured with the settings it chose.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

QWEN3_06B = dict(
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    rope_theta=1e6,
)


def _rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_checkpoint(folder: Path, layers: int) -> None:
    """A random Qwen3-0.6B-width checkpoint (bfloat16) with the bundled tokenizer beside it."""
    import jax.numpy as jnp
    from flax import nnx

    from envs.chat import tokenizer_dir
    from train.model.qwen3 import ModelConfig, Qwen3ForCausalLM
    from train.model.weights import save_pretrained

    hf = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": layers, **QWEN3_06B}
    cfg = ModelConfig.from_hf(hf)
    save_pretrained(Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), folder, dtype=jnp.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (folder / name).write_bytes((tokenizer_dir() / name).read_bytes())


def run_flags(folder: Path, args) -> list[str]:
    chosen_by_plan = ["--micro-batches", str(args.rows), "--remat", "full"]
    return [
        "--model-path", str(folder), "--env", "search", "--preset", args.preset,
        "--max-len", str(args.max_len), "--max-new-tokens", "128", "--env-set", "max_turns=16",
        "--prompts-per-step", "1", "--group-size", str(args.rows), "--minibatches", "1",
        "--compute-dtype", "float32", "--eval-every", "0", "--no-progress", "--drop-long-tasks",
        *([] if args.device_memory else chosen_by_plan),
    ]  # fmt: skip


def measure(flags: list[str]) -> dict:
    """(in the child process) one training step; the peak resident memory above the baseline."""
    import envs
    from train.core.build import run_codec
    from train.core.config import parse_args
    from train.core.trainer import Trainer

    cfg = parse_args([*flags, "--run-dir", tempfile.mkdtemp()])
    run_codec(cfg, envs.make("search", seed=0))  # the tokenizer and the index: not the model's
    baseline = _rss()
    trainer = Trainer(cfg)
    metrics = trainer.step(0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # the same step again, its programs compiled: the peak without the compiler's own memory
    # (Linux resets the high-water mark on writing 5 to clear_refs)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    trainer.step(0)
    warm = _high_water_mark()
    return {"baseline": baseline, "peak": peak, "warm_peak": warm, "tokens": metrics["tokens"]}


def _high_water_mark() -> int:
    """This process's peak resident memory since the last reset (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=2, help="rollout rows (one micro-batch each)")
    p.add_argument("--preset", default="mpo")
    p.add_argument("--device-memory", type=float, default=0.0, help="let the plan choose for it")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))))
        return
    from train.core.config import parse_args
    from train.plan import GIB, make_plan

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        write_checkpoint(folder, args.layers)
        flags = run_flags(folder, args)
        chosen = ""
        if args.device_memory:
            from train.plan import propose

            cfg = parse_args([*flags, "--run-dir", tmp])
            proposal = propose(cfg, limit=int(args.device_memory), given=cfg.given_fields)
            if not proposal.plan.fits:
                raise SystemExit(f"--device-memory: {proposal.verdict()}")
            chosen = proposal.flags()
            flags += chosen.split()
        child = subprocess.run(
            [sys.executable, __file__, "--measure", json.dumps(flags)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )
        if child.returncode:
            raise SystemExit(child.stderr[-3000:])
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        plan = make_plan(parse_args([*flags, "--run-dir", tmp]))
    used = measured["peak"] - measured["baseline"]
    print(
        f"Qwen3-0.6B widths, {args.layers} layers, float32, remat full, {args.preset}, search, "
        f"--max-len {args.max_len}, {args.rows} rows; {measured['tokens']} tokens in the step"
    )
    if args.device_memory:
        print(f"the plan's choice for {args.device_memory / GIB:.2f} GiB: {chosen or 'as given'}")
    print("| | GiB |")
    print("|---|---|")
    print(f"| plan: peak per device ({plan.worst().name}) | {plan.peak / GIB:.2f} |")
    print(f"| measured: peak resident memory above the baseline | {used / GIB:.2f} |")
    print(f"| (baseline: interpreter, JAX, tokenizer, index) | {measured['baseline'] / GIB:.2f} |")
    print(f"| measured / plan | {used / plan.peak:.2f} |")
    warm = measured["warm_peak"] - measured["baseline"]
    print(f"| measured again, its programs compiled (no compiler memory) | {warm / GIB:.2f} |")
    print(f"| measured again / plan | {warm / plan.peak:.2f} |")
    print()
    print(plan.table())


if __name__ == "__main__":
    main()
