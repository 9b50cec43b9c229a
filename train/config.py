"""Typed configuration of a training run, with named presets and a flag for every field.

    python -m train.run --preset mpo --env synthetic-nav --steps 200 --lr 3e-4

``TrainConfig`` is one flat dataclass (flags are its field names with dashes); ``--algo-set
beta=0.3`` overrides any field of the algorithm preset (``mpo_jax.algorithms.Algorithm``), and
``--env-set max_turns=8`` passes options to the environment. The resolved configuration is saved as
``config.json`` in the run directory; ``--config FILE`` reads one back (flags still win).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

__all__ = ["TrainConfig", "parse_args", "save_config"]


@dataclasses.dataclass
class TrainConfig:
    # What to train
    preset: str = "mpo"
    env: str = "synthetic-nav"
    model_path: str | None = None  # a Hugging Face Qwen3 folder; None: a tiny random model
    # The tiny random model (ignored with --model-path)
    layers: int = 2
    width: int = 64
    heads: int = 4
    kv_heads: int = 2
    # Parallelism: "data,fsdp,tensor" mesh shape over this host's devices ("": one device)
    mesh: str = ""
    # Rollouts
    steps: int = 400
    prompts_per_step: int = 64
    group_size: int = 4
    max_len: int = 48
    max_new_tokens: int = 0  # 0: the environment's turn length
    temperature: float = 1.0
    # Optimisation
    lr: float = 1e-3
    critic_lr: float = 2e-3
    warmup_steps: int = 10
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    entropy_coef: float = 0.0  # an entropy bonus on action tokens (0: none)
    epochs: int = 1
    minibatches: int = 2
    micro_batches: int = 1
    # Evaluation, checkpoints, logging
    eval_every: int = 100
    eval_episodes: int = 64
    eval_k: int = 4
    checkpoint_every: int = 25
    keep_checkpoints: int = 2
    run_dir: str = "runs/default"
    resume: bool = False
    seed: int = 0
    progress: bool = True
    algo_set: dict[str, Any] = dataclasses.field(default_factory=dict)
    env_set: dict[str, Any] = dataclasses.field(default_factory=dict)

    def mesh_shape(self) -> tuple[int, int, int] | None:
        if not self.mesh:
            return None
        parts = [int(x) for x in self.mesh.split(",")]
        if len(parts) != 3:
            raise ValueError(f"mesh: expected 'data,fsdp,tensor', got {self.mesh!r}")
        return tuple(parts)

    def __post_init__(self):
        if self.prompts_per_step < 1 or self.group_size < 1:
            raise ValueError("prompts_per_step and group_size must be >= 1")
        if self.minibatches < 1 or self.micro_batches < 1 or self.epochs < 1:
            raise ValueError("epochs, minibatches and micro_batches must be >= 1")
        rollouts = self.prompts_per_step * self.group_size
        if rollouts % (self.minibatches * self.micro_batches):
            raise ValueError(
                f"prompts_per_step x group_size = {rollouts} is not divisible by minibatches x "
                f"micro_batches = {self.minibatches * self.micro_batches}"
            )


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _key_values(items: list[str] | None, flag: str) -> dict[str, Any]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"{flag}: expected KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        out[key] = _parse_value(value)
    return out


def _base_type(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Flags for every field of :class:`TrainConfig` (plus ``--config FILE``)."""
    parser = argparse.ArgumentParser(prog="python -m train.run", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a config.json to start from (flags override it)")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        if f.name in ("algo_set", "env_set"):
            parser.add_argument(flag, nargs="*", metavar="KEY=VALUE", default=None)
        elif tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=tp, default=None)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if args.config:
        values.update(json.loads(Path(args.config).read_text()))
    for f in dataclasses.fields(TrainConfig):
        given = getattr(args, f.name)
        if given is None:
            continue
        if f.name in ("algo_set", "env_set"):
            given = {**values.get(f.name, {}), **_key_values(given, f.name)}
        values[f.name] = given
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SystemExit(f"config: unknown field(s) {unknown}")
    return TrainConfig(**values)


def save_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True))
