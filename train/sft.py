"""Supervised fine-tuning: a warm start for RL, with the trainer's model, checkpoints and metrics.

    python -m train.sft --env synthetic-calls --demo-noise 0.3 --run-dir runs/sft
    python -m train.sft --data chats.jsonl --model-path /path/to/Qwen3 --env search --run-dir ...
    python -m train.run --init-from runs/sft ...     # RL from it; it is also the reference model

Data, as token ids exactly as RL will see them (the environment's codec, never re-rendered):

* demonstrations (default): episodes of the environment's scripted policy played through the
  rollout loop; with ``--demo-noise ε`` each turn goes wrong with probability ε (the
  environment's own ``demo_turn(rng, noise)`` where it has one, else random words instead of the
  scripted turn), so that the warm-started policy succeeds only sometimes, as a pretrained one
  does. The held-out set is the environment's ``--eval-split`` (default ``test``).
* ``--data FILE.jsonl``: one conversation a line, ``{"messages": [...], "tools": [...]}`` in the
  chat format of the chat environments (system, user, assistant, tool messages; an assistant
  message's ``tool_calls`` become ``<tool_call>`` blocks). The messages before the first
  assistant message are the prompt, each assistant message is trained on (its end-of-turn token
  included), tool and user messages are observations. ``--val-fraction`` of the lines are held out.

Loss: mean negative log-likelihood of the assistant tokens alone. Batches: ``--batch-size`` rows
padded to the longest, or ``--pack`` conversations packed into rows of ``--max-len`` tokens
(positions restart and attention stays inside each conversation). Every ``--eval-every`` steps:
``held_out_loss`` and, with an environment, the policy's held-out success (the trainer's own
evaluation). Checkpoints are orbax's (resumable: ``--resume --run-dir``; the batches are a
function of the seed and the step, so a resumed run ends where an uninterrupted one does);
``metrics.jsonl``, TensorBoard and ``train.plot`` as for ``train.run``. ``config.json`` holds the
model and environment as ``train.run`` fields (``train.export``, ``train.evaluate`` and
``--init-from`` read it) and the settings of this command under ``"sft"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import envs
from envs.chat import format_tool_call
from envs.rollout import collect
from envs.scripted import ScriptedPolicy, oracle_act
from envs.strategies import PLAYERS, game_family
from kernels.logprobs import logprobs_and_entropy
from mpo_jax.batch import padded_length
from train.core.build import compute_dtype, initial_actor, model_config, run_codec
from train.core.checkpoint import Checkpoints
from train.core.config import (
    HELP,
    TrainConfig,
    differing_flags,
    resume_values,
    resumed_changes,
)
from train.core.episodes import EVAL_STREAM, fit_tasks, length_budget, sampling_key
from train.core.evaluation import (
    EvaluationFailed,
    evaluate_after_save,
    evaluate_set,
    evaluation_due,
    evaluation_pending,
)
from train.core.learner import make_optimizer
from train.core.metrics import MetricsLog
from train.core.preflight import check_split_draws
from train.core.roles import build_roles, check_resumed_base
from train.core.trackers import check_loggers
from train.engine.sampler import Sampler
from train.model.lora import bind

__all__ = ["SFTConfig", "Examples", "main", "demonstrations", "conversations", "pack"]


@dataclasses.dataclass
class SFTConfig:
    """This command's own settings (the model, environment and optimiser are train.run's)."""

    data: str | None = None
    demos: int = 1024
    demo_noise: float = 0.0
    demo_player: str = ""
    val_demos: int = 128
    val_fraction: float = 0.1
    batch_size: int = 16
    pack: bool = False


SFT_HELP = {
    "data": "a JSONL of chat conversations (default: demonstrations of --env's scripted policy)",
    "demos": "demonstration episodes to train on",
    "demo_noise": "probability that a demonstration turn goes wrong (the warm start's "
    "imperfection)",
    "demo_player": "the scripted player of a TextArena game whose demonstrations the warm start "
    "learns (envs.strategies; random_distinct, random_valid, accept_random: the move format and "
    "no strategy); default: the environment's oracle",
    "val_demos": "held-out demonstration episodes (the environment's --eval-split)",
    "val_fraction": "share of a --data file's conversations held out",
    "batch_size": "rows a step",
    "pack": "pack conversations into rows of --max-len tokens instead of padding each row",
}
# train.run fields this command takes (the rest of TrainConfig keeps its defaults)
RUN_FIELDS = (
    "env", "env_set", "model_path", "init_from", "tokenizer_path", "enable_thinking", "layers",
    "width", "heads", "kv_heads", "param_dtype", "compute_dtype", "opt_dtype", "remat", "max_len",
    "lora_rank", "lora_alpha", "lora_targets",
    "max_new_tokens", "temperature", "lr", "warmup_steps", "grad_clip", "weight_decay", "steps",
    "eval_every", "eval_split", "eval_episodes", "eval_k", "checkpoint_every", "keep_checkpoints",
    "run_dir", "resume", "seed", "progress", "loggers", "tracker_project",
)  # fmt: skip
SFT_DEFAULTS = {"steps": 200, "eval_every": 50, "checkpoint_every": 50}
PRETRAINED_SFT_LR = 1e-5  # supervised fine-tuning of a pretrained model (RL's default is 1e-6)


@dataclasses.dataclass
class Examples:
    """Token rows with the mask of the tokens to train on (the assistant's), and for packed rows
    the column where each token's conversation starts."""

    tokens: np.ndarray  # [N, T] int32
    mask: np.ndarray  # [N, T] bool
    starts: np.ndarray | None = None  # [N, T] int32 (packed) or None


def _stack(rows: list[tuple[list[int], list[bool]]], width: int) -> Examples:
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, (ids, m) in enumerate(rows):
        tokens[i, : len(ids)] = ids
        mask[i, : len(m)] = m
    return Examples(tokens, mask)


def _noisy(act, codec, rng, noise):
    """A scripted turn replaced by random words with probability ``noise``."""
    words = [w for w in getattr(codec, "vocabulary", [])[1:] if not w.startswith("<")]

    def turn(env):
        text = act(env)
        if noise and rng.random() < noise and words:
            return " ".join(rng.choice(words, size=max(1, len(text.split()))))
        return text

    return turn


def demonstrations(
    cfg: TrainConfig, codec, *, split: str, n: int, noise: float, seed: int, player: str = ""
):
    """(Examples, success rate) of ``n`` scripted episodes of ``cfg.env`` on ``split``: the
    environment's oracle, or ``player`` (a scripted player of `envs.strategies`)."""
    options = {**cfg.env_set, "split": split}
    rng = np.random.default_rng(seed)
    rows, successes = [], []
    for lo in range(0, n, 256):
        batch_envs = [
            envs.make(cfg.env, seed=seed * 1_000_003 + i, **options)
            for i in range(lo, min(n, lo + 256))
        ]
        acts = []
        for i, env in enumerate(batch_envs):
            if player:
                move = demo_player(env, player)
                turn_rng = random.Random(seed * 1_000_003 + lo + i)
                acts.append(
                    lambda env=env, m=move, r=turn_rng: _noisy(
                        lambda e: m(e, r), codec, rng, noise
                    )(env)  # fmt: skip
                )
            elif hasattr(env, "demo_turn"):
                acts.append(lambda env=env: env.demo_turn(rng, noise))
            else:
                scripted = oracle_act(env)
                acts.append(
                    lambda env=env, s=scripted: _noisy(lambda e: s(), codec, rng, noise)(env)
                )
        probe = batch_envs[0]
        out = collect(
            batch_envs,
            codec,
            ScriptedPolicy(codec, lambda i, acts=acts: acts[i]()),
            group_ids=list(range(len(batch_envs))),
            max_len=cfg.max_len,
            max_new_tokens=cfg.max_new_tokens or probe.turn_budget or 256,
        )
        b = out.batch
        lengths = [ep["tokens"] for ep in out.episodes]
        rows += [(b.tokens[i, :n_].tolist(), b.loss_mask[i, :n_].tolist())
                 for i, n_ in enumerate(lengths)]  # fmt: skip
        successes += [ep["success"] for ep in out.episodes]
    width = padded_length(max(len(r[0]) for r in rows), cap=cfg.max_len)
    return _stack(rows, width), float(np.mean(successes))


def demo_player(env, name: str):
    """The named scripted player of ``env``'s game (`envs.strategies.PLAYERS`); a
    ``ValueError`` naming ``--demo-player`` and the game's players when it has none by that name."""
    game = getattr(env, "game_id", None)
    if game is None:
        raise ValueError(
            f"demo_player: only TextArena games have scripted players (envs.strategies); "
            f"{type(env).__name__} has none"
        )
    players = PLAYERS.get(game_family(game), {})
    if name not in players:
        raise ValueError(
            f"demo_player: {name!r} is not a player of {game} (its players: "
            f"{', '.join(players) or 'none'})"
        )
    return players[name]


def _conversation(record: dict, codec, where: str) -> tuple[list[int], list[bool]]:
    """One conversation's ids and trained-on mask, built as the rollout builds them."""
    messages, tools = record.get("messages"), record.get("tools")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    roles = [m.get("role") for m in messages]
    if "assistant" not in roles:
        raise ValueError(f"{where}: no assistant message to train on")
    first = roles.index("assistant")
    ids = codec.prompt(messages[:first], tools)
    mask = [False] * len(ids)
    pending_tools, pending_user = [], None
    for k, m in enumerate(messages[first:], start=first):
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant":
            if k > first:
                if pending_user is None and not pending_tools:
                    raise ValueError(f"{where}: messages[{k}]: two assistant turns in a row")
                obs = codec.observation_ids(pending_tools, pending_user)
                ids, mask = ids + obs, mask + [False] * len(obs)
                pending_tools, pending_user = [], None
            calls = [
                format_tool_call(c["function"]["name"], _arguments(c["function"]))
                for c in m.get("tool_calls") or []
            ]
            text = "\n".join([content, *calls]) if content else "\n".join(calls)
            turn = codec.encode(text) + list(codec.end_of_turn)
            ids, mask = ids + turn, mask + [True] * len(turn)
        elif role == "tool":
            if pending_user is not None:
                raise ValueError(f"{where}: messages[{k}]: a tool response after a user message")
            pending_tools.append(content)
        elif role == "user":
            if pending_user is not None:
                raise ValueError(f"{where}: messages[{k}]: two user messages in a row")
            pending_user = content
        else:
            raise ValueError(f"{where}: messages[{k}]: role {role!r} after the first assistant")
    return ids, mask


def _arguments(function: dict) -> dict:
    args = function.get("arguments", {})
    return json.loads(args) if isinstance(args, str) else args


def conversations(path: str, codec, *, max_len: int) -> tuple[list, int]:
    """(rows of (ids, mask), how many were longer than ``max_len`` and left out) of a JSONL."""
    rows, dropped = [], 0
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from e
        ids, mask = _conversation(record, codec, f"{path}:{n}")
        if len(ids) > max_len:
            dropped += 1
            continue
        rows.append((ids, mask))
    if not rows:
        raise ValueError(f"{path}: no conversation fits --max-len {max_len}")
    return rows, dropped


def pack(examples: Examples, width: int) -> Examples:
    """Examples packed into rows of ``width`` tokens, first fit by decreasing length; each
    token's ``starts`` is the column where its conversation starts."""
    lengths = (examples.mask | (examples.tokens != 0)).shape[1] - np.argmax(
        (examples.mask | (examples.tokens != 0))[:, ::-1], axis=1
    )
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        for b, free in enumerate(room):
            if free >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(width - n)
    tokens = np.zeros((len(bins), width), np.int32)
    mask = np.zeros((len(bins), width), bool)
    starts = np.zeros((len(bins), width), np.int32)
    for b, members in enumerate(bins):
        col = 0
        for i in members:
            n = int(lengths[i])
            tokens[b, col : col + n] = examples.tokens[i, :n]
            mask[b, col : col + n] = examples.mask[i, :n]
            starts[b, col:] = col
            col += n
    return Examples(tokens, mask, starts)


def _loss(graphdef, params, tokens, mask, starts):
    """(mean NLL of the masked tokens, their count); next-token log-probs of every position."""
    model = bind(graphdef, params)
    hidden = model.model(tokens, segment_starts=starts)
    weight, axis = model.lm_head()
    logp, _ = logprobs_and_entropy(hidden[:, :-1], weight, tokens[:, 1:], vocab_axis=axis)
    m = mask[:, 1:]
    count = jnp.maximum(jnp.sum(m), 1)
    return -jnp.sum(jnp.where(m, logp, 0)) / count, count


def _batch(examples: Examples, rows: np.ndarray):
    """The rows, narrowed to the padded length of their longest."""
    used = examples.mask[rows] | (examples.tokens[rows] != 0)
    longest = int((used.shape[1] - np.argmax(used[:, ::-1], axis=1)).max())
    width = padded_length(longest, cap=examples.tokens.shape[1])
    starts = None if examples.starts is None else jnp.asarray(examples.starts[rows, :width])
    return (
        jnp.asarray(examples.tokens[rows, :width]),
        jnp.asarray(examples.mask[rows, :width]),
        (starts),
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.sft", description=__doc__.split("\n")[0])
    defaults = {**dataclasses.asdict(TrainConfig()), **SFT_DEFAULTS}
    for name in RUN_FIELDS:
        flag, default = "--" + name.replace("_", "-"), defaults[name]
        text = HELP[name] + ("" if default is None else f" (default: {default!r})")
        if name in ("env_set",):
            p.add_argument(flag, nargs="*", metavar="KEY=VALUE", default=None, help=text)
        elif isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            kind = (
                type(default)
                if default is not None
                else (float if name in ("lr",) else int if name == "warmup_steps" else str)
            )
            p.add_argument(flag, type=kind, default=None, help=text)
    for f in dataclasses.fields(SFTConfig):
        flag = "--" + f.name.replace("_", "-")
        text = f"{SFT_HELP[f.name]} (default: {f.default!r})"
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(flag, type=kind, default=None, help=text)
    return p


def parse(argv) -> tuple[TrainConfig, SFTConfig]:
    args = vars(_parser().parse_args(argv))
    given = {k: v for k, v in args.items() if v is not None}
    if given.get("resume"):
        path = Path(given.get("run_dir", TrainConfig.run_dir)) / "config.json"
        if not path.exists():
            raise SystemExit(f"--resume: {path} does not exist (start without --resume)")
        sft = json.loads(path.read_text())["sft"]
        changed = differing_flags({k: v for k, v in given.items() if k in SFT_HELP}, sft)
        if changed:
            raise SystemExit(f"--resume: {', '.join(changed)} differ from {path}; a resumed "
                             "warm start keeps its data")  # fmt: skip
        # the run's fields as train.run resumes them: only RESUMABLE ones may change
        run = resume_values({k: v for k, v in given.items() if k not in SFT_HELP})
        return TrainConfig(**run), SFTConfig(**sft)
    sets = {}
    for item in given.pop("env_set", []) or []:
        key, _, value = item.partition("=")
        try:
            sets[key] = json.loads(value)
        except json.JSONDecodeError:
            sets[key] = value
    run = {**SFT_DEFAULTS, **{k: v for k, v in given.items() if k in RUN_FIELDS}}
    if sets:
        run["env_set"] = sets
    if "lr" not in run and (run.get("model_path") or run.get("init_from")):
        run["lr"] = PRETRAINED_SFT_LR
    sft = {k: v for k, v in given.items() if k in SFT_HELP}
    return TrainConfig(**run), SFTConfig(**sft)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, sft = parse(argv)
    except ValueError as e:  # a field's rule (TrainConfig names the field)
        print(f"refused (nothing was written): {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    if not cfg.resume and (run_dir / "config.json").exists():
        print(f"{run_dir} holds a run; pass --resume or choose another --run-dir", file=sys.stderr)
        return 2
    try:
        check_loggers(cfg.loggers)
        state = setup(cfg, sft)
    except (ValueError, FileNotFoundError) as e:
        print(f"refused (nothing was written): {e}", file=sys.stderr)
        return 2
    cfg = state["cfg"]
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    if not cfg.resume:
        values = {**dataclasses.asdict(cfg), "resume": False, "sft": dataclasses.asdict(sft)}
    else:  # the stored run, with the resumable fields this invocation changed (if any)
        values = json.loads(path.read_text())
        values.update(resumed_changes(cfg, values))
    path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    return _train(cfg, sft, state, run_dir)


def setup(cfg: TrainConfig, sft: SFTConfig) -> dict[str, Any]:
    """The codec, model, optimizer and data of a run (everything checked; nothing written)."""
    cfg = dataclasses.replace(cfg, compute_dtype=compute_dtype(cfg.compute_dtype))
    probe = envs.make(cfg.env, seed=0, **{**cfg.env_set, "split": "train"})
    codec = run_codec(cfg, probe)
    mc = model_config(cfg, codec)
    if hasattr(codec, "check_vocabulary"):
        codec.check_vocabulary(mc.vocab_size)
    cfg = dataclasses.replace(
        cfg, max_len=length_budget(cfg.max_len, probe, codec, name=cfg.env, say=print)
    )
    if not 0 <= sft.demo_noise <= 1:
        raise ValueError(f"demo_noise: must be in [0, 1], got {sft.demo_noise}")
    held_out = {**cfg.env_set, "split": cfg.eval_split}
    if not sft.data or (cfg.eval_every and cfg.eval_episodes):  # plays the split later: draw now
        check_split_draws(cfg.env, held_out, flag="--eval-split")
    out: dict[str, Any] = {"cfg": cfg, "codec": codec, "probe": probe}
    if sft.data:
        rows, dropped = conversations(sft.data, codec, max_len=cfg.max_len)
        if dropped:
            print(f"{sft.data}: {dropped} conversation(s) longer than --max-len left out")
        held = max(1, int(round(len(rows) * sft.val_fraction))) if len(rows) > 1 else 0
        order = np.random.default_rng(cfg.seed).permutation(len(rows))
        width = padded_length(max(len(r[0]) for r in rows), cap=cfg.max_len)
        out["val"] = _stack([rows[i] for i in order[:held]], width) if held else None
        out["train"] = _stack([rows[i] for i in order[held:]], width)
        out["demo_success"] = None
    else:
        fit_tasks(probe, codec, {"split": "train"}, name=cfg.env, max_len=cfg.max_len,
                  max_new_tokens=cfg.max_new_tokens or probe.turn_budget or 256, drop=False,
                  say=print)  # fmt: skip
        if sft.demo_player:
            demo_player(probe, sft.demo_player)  # refused here, before anything runs
        out["train"], out["demo_success"] = demonstrations(
            cfg, codec, split="train", n=sft.demos, noise=sft.demo_noise, seed=cfg.seed,
            player=sft.demo_player,
        )  # fmt: skip
        out["val"], _ = demonstrations(
            cfg, codec, split=cfg.eval_split, n=sft.val_demos, noise=sft.demo_noise,
            seed=cfg.seed + 1, player=sft.demo_player,
        )  # fmt: skip
    if sft.pack:
        out["train"] = pack(out["train"], cfg.max_len)
    actor = initial_actor(cfg, mc)
    roles = build_roles(cfg, actor, needs_critic=False, needs_reference=False, place=lambda x: x)
    if cfg.resume:  # refused here, before anything is written, not after the first batch
        check_resumed_base(roles, Path(cfg.run_dir) / "checkpoints")
    out["roles"], out["graphdef"], out["params"] = roles, roles.actor_def, roles.trainable["actor"]
    out["tx"] = make_optimizer(
        cfg.lr, warmup_steps=cfg.warmup_steps, clip=cfg.grad_clip, weight_decay=cfg.weight_decay
    )
    out["opt"] = jax.jit(out["tx"].init)(out["params"])
    out["model"] = actor
    return out


def make_update(s: dict):
    """One SFT step of a run set up by `setup`, unjitted: gradient of the masked mean NLL
    ``-sum(mask * log p(token)) / sum(mask)`` with respect to what trains (LoRA: the adapters).

    ``update(params, opt, tokens, mask, starts) -> (params, opt, loss, count, grad norm)``.
    """
    graphdef, roles, tx = s["graphdef"], s["roles"], s["tx"]

    def update(params, opt, tokens, mask, starts):
        (loss, count), grads = jax.value_and_grad(
            lambda p: _loss(graphdef, roles.params("actor", p), tokens, mask, starts),
            has_aux=True,
        )(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss, count, optax.tree.norm(grads)

    return update


def _train(cfg: TrainConfig, sft: SFTConfig, s: dict, run_dir: Path) -> int:
    graphdef = s["graphdef"]
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    roles = s["roles"]
    state = {"actor": s["params"], "actor_opt": s["opt"], "step": 0}
    if roles.lora:
        state["base"] = roles.base  # a checkpoint names its base
    if checkpoints.latest() is not None:
        state = checkpoints.restore(state)
    start = int(state["step"])
    loss_fn = jax.jit(_loss, static_argnums=0)
    update = jax.jit(make_update(s))

    train, val = s["train"], s["val"]
    sampler = None

    def held_out(steps_done: int) -> dict[str, float]:
        """The policy's held-out success (the trainer's own evaluation)."""
        nonlocal sampler
        if sampler is None:
            sampler = Sampler(s["model"], capacity=cfg.max_len)
        sampler.state = roles.sampling(state["actor"])
        figures, _ = evaluate_set(
            "heldout",
            env=cfg.env,
            options={**cfg.env_set, "split": cfg.eval_split},
            codec=s["codec"],
            sampler=sampler,
            seed=cfg.seed,
            episodes=cfg.eval_episodes,
            k=cfg.eval_k,
            max_len=cfg.max_len,
            max_new_tokens=cfg.max_new_tokens or s["probe"].turn_budget or 256,
            temperature=cfg.temperature,
            key=sampling_key(cfg.seed, EVAL_STREAM, steps_done * 2, 0),
        )
        return figures

    due_at_start = evaluation_due(start, cfg.eval_every, cfg.steps) and cfg.eval_episodes > 0
    pending = evaluation_pending(run_dir, start, due_at_start)
    log = MetricsLog.of_run(run_dir, cfg, start_step=start)
    try:
        if pending:
            evaluate_after_save(partial(held_out, start), step=start, run_dir=run_dir, log=log)
        for step in range(start, cfg.steps):
            rows = np.random.default_rng([cfg.seed, step]).choice(
                len(train.tokens), size=min(sft.batch_size, len(train.tokens)), replace=False
            )
            tokens, mask, starts = _batch(train, rows)
            state["actor"], state["actor_opt"], loss, count, norm = update(
                state["actor"], state["actor_opt"], tokens, mask, starts
            )
            metrics = {
                "step": step + 1,
                "loss": float(loss),
                "tokens": int(count),
                "grad_norm": float(norm),
            }
            if step == start and s["demo_success"] is not None:
                metrics["demo_success_rate"] = s["demo_success"]
            due = evaluation_due(step + 1, cfg.eval_every, cfg.steps)
            if due and val is not None:
                losses, counts = [], []
                for lo in range(0, len(val.tokens), sft.batch_size):
                    chunk = np.arange(lo, min(len(val.tokens), lo + sft.batch_size))
                    vt, vm, vs = _batch(val, chunk)
                    params = roles.params("actor", state["actor"])
                    value, n = loss_fn(graphdef, params, vt, vm, vs)
                    losses.append(float(value) * float(n))
                    counts.append(float(n))
                metrics["held_out_loss"] = sum(losses) / max(sum(counts), 1.0)
            state["step"] = step + 1
            log.write(metrics)
            evaluate = bool(due and cfg.eval_episodes)
            if evaluate or (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                checkpoints.save(step + 1, state)
                log.flush()
            if evaluate:  # after the step is saved: a failure here loses no training
                checkpoints.wait()
                run = partial(held_out, step + 1)
                evaluate_after_save(run, step=step + 1, run_dir=run_dir, log=log)
    except EvaluationFailed as e:
        print(f"stopped: {e}; continue with python -m train.sft --resume --run-dir {run_dir}",
              file=sys.stderr)  # fmt: skip
        return 1
    finally:
        checkpoints.wait()
        log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
