"""The newcomer's first steps: phase throughput of ``train.run`` on a Qwen3-shaped checkpoint.

    python benchmarks/step.py [--steps 2] [--compare-to /path/to/another/checkout]

A random Qwen3-architecture checkpoint with the real tokenizer (vocabulary 151,936, two layers of
width 64, 4 heads over 2 key/value heads of 16) trains ``--steps`` steps with
``python -m train.run --model-path ... --env search --prompts-per-step 2 --group-size 2`` and
otherwise default flags, as a new user's first command would; the table reads the run's own
``metrics.jsonl``: tokens/s of the rollout, scoring and update phases, their ratios to the
rollout's, and the wall time of each step. ``--compare-to`` runs the same command on another
checkout of the project (an older commit, say) in the same session, for a before/after table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = dict(
    vocab_size=151_936,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)


def write_checkpoint(folder: Path) -> None:
    """The random checkpoint, written by transformers (what a user would have), with the
    bundled tokenizer files beside it."""
    import torch
    import transformers

    from envs.chat import tokenizer_dir

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (folder / name).write_bytes((tokenizer_dir() / name).read_bytes())


def run(checkout: Path, folder: Path, steps: int) -> list[dict]:
    """The run's metrics.jsonl rows, run by ``checkout``'s code (in a fresh process)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "train.run", "--model-path", str(folder), "--env", "search",
            "--steps", str(steps), "--prompts-per-step", "2", "--group-size", "2",
            "--no-progress", "--eval-every", "0", "--run-dir", f"{tmp}/run",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{checkout}: train.run failed:\n{proc.stderr[-3000:]}")
        wall = time.perf_counter() - start
        rows = [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
        for r in rows:
            r["process_wall_s"] = wall
        return rows


def table(name: str, rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        step = sum(r[f"{p}_s"] for p in ("rollout", "scoring", "credit", "update"))
        roll = r["rollout_tok_s"]
        out.append(
            f"| {name} | {r['step']} | {r['tokens']:,} | {roll:,.0f} | {r['scoring_tok_s']:,.0f} "
            f"| {r['update_tok_s']:,.0f} | {r['scoring_tok_s'] / roll:.2f}x "
            f"| {r['update_tok_s'] / roll:.2f}x | {step:.1f} |"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--compare-to", help="another checkout of the project, run the same way")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        write_checkpoint(folder)
        results = {"this checkout": run(ROOT, folder, args.steps)}
        if args.compare_to:
            results[Path(args.compare_to).name] = run(Path(args.compare_to), folder, args.steps)
    print(
        "Qwen3-shaped random checkpoint (vocabulary 151,936, 2 layers, width 64), search, "
        "2 tasks x 2 rollouts, default flags otherwise; tokens/s per phase from metrics.jsonl"
    )
    print(
        "| code | step | tokens | rollout tok/s | scoring tok/s | update tok/s "
        "| scoring / rollout | update / rollout | step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        print("\n".join(table(name, rows)))


if __name__ == "__main__":
    main()
