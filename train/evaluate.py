"""Evaluate a checkpoint without training: held-out pass@1, pass@k and the environment's figures.

    python -m train.evaluate --model-path /path/to/Qwen3-folder --env search --episodes 64
    python -m train.evaluate --run-dir runs/x [--step N]          # a run's checkpoint
    python -m train.evaluate --model-path exported/ --env bfcl --split test --k 4

No optimizer, critic or reference model is built: the policy alone plays ``--episodes`` tasks of
``--split`` x ``--k`` samples through the same code as the trainer's evaluation
([`train.core.evaluation.evaluate_set`][train.core.evaluation.evaluate_set]), with the trainer's
task seeds and sampling keys (a run's checkpoint at step N is evaluated exactly as the run's own
evaluation at step N was). It prints the figures and writes ``metrics.json`` and
``transcripts.jsonl`` (every episode's conversation as text, its task, outcome and figures) to
``--out``. A user scores the base checkpoint before training and the exported one after, on the same
tasks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import envs
from train.core.build import (
    compute_dtype,
    initial_actor,
    model_config,
    restore_model,
    run_codec,
    run_config,
)
from train.core.checkpoint import Checkpoints
from train.core.config import TrainConfig
from train.core.episodes import EVAL_STREAM, fit_tasks, length_budget, sampling_key
from train.core.evaluation import evaluate_set
from train.core.preflight import check_split_draws
from train.engine.sampler import Sampler

__all__ = ["main", "evaluate"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", help="a Hugging Face folder (a checkpoint or an export)")
    src.add_argument("--run-dir", help="a run directory of train.run / train.sft")
    p.add_argument("--step", type=int, help="the run's checkpoint (default: the latest)")
    p.add_argument(
        "--adapter", help="a PEFT LoRA folder to evaluate on the --model-path base (merged)"
    )
    p.add_argument("--env", help="environment (default: the run's, or synthetic-nav)")
    p.add_argument("--env-set", nargs="*", default=[], metavar="KEY=VALUE", help="env options")
    p.add_argument("--split", default="test", help="the split to draw tasks from (default test)")
    p.add_argument("--episodes", type=int, default=32, help="tasks (default 32)")
    p.add_argument("--k", type=int, default=4, help="samples per task, for pass@k (default 4)")
    p.add_argument("--max-len", type=int, default=None, help="token budget (default: the run's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens a turn")
    p.add_argument("--temperature", type=float, default=None, help="default: the run's, or 1")
    p.add_argument("--tokenizer-path", help="the chat format's tokenizer (default: the model's)")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--compute-dtype", default=None, help="float32, bfloat16 or auto")
    p.add_argument("--drop-long-tasks", action="store_true", help="drop tasks that cannot fit")
    p.add_argument("--seed", type=int, default=None, help="task and sampling seed")
    p.add_argument("--engine", default=None, help="continuous or lockstep (default: the run's)")
    p.add_argument("--slots", type=int, default=None, help="decode rows (0: one per episode)")
    p.add_argument("--decode-chunk", type=int, default=None, help="decode steps a chunk")
    p.add_argument("--env-workers", type=int, default=None, help="environment threads")
    p.add_argument(
        "--out",
        help="where metrics.json and transcripts.jsonl go (default: evaluations/<model>-<game or "
        "env>-<split>, suffixed -2, -3... when taken; a given --out that holds results is refused)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a bar of episodes done and success so far (default: on)",
    )
    return p


def _config(args) -> tuple[TrainConfig, int]:
    """The run configuration the evaluation uses, and the step it evaluates (0 for a folder)."""
    sets = {}
    for item in args.env_set:
        key, _, value = item.partition("=")
        try:
            sets[key] = json.loads(value)
        except json.JSONDecodeError:
            sets[key] = value
    if args.run_dir:
        cfg = run_config(args.run_dir)
        latest = Checkpoints(Path(args.run_dir) / "checkpoints", create=False).latest()
        step = args.step if args.step is not None else latest
    else:
        cfg, step = TrainConfig(model_path=args.model_path, env=args.env or "synthetic-nav"), 0
    given = {
        "env": args.env,
        "max_len": args.max_len,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "tokenizer_path": args.tokenizer_path,
        "enable_thinking": args.enable_thinking,
        "compute_dtype": args.compute_dtype,
        "seed": args.seed,
        "engine": args.engine,
        "slots": args.slots,
        "decode_chunk": args.decode_chunk,
        "env_workers": args.env_workers,
    }
    changes = {k: v for k, v in given.items() if v is not None}
    if sets:
        changes["env_set"] = {**cfg.env_set, **sets}
    if "env" in changes and changes["env"] != cfg.env and "max_len" not in changes:
        changes["max_len"] = 0  # another environment: its own longest episode
    return dataclasses.replace(cfg, **changes), step


def evaluate(args) -> tuple[dict, list[dict], Path]:
    if args.adapter and args.run_dir:
        raise ValueError("--adapter: puts a PEFT folder on the --model-path base; a run's "
                         "checkpoint holds its own adapters already")  # fmt: skip
    cfg, step = _config(args)
    cfg = dataclasses.replace(cfg, compute_dtype=compute_dtype(cfg.compute_dtype))
    options = {**cfg.env_set, "split": args.split}
    probe = envs.make(cfg.env, seed=0, **options)
    check_split_draws(cfg.env, options, flag="--split")
    codec = run_codec(cfg, probe)
    mc = model_config(cfg, codec)
    if hasattr(codec, "check_vocabulary"):
        codec.check_vocabulary(mc.vocab_size)
    max_new = cfg.max_new_tokens or probe.turn_budget or 256

    def say(message):
        print(message, file=sys.stderr)

    max_len = length_budget(cfg.max_len, probe, codec, name=cfg.env, say=say)
    fit_tasks(
        probe,
        codec,
        options,
        name=cfg.env,
        max_len=max_len,
        max_new_tokens=max_new,
        drop=args.drop_long_tasks,
        say=say,
    )
    out = output_folder(args, cfg, step)
    model = restore_model(args.run_dir, mc, step=step) if args.run_dir else initial_actor(cfg, mc)
    if args.adapter:
        model = with_adapter(model, args.adapter)
    say(f"evaluating {args.episodes} tasks x {args.k} samples of {task_name(cfg)} ({args.split}) "
        f"into {out}")  # fmt: skip
    name = "heldout" if args.split == "test" else args.split
    metrics, records = evaluate_set(
        name,
        env=cfg.env,
        options=options,
        codec=codec,
        sampler=Sampler(model, capacity=max_len),
        seed=cfg.seed,
        episodes=args.episodes,
        k=args.k,
        max_len=max_len,
        max_new_tokens=max_new,
        temperature=cfg.temperature,
        key=sampling_key(cfg.seed, EVAL_STREAM, step * 2, 0),
        transcripts=True,
        engine=cfg.engine_settings(),
        progress=args.progress,
    )
    return metrics, records, out


def with_adapter(base_model, folder):
    """``base_model`` with a PEFT LoRA folder's adapters merged in (refused, naming the folder,
    when it was made for another base or architecture)."""
    from flax import nnx

    from train.core.build import trainable_like
    from train.model.lora import (
        check_targets,
        fingerprint,
        load_peft,
        lora_scale,
        merge_weights,
        peft_settings,
    )
    from train.model.qwen3 import Qwen3ForCausalLM

    rank, alpha, targets = peft_settings(folder)
    mc = dataclasses.replace(base_model.cfg, lora_rank=rank, lora_alpha=alpha)
    mc = dataclasses.replace(mc, lora_targets=check_targets(targets, mc))
    graphdef, base = nnx.split(base_model)
    like = trainable_like(Qwen3ForCausalLM, mc)
    adapters = load_peft(folder, like, mc, base_hash=fingerprint(base), flag="--adapter")
    return nnx.merge(graphdef, merge_weights(base, adapters, lora_scale(rank, alpha)))


def task_name(cfg: TrainConfig) -> str:
    """What the evaluation plays: the TextArena game (``TowerOfHanoi-v0``) or the environment."""
    game = cfg.env_set.get("game")
    return f"{cfg.env}-{game}" if game and cfg.env == "textarena" else cfg.env


def output_folder(args, cfg: TrainConfig, step: int) -> Path:
    """Where the results go, decided before the evaluation runs. A given ``--out`` that already
    holds a ``metrics.json`` is refused; the default folder (named for the model, the game or
    environment and the split) takes the first free suffix ``-2``, ``-3``... and says so."""
    if args.out:
        out = Path(args.out)
        if (out / "metrics.json").exists():
            raise ValueError(f"--out: {out} already holds an evaluation (metrics.json); choose "
                             "another folder or remove it")  # fmt: skip
        return out
    name = task_name(cfg)
    if args.run_dir:
        default = Path(args.run_dir) / "evaluations" / f"step{step}-{name}-{args.split}"
    else:
        default = Path("evaluations") / f"{Path(args.model_path).name}-{name}-{args.split}"
    out, n = default, 1
    while (out / "metrics.json").exists():
        n += 1
        out = default.with_name(f"{default.name}-{n}")
    if out != default:
        print(f"{default} holds an earlier evaluation: writing to {out}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        metrics, records, out = evaluate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with open(out / "transcripts.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")
    width = max(len(k) for k in metrics)
    for key, value in metrics.items():
        print(f"{key:<{width}}  {value:.4f}")
    print(f"wrote {out}/metrics.json and transcripts.jsonl ({len(records)} episodes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
