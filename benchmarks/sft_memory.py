"""The warm start's memory: one `train.sft` update compiled with and without remat.

    make smollm2 && python benchmarks/sft_memory.py [--env frozen-lake] [--rows 8] [--length 1024]

The update of `train.study.real_model2`'s warm start (SmolLM2-135M-Instruct, LoRA rank 16, its
`SFT_FLAGS`) compiled on abstract rows of ``--rows`` x ``--length`` tokens, once per ``--remat``:
the compiler's own temporaries and arguments (``memory_analysis``), nothing run. Keeping every
layer's activations (``none``) is what OOM-killed FrozenLake's warm start at 18.4 GB RSS.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from train import sft
from train.study.real_model import MODEL
from train.study.real_model2 import GAMES, SFT_FLAGS

GIB = 2**30


def compiled_update(env: str, remat: str, rows: int, length: int) -> dict[str, float]:
    """GiB of temporaries and arguments of one compiled warm-start update at ``remat``."""
    flags = list(SFT_FLAGS)
    if "--remat" in flags:
        del flags[flags.index("--remat") : flags.index("--remat") + 2]
    with tempfile.TemporaryDirectory() as run_dir:
        cfg, data = sft.parse(["--model-path", MODEL, "--env", env, "--demo-player",
                               GAMES[env]["demo_player"], *flags, "--demos", "8", "--val-demos",
                               "1", "--remat", remat, "--run-dir", run_dir])  # fmt: skip
        s = sft.setup(cfg, data)
    update = sft.make_update(s)
    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    mask = jax.ShapeDtypeStruct((rows, length), jnp.bool_)
    lowered = jax.jit(update).lower(s["params"], s["opt"], tokens, mask, None)
    m = lowered.compile().memory_analysis()
    return {"temp": m.temp_size_in_bytes / GIB, "args": m.argument_size_in_bytes / GIB}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="frozen-lake", choices=sorted(GAMES))
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    args = p.parse_args(argv)
    if not (Path(MODEL) / "config.json").exists():
        sys.exit(f"no converted model at {MODEL}: run `make smollm2` first")
    shape = f"{args.rows} x {args.length} tokens"
    print(f"| --remat | temporaries (GiB) | arguments (GiB) | vs none ({shape}) |")
    print("|---|---|---|---|")
    base = None
    for remat in ("none", "full"):
        m = compiled_update(args.env, remat, args.rows, args.length)
        base = base or m["temp"]
        print(f"| {remat} | {m['temp']:.2f} | {m['args']:.2f} | {m['temp'] / base:.3f}x |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
