"""Typed configuration of a training run, with named presets and a flag for every field.

    python -m train.run --preset mpo --env synthetic-nav --steps 200 --lr 3e-4

``TrainConfig`` is one flat dataclass (flags are its field names with dashes, each with the help
string of `HELP`); ``--algo-set beta=0.3`` overrides any field of the algorithm preset
(``mpo_jax.algorithms.Algorithm``), and ``--env-set max_turns=8`` passes options to the
environment. The resolved configuration is saved as ``config.json`` in the run directory (with the
resolved algorithm beside it, for reading); ``--config FILE`` reads one back (flags still win).

``--resume`` starts from the run directory's own ``config.json``: a flag given beside it that
differs from the run's value is refused, naming the field, except the fields of `RESUMABLE`
(how long to run and how often to evaluate, checkpoint and show progress), which may change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from envs.chat import TOOL_FALLBACKS
from train.core.trackers import DEFAULT_LOGGERS, parse_loggers
from train.engine.rollouts import EngineSettings
from train.engine.servers import BACKENDS
from train.engine.weight_sync import PUSH_MODES
from train.model.lora import LORA_TARGETS
from train.model.sharding import MeshShape

__all__ = [
    "TrainConfig",
    "TINY_DEFAULTS",
    "PRETRAINED_DEFAULTS",
    "HELP",
    "RESUMABLE",
    "parse_args",
    "save_config",
    "read_run_config",
    "resume_values",
    "differing_flags",
    "resumed_changes",
    "check_mesh_fit",
]


# Fields that may differ from the run's config.json on --resume (they change no computed number).
RESUMABLE = (
    "steps",
    "remat",  # what the backward pass keeps: memory, not the gradients (tests/test_memory.py)
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "progress",
    "device_memory",
    "worker_timeout",
    "rollout_url",
    "rollout_timeout",
    "loggers",
    "tracker_project",
)


# Optimisation defaults: for the tiny random model of the default run, and for a pretrained
# checkpoint (--model-path / --init-from), where the tiny model's rates would wreck the weights in
# a few updates. Pretrained: the learning rates of verl's and OpenRLHF's PPO recipes for 0.5B-8B
# models (actor 1e-6, critic 1e-5), no entropy bonus (a pretrained policy's entropy is not
# collapsing at the start), and a 20-step warmup while the fresh value head settles.
TINY_DEFAULTS = {"lr": 1e-3, "critic_lr": 2e-3, "entropy_coef": 0.02, "warmup_steps": 10}
PRETRAINED_DEFAULTS = {"lr": 1e-6, "critic_lr": 1e-5, "entropy_coef": 0.0, "warmup_steps": 20}
DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full", "dots")


@dataclasses.dataclass
class TrainConfig:
    # What to train
    preset: str = "mpo"
    env: str = "synthetic-nav"
    model_path: str | None = None
    init_from: str | None = None
    tokenizer_path: str | None = None
    enable_thinking: bool = False
    tool_fallback: str = "system"
    critic_from: str | None = None
    # The tiny random model (ignored with --model-path)
    layers: int = 2
    width: int = 64
    heads: int = 4
    kv_heads: int = 2
    # Precision and memory
    param_dtype: str = "float32"
    compute_dtype: str = "auto"
    opt_dtype: str = "float32"
    remat: str = "none"
    device_memory: float = 0.0
    # LoRA (train/model/lora.py): 0 = full fine-tuning
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: str = "all"
    # Parallelism
    mesh: str = ""
    # Rollouts
    steps: int = 400
    prompts_per_step: int = 64
    group_size: int = 4
    max_len: int = 0
    max_new_tokens: int = 0
    drop_long_tasks: bool = False
    temperature: float = 1.0
    # The rollout engine (train.engine.rollouts)
    engine: str = "continuous"
    slots: int = 0
    decode_chunk: int = 0
    decode_refill: float = EngineSettings.decode_refill
    env_workers: int = 0
    env_timeout: float = 0.0
    # Generation on inference servers (train.engine.servers)
    rollout_backend: str = "jax"
    rollout_url: str = ""
    rollout_concurrency: int = 0
    rollout_timeout: float = 600.0
    rollout_weights_dir: str = ""
    rollout_weights_dtype: str = "bfloat16"
    rollout_push: str = "auto"
    # Asynchronous rollouts and the off-policy correction
    max_staleness: int = 0
    is_level: str = "token"
    is_reduce: str = "sum"
    is_cap: float = 2.0
    is_mask: float = 0.0
    worker_timeout: float = 1800.0
    # Optimisation (None: TINY_DEFAULTS, or PRETRAINED_DEFAULTS with a checkpoint)
    lr: float | None = None
    critic_lr: float | None = None
    warmup_steps: int | None = None
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    entropy_coef: float | None = None
    epochs: int = 1
    minibatches: int = 2
    micro_batches: int = 1
    micro_batch_tokens: int = 0
    # Evaluation, checkpoints, logging
    eval_every: int = 100
    eval_episodes: int = 64
    eval_k: int = 4
    eval_split: str = "test"
    eval_env_set: dict[str, Any] = dataclasses.field(default_factory=dict)
    log_ref_kl: bool = True
    validate_batches: bool = False
    checkpoint_every: int = 25
    keep_checkpoints: int = 2
    run_dir: str = "runs/default"
    resume: bool = False
    seed: int = 0
    progress: bool = True
    loggers: str = DEFAULT_LOGGERS
    tracker_project: str = "mpo-jax"
    algo_set: dict[str, Any] = dataclasses.field(default_factory=dict)
    env_set: dict[str, Any] = dataclasses.field(default_factory=dict)

    def mesh_shape(self) -> MeshShape | None:
        """``--mesh`` as a `MeshShape` (None: no mesh). Three sizes ``data,fsdp,tensor`` or four,
        ``data,fsdp,tensor,context``; data may be -1 (what the others leave)."""
        if not self.mesh:
            return None
        try:
            parts = tuple(int(x) for x in self.mesh.split(","))
        except ValueError:
            parts = ()
        if len(parts) not in (3, 4) or any(p == 0 or p < -1 for p in parts) or -1 in parts[1:]:
            raise ValueError(
                "mesh: expected 'data,fsdp,tensor' or 'data,fsdp,tensor,context' (three or four "
                f"positive sizes; data may be -1), got {self.mesh!r}"
            )
        return MeshShape(*parts)

    @property
    def micro_rows(self) -> int:
        """Rows of one micro-batch: the step's rollouts over minibatches x micro-batches."""
        return self.prompts_per_step * self.group_size // (self.minibatches * self.micro_batches)

    @property
    def pretrained(self) -> bool:
        """Whether the run starts from a checkpoint (its optimisation defaults differ)."""
        return bool(self.model_path or self.init_from)

    def defaulted(self) -> dict[str, Any]:
        """The optimisation defaults this configuration takes (for fields left at None)."""
        table = PRETRAINED_DEFAULTS if self.pretrained else TINY_DEFAULTS
        return {k: v for k, v in table.items() if getattr(self, k) is None}

    def __post_init__(self):
        defaulted = self.defaulted()
        # which optimisation settings took a default (not a field: config.json records values)
        self.defaulted_fields = tuple(sorted(defaulted))
        for name, value in defaulted.items():
            setattr(self, name, value)
        parse_loggers(self.loggers)  # names only: whether they are installed is checked at start
        for name, valid in (
            ("param_dtype", DTYPES),
            ("opt_dtype", DTYPES),
            ("compute_dtype", (*DTYPES, "auto")),
            ("remat", REMAT),
            ("tool_fallback", TOOL_FALLBACKS),
            ("is_level", ("none", "token", "turn", "sequence")),
            ("is_reduce", ("sum", "mean")),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {valid}")
        positive = (
            "steps prompts_per_step group_size epochs minibatches micro_batches eval_k "
            "checkpoint_every keep_checkpoints layers width heads kv_heads"
        ).split()
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_len",
            "max_new_tokens",
            "warmup_steps",
            "eval_every",
            "eval_episodes",
            "max_staleness",
            "is_mask",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        self._check_lora()
        if self.eval_split not in ("train", "test", "all"):
            raise ValueError(
                f"eval_split: must be 'train', 'test' or 'all', got {self.eval_split!r}"
            )
        if not self.is_cap > 0:
            raise ValueError(f"is_cap: must be > 0, got {self.is_cap}")
        if self.is_mask and self.is_mask <= 1:
            raise ValueError(f"is_mask: must be 0 (off) or > 1, got {self.is_mask}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens: must be >= 0, got {self.micro_batch_tokens}")
        if self.micro_batch_tokens and self.micro_batches != 1:
            raise ValueError(
                "micro_batch_tokens: sizes micro-batches by tokens; leave --micro-batches at 1 "
                f"(got {self.micro_batches})"
            )
        rollouts = self.prompts_per_step * self.group_size
        if rollouts % (self.minibatches * self.micro_batches):
            raise ValueError(
                f"prompts_per_step x group_size = {rollouts} is not divisible by minibatches x "
                f"micro_batches = {self.minibatches * self.micro_batches}: change --minibatches, "
                "--micro-batches, --prompts-per-step or --group-size"
            )
        self.engine_settings()  # refuses bad engine settings, named
        self._check_rollout_backend()
        shape = self.mesh_shape()
        if shape is not None and shape.data != -1:
            check_mesh_fit(self, shape.data * shape.fsdp)

    def lora_target_names(self) -> tuple[str, ...]:
        """The projection names ``--lora-targets`` stands for (``all``, ``attention``, ``mlp``
        or a comma-separated list of `LORA_TARGETS`)."""
        groups = {"all": LORA_TARGETS, "attention": LORA_TARGETS[:4], "mlp": LORA_TARGETS[4:]}
        if self.lora_targets in groups:
            return groups[self.lora_targets]
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    def _check_lora(self) -> None:
        """A LoRA flag without a rank, a negative rank, an unknown projection name, or LoRA
        with a separately initialised critic: refused, naming the flag and the rule."""
        if self.lora_rank < 0:
            raise ValueError(
                f"lora_rank: must be >= 1 for LoRA or 0 for none, got {self.lora_rank}"
            )
        if not self.lora_rank:
            for name, default in (("lora_alpha", 0.0), ("lora_targets", "all")):
                if getattr(self, name) != default:
                    raise ValueError(f"{name}: a LoRA setting, but --lora-rank is 0 (full "
                                     "fine-tuning); pass --lora-rank R > 0")  # fmt: skip
            return
        if self.lora_alpha < 0:
            raise ValueError(
                f"lora_alpha: must be > 0 (or 0 for alpha = rank), got {self.lora_alpha}"
            )
        names = self.lora_target_names()
        wrong = [n for n in names if n not in LORA_TARGETS]
        if wrong or not names:
            raise ValueError(f"lora_targets: {wrong or 'none given'} not among all, attention, "
                             f"mlp or {list(LORA_TARGETS)}")  # fmt: skip
        if self.critic_from:
            raise ValueError(
                "critic_from: with --lora-rank the critic is the actor's frozen base plus its "
                "own adapters; a separate critic trunk is full fine-tuning"
            )

    def _check_rollout_backend(self) -> None:
        backends = ("jax", *BACKENDS)
        if self.rollout_backend not in backends:
            raise ValueError(f"rollout_backend: {self.rollout_backend!r} is not one of {backends}")
        if self.rollout_weights_dtype not in DTYPES:
            raise ValueError(
                f"rollout_weights_dtype: {self.rollout_weights_dtype!r} is not one of {DTYPES}"
            )
        if self.rollout_push not in PUSH_MODES:
            raise ValueError(f"rollout_push: {self.rollout_push!r} is not one of {PUSH_MODES}")
        if self.rollout_concurrency < 0:
            raise ValueError(f"rollout_concurrency: must be >= 0, got {self.rollout_concurrency}")
        if not self.rollout_timeout > 0:
            raise ValueError(f"rollout_timeout: must be > 0, got {self.rollout_timeout}")
        if self.rollout_backend == "jax":
            if self.rollout_url:
                raise ValueError(
                    "rollout_url: the jax backend samples in-process; name the server's kind "
                    "with --rollout-backend vllm or sglang"
                )
            return
        if not self.rollout_urls():
            raise ValueError(
                f"rollout_url: --rollout-backend {self.rollout_backend} needs the servers' "
                "URLs (--rollout-url http://host:port[,http://host2:port])"
            )
        for name in ("slots", "decode_chunk", "decode_refill", "env_workers", "env_timeout"):
            if getattr(self, name) != getattr(TrainConfig, name):  # off its default
                raise ValueError(
                    f"{name}: a setting of our own engine; with --rollout-backend "
                    f"{self.rollout_backend} the server batches (use --rollout-concurrency)"
                )

    def rollout_urls(self) -> list[str]:
        return [u.strip() for u in self.rollout_url.split(",") if u.strip()]

    def engine_settings(self) -> EngineSettings:
        """The rollout engine's settings (``--engine --slots --decode-chunk --decode-refill
        --env-workers --env-timeout``)."""
        return EngineSettings(
            engine=self.engine,
            slots=self.slots,
            decode_chunk=self.decode_chunk,
            decode_refill=self.decode_refill,
            env_workers=self.env_workers,
            env_timeout=self.env_timeout,
        )


def check_mesh_fit(cfg: TrainConfig, batch_ways: int, processes: int = 1) -> None:
    """Refuses a configuration whose batches do not divide over the mesh (named flags)."""
    if cfg.micro_rows % batch_ways:
        raise ValueError(
            f"mesh: a micro-batch of {cfg.micro_rows} rows (prompts_per_step x group_size / "
            f"(minibatches x micro_batches)) does not split over the {batch_ways} data-parallel "
            "devices (data x fsdp): change --mesh, --minibatches, --micro-batches, "
            "--prompts-per-step or --group-size"
        )
    if cfg.prompts_per_step % processes:
        raise ValueError(
            f"prompts_per_step: {cfg.prompts_per_step} tasks do not split over {processes} "
            "processes: change --prompts-per-step"
        )
    if cfg.eval_every and cfg.eval_episodes % processes:
        raise ValueError(
            f"eval_episodes: {cfg.eval_episodes} tasks do not split over {processes} processes: "
            "change --eval-episodes"
        )


HELP: dict[str, str] = {
    "preset": "algorithm preset of mpo_jax.algorithms (mpo, ppo, turn_ppo, grpo, ...)",
    "env": "environment name (envs.list_envs())",
    "model_path": "a Hugging Face Qwen3 folder to start from (default: a tiny random model); "
    "its tokenizer and chat template become the chat environments' format",
    "init_from": "start from this checkpoint instead: a Hugging Face folder (an export of "
    "train.export) or a run directory of train.run / train.sft (its latest actor); it is also the "
    "reference model",
    "tokenizer_path": "the tokenizer and chat template of the chat environments (default: the "
    "checkpoint's own, or the bundled Qwen3 one without a checkpoint)",
    "enable_thinking": "passed to the chat template (a hybrid Qwen3 template adds an empty "
    "<think></think> to generation prompts when off)",
    "tool_fallback": "a chat template that renders no tools (SmolLM2's): 'system' puts the tool "
    "schemas and the <tool_call> format into the system message (said at start-up), 'refuse' "
    "stops a run whose environment has tools",
    "critic_from": "initialise the critic's trunk from this Hugging Face folder (default: a copy "
    "of the policy's)",
    "param_dtype": f"parameters (master weights) dtype, one of {DTYPES}",
    "compute_dtype": "activations, matmul inputs and the sampler's KV cache: float32, bfloat16, "
    "or auto (bfloat16 on GPU/TPU, float32 on CPU)",
    "opt_dtype": f"optimizer moments dtype, one of {DTYPES}",
    "lora_rank": "LoRA adapters of this rank on one frozen base for the actor, the critic (plus "
    "its value head, trained in full) and the reference (the base, adapters off); 0: full "
    "fine-tuning",
    "lora_alpha": "LoRA's alpha: the adapters' output is scaled by alpha / rank (0: alpha = rank)",
    "lora_targets": f"the projections LoRA adapts: all, attention, mlp, or names among "
    f"{','.join(LORA_TARGETS)} (MoE experts and router are never adapted)",
    "remat": f"what each decoder layer keeps for the backward pass, one of {REMAT} (full: its "
    "input only; dots: matmul outputs)",
    "device_memory": "bytes a device holds, for the start-up memory plan (python -m train.plan): "
    "0 = the device's own limit on GPU/TPU and no check on the CPU; -1 = no check",
    "max_staleness": "K: the rollouts of step s may come from any policy version in [s-K, s] "
    "(a worker samples ahead of the learner); 0: the synchronous loop",
    "is_level": "span of the off-policy correction's truncated importance weight (proximal / "
    "behaviour) when --max-staleness > 0: token, turn, sequence or none",
    "is_reduce": "a turn's or sequence's log-ratio of the correction: sum (the span's likelihood "
    "ratio) or mean (length-normalised)",
    "is_cap": "truncate the correction's weights at this value",
    "is_mask": "drop (weight 0) the tokens of spans whose weight lies outside [1/M, M] (0: off)",
    "worker_timeout": "seconds the learner waits for the rollout worker's batch before it stops "
    "the run with an error naming what the worker was doing",
    "drop_long_tasks": "drop the tasks whose prompt plus one turn does not fit --max-len "
    "(counted at start-up) instead of refusing to start",
    "layers": "layers of the tiny random model",
    "width": "hidden width of the tiny random model",
    "heads": "attention heads of the tiny random model",
    "kv_heads": "key/value heads of the tiny random model",
    "mesh": "device mesh 'data,fsdp,tensor[,context]' over this host's devices ('': one device; "
    "data may be -1: what the others leave; context splits each row's tokens)",
    "steps": "training steps (may change on --resume)",
    "prompts_per_step": "tasks a step",
    "group_size": "rollouts per task (the GRPO-family groups)",
    "max_len": "token budget of an episode; 0: the environment's longest episode, or 8192 when "
    "it cannot say",
    "max_new_tokens": "tokens a turn; 0: the environment's turn length (256 if it has none)",
    "temperature": "sampling temperature of rollouts and evaluation",
    "lr": f"actor learning rate (AdamW); default {TINY_DEFAULTS['lr']}, "
    f"{PRETRAINED_DEFAULTS['lr']} from a checkpoint",
    "critic_lr": f"critic learning rate (AdamW); default {TINY_DEFAULTS['critic_lr']}, "
    f"{PRETRAINED_DEFAULTS['critic_lr']} from a checkpoint",
    "warmup_steps": "training steps of linear learning-rate warmup (0 or 1: none); default "
    f"{TINY_DEFAULTS['warmup_steps']}, {PRETRAINED_DEFAULTS['warmup_steps']} from a checkpoint",
    "grad_clip": "global gradient-norm clip",
    "weight_decay": "AdamW weight decay",
    "entropy_coef": f"entropy bonus on action tokens (0: none); default "
    f"{TINY_DEFAULTS['entropy_coef']}, {PRETRAINED_DEFAULTS['entropy_coef']} from a checkpoint",
    "epochs": "passes over a step's rollouts",
    "minibatches": "optimizer updates per epoch",
    "micro_batches": "gradient-accumulation parts of a minibatch",
    "engine": "how episodes are played: 'continuous' (slots, chunks of decode steps, "
    "environments answered between chunks; its defaults reproduce lockstep rounds bit for bit) "
    "or 'lockstep' (the reference loop: one generate call a round)",
    "slots": "decode rows of the continuous engine (0: one per episode); fewer bound the KV "
    "cache, and an episode waiting on its tool lends its slot to one waiting for a slot; auto: "
    "as the default, and the start-up memory plan lowers it where the cache does not fit",
    "decode_chunk": "decode steps between the continuous engine's host visits (0: a whole turn "
    "budget); short chunks admit answered episodes sooner",
    "decode_refill": "while episodes wait for a slot or an answer, end a decode chunk once this "
    "share of its live slots ended their turns (0 < r <= 1; 0: at the chunk's end), so freed "
    "slots are handed on sooner at the cost of more host visits; no effect where nothing waits",
    "env_workers": "threads stepping environments concurrently in the continuous engine (0: "
    "inline, in slot order; > 0 overlaps tools with decoding; each episode samples from its own "
    "random stream, so the tokens are the same either way)",
    "env_timeout": "seconds an environment may take to answer a turn before its episode ends "
    "(truncated, env_exception says so); needs --env-workers; 0: no limit",
    "rollout_backend": "what samples the rollouts: jax (our engine, in-process), vllm or sglang "
    "(servers at --rollout-url, sent token ids, given the learner's weights after each update)",
    "rollout_url": "the servers of --rollout-backend, comma-separated (replicas of one model; an "
    "episode stays on one; may change on --resume)",
    "rollout_concurrency": "episodes in flight at once on the servers (0: all of the step's)",
    "rollout_timeout": "seconds a server request may take before it is retried (may change on "
    "--resume)",
    "rollout_weights_dir": "where the learner writes the weights the servers reload (a path they "
    "read at the same name; default: RUN_DIR/rollout-weights)",
    "rollout_weights_dtype": f"dtype of the weights pushed to the servers, one of {DTYPES}",
    "rollout_push": "what a LoRA run pushes to the servers: auto (the adapters alone where the "
    "server loads them, vLLM started with --enable-lora; the merged weights otherwise), adapters "
    "(refuse a server that does not), merged (always the merge)",
    "micro_batch_tokens": "instead of --micro-batches: micro-batches (of the update and of "
    "scoring) of at most this many padded tokens, rows of similar length together (0: off); "
    "auto: off unless the start-up memory plan needs it, then a budget that fits (a power of two)",
    "eval_every": "evaluate every N steps and at the end (0: never; may change on --resume)",
    "eval_episodes": "held-out tasks an evaluation",
    "eval_k": "samples per evaluation task (pass@k)",
    "eval_split": "the environment split evaluation draws from (default 'test': tasks training "
    "never sees)",
    "eval_env_set": "environment options for evaluation only, KEY=VALUE (over --env-set)",
    "log_ref_kl": "score the reference model every step to log the KL to it (ref_kl), even "
    "when the preset has no KL term",
    "validate_batches": "check every scored batch with mpo_jax.batch.validate (names the field, "
    "row and rule a broken batch breaks; costs host time, for debugging environments)",
    "checkpoint_every": "checkpoint every N steps and at the end (may change on --resume)",
    "keep_checkpoints": "checkpoints kept (may change on --resume)",
    "run_dir": "the run directory: config.json, metrics.jsonl, tensorboard/, checkpoints/",
    "resume": "continue the run in --run-dir from its last checkpoint, with its config.json",
    "seed": "the run's seed (model init, tasks, sampling)",
    "progress": "show a progress bar (may change on --resume)",
    "loggers": "where the figures go, comma-separated: jsonl (always written: the run's record), "
    "tensorboard, wandb (offline without an API key), trackio (may change on --resume)",
    "tracker_project": "the W&B or Trackio project of the run (may change on --resume)",
    "algo_set": "override settings of the preset, KEY=VALUE (beta=0.3; family.field: critic.lam=1)",
    "env_set": "environment options, KEY=VALUE (e.g. max_turns=8)",
}

_DICT_FIELDS = ("algo_set", "env_set", "eval_env_set")


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


# Settings the start-up plan chooses where the defaults do not fit the device (train.plan.propose):
# ``auto`` leaves them to it, as leaving the flag out does.
AUTO_FIELDS = ("micro_batch_tokens", "slots")


def _int_or_auto(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.run", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a config.json to start from (flags override it)")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag, tp = _flag(f.name), _base_type(hints[f.name])
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        text = HELP[f.name] if default is None else f"{HELP[f.name]} (default: {default!r})"
        if f.name in _DICT_FIELDS:
            parser.add_argument(flag, nargs="*", metavar="KEY=VALUE", default=None, help=text)
        elif f.name in AUTO_FIELDS:
            parser.add_argument(flag, type=_int_or_auto, default=None, help=text)
        elif tp is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            parser.add_argument(flag, type=tp, default=None, help=text)
    return parser


def read_run_config(path: Path) -> dict[str, Any]:
    """A run's config.json as field values (the informational resolved algorithm dropped)."""
    values = json.loads(path.read_text())
    values.pop("algorithm", None)  # the resolved algorithm, written for reading
    values.pop("sft", None)  # a train.sft run's own settings beside its model and environment
    return values


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Flags for every field of [`TrainConfig`][train.core.config.TrainConfig] (plus ``--config
    FILE``); with ``--resume``, the run directory's ``config.json`` (see the module docstring)."""
    args = _parser().parse_args(argv)
    values: dict[str, Any] = {}
    if args.config:
        values.update(read_run_config(Path(args.config)))
    for f in dataclasses.fields(TrainConfig):
        given = getattr(args, f.name)
        if given is None:
            continue
        if f.name in _DICT_FIELDS:
            given = {**values.get(f.name, {}), **_key_values(given, _flag(f.name))}
        values[f.name] = given
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SystemExit(f"config: unknown field(s) {unknown}")
    given = sorted(values)
    if values.get("resume"):
        values = resume_values(values)
    cfg = TrainConfig(**values)
    cfg.given_fields = tuple(given)  # the flags (and --config values) the user gave
    return cfg


def differing_flags(
    given: dict[str, Any], stored: dict[str, Any], *, allowed: tuple[str, ...] = ()
) -> list[str]:
    """``--flag=value (the run has stored)`` for each given field outside ``allowed`` whose value
    differs from the run's: what a resume refuses."""
    return [
        f"{_flag(name)}={value!r} (the run has {stored.get(name)!r})"
        for name, value in sorted(given.items())
        if name not in allowed and value != stored.get(name)
    ]


def resumed_changes(cfg: TrainConfig, stored: dict[str, Any]) -> dict[str, Any]:
    """The `RESUMABLE` fields a resumed ``cfg`` changed against the run's stored config.json."""
    return {k: getattr(cfg, k) for k in RESUMABLE if stored.get(k) != getattr(cfg, k)}


def resume_values(given: dict[str, Any]) -> dict[str, Any]:
    """The run's own config.json, with the given values checked against it."""
    run_dir = given.get("run_dir", TrainConfig.run_dir)
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise SystemExit(
            f"--resume: {path} does not exist, so there is no run to resume in {run_dir} "
            "(start it without --resume)"
        )
    stored = read_run_config(path)
    conflicts = differing_flags(given, stored, allowed=("resume", "run_dir", *RESUMABLE))
    if conflicts:
        raise SystemExit(
            f"--resume: {', '.join(conflicts)} differ from {path}; a resumed run keeps its "
            f"configuration (only {', '.join(_flag(n) for n in RESUMABLE)} may change)"
        )
    changed = {k: v for k, v in given.items() if k in RESUMABLE}
    return {**stored, **changed, "resume": True, "run_dir": run_dir}


def save_config(cfg: TrainConfig, path: Path, *, algorithm: dict[str, Any] | None = None) -> None:
    """Writes the configuration (``resume`` is a property of the invocation, not the run, and is
    saved as False) and, for reading, the resolved algorithm."""
    values = {**dataclasses.asdict(cfg), "resume": False}
    if algorithm is not None:
        values["algorithm"] = algorithm
    path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
