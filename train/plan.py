"""A memory plan before a single weight is read: each program of a run compiled on abstract shapes.

    python -m train.plan --model-path configs/qwen3-4b --max-len 16384 --mesh 1,8,1 \\
        --devices 8 --device-memory 141e9 [any train.run flag]

``--model-path`` needs only ``config.json`` (the tokenizer falls back to the bundled one). The
plan takes the trainer's own flags, builds the run's state as ``jax.ShapeDtypeStruct`` s placed
on the mesh (``--devices N`` fakes N devices on the CPU), compiles with XLA (``.lower(...)
.compile()``) every program the run executes at its worst-case shapes (``--max-len`` tokens a
row), and reads XLA's own memory analysis of each (arguments, outputs, temporaries, aliasing;
per device, as the SPMD program is partitioned). No weight is materialised.

Programs: the sampler's prefill chunk and decode loop (the KV cache of the step's rollout rows,
donated), scoring (one micro-batch through the actor, the critic and the reference), the actor's
and the critic's training micro-step (loss and gradients of one micro-batch at ``--remat``),
and the optimizer update (parameters and moments donated). The state a program does not take as
an argument is resident beside it (the other model's parameters and moments, the reference, the
gradient accumulator during an update) and is added to its peak. The last line reads
``peak per device: X GiB of Y GiB: fits`` (or ``: does not fit``, naming the flags that lower the
program that does not fit). ``train.run`` runs the same check at start-up on an accelerator (or
with ``--device-memory``) and refuses a plan that does not fit.

The memory analysis is the CPU compiler's: GPU and TPU compilers fuse and schedule differently,
so the figures are a plan, checked against a measured run in ``benchmarks/memory.py``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Plan",
    "Program",
    "Proposal",
    "make_plan",
    "propose",
    "micro_rows",
    "planned_dtype",
    "main",
    "device_memory",
    "devices_needed",
    "floor_settings",
    "way_out",
    "GIB",
]

GIB = 2**30


@dataclasses.dataclass
class Program:
    """One compiled program's memory per device: its own (arguments not resident elsewhere,
    outputs, temporaries, less aliasing) and the resident state beside it."""

    name: str
    own: int
    resident: int
    flags: str  # what to change when this program does not fit
    # the part of ``own`` that fsdp divides among more devices (the gradients a micro-step
    # writes, the moments an update rewrites, the decode rows' cache); the rest (one row's
    # activations) stays whatever the device count
    shardable: int = 0
    # the whole weights it reads, as stored: what fsdp would gather for it on a mesh that does
    # not shard them yet (0 where they are already sharded: ``own`` holds the gather)
    gathered: int = 0

    @property
    def peak(self) -> int:
        return self.own + self.resident

    def peak_on(self, k: int) -> float:
        """Its estimated peak with fsdp over k times the devices:
        ``(resident + shardable) / k + (own - shardable) + gathered`` (k > 1)."""
        if k == 1:
            return self.peak
        return (self.resident + self.shardable) / k + self.own - self.shardable + self.gathered


@dataclasses.dataclass
class Plan:
    """Per-device bytes of the state and of every program's peak; ``limit`` the device's."""

    devices: int
    state: dict[str, int]
    programs: list[Program]
    limit: int | None
    notes: list[str] = dataclasses.field(default_factory=list)  # what the plan assumed
    shape: str = ""  # the run's shape: rows, length, dtypes, remat, mesh
    max_len: int = 0  # the tokens a row the programs were compiled for
    batch_ways: int = 1  # devices a micro-batch's rows split over (data x fsdp)

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.programs)

    @property
    def resident_state(self) -> int:
        """Bytes a device holds whatever the program: weights and moments (not the sampler's
        cache nor the gradient accumulator, which come and go)."""
        return sum(v for k, v in self.state.items() if "(" not in k)

    @property
    def fits(self) -> bool:
        return self.limit is None or self.peak <= self.limit

    def worst(self) -> Program:
        return max(self.programs, key=lambda p: p.peak)

    def verdict(self) -> str:
        limit = "?" if self.limit is None else f"{self.limit / GIB:.2f}"
        fits = "fits" if self.fits else "does not fit"
        return f"peak per device: {self.peak / GIB:.2f} GiB of {limit} GiB: {fits}"

    def table(self) -> str:
        lines = [f"run: {self.shape}", ""] if self.shape else []
        lines += [f"per device ({self.devices} device(s)), GiB", "", "| state | GiB |", "|---|---|"]
        lines += [f"| {k} | {v / GIB:.3f} |" for k, v in self.state.items()]
        lines += ["", "| program | own | resident beside it | peak |", "|---|---|---|---|"]
        for p in self.programs:
            lines.append(
                f"| {p.name} | {p.own / GIB:.3f} | {p.resident / GIB:.3f} | {p.peak / GIB:.3f} |"
            )
        if self.notes:
            lines += [""] + [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def refusal(self) -> str:
        worst = self.worst()
        return (
            f"the memory plan does not fit: {worst.name} needs {worst.peak / GIB:.2f} GiB a "
            f"device of {self.limit / GIB:.2f} GiB; change {worst.flags} (python -m train.plan "
            "with the same flags prints the whole plan)"
        )


def _bytes_per_device(tree) -> int:
    """Bytes of one device's shards of a pytree of (sharded) ShapeDtypeStructs or arrays."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.shape
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
    return total


def _adapted_kernels(base, adapters) -> list:
    """The base's kernels that adapters sit on (generation holds a merged copy of each)."""
    from flax import nnx

    flat = dict(nnx.to_flat_state(base))
    return [
        flat[(*path[:-2], "kernel")].get_value()
        for path, _ in nnx.to_flat_state(adapters)
        if path[-1] == "lora_a"
    ]


def _abstract(tree, shardings=None):
    """ShapeDtypeStructs of a pytree (placed with ``shardings``, a matching pytree, if given)."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


# Compiled programs by their lowered text, most recent last: a proposal's search compiles again
# only the programs its change touched (a new --slots: the sampler's two), and the plans after
# it in this process reuse the rest.
_COMPILED: collections.OrderedDict[str, object] = collections.OrderedDict()
COMPILED_KEPT = 64


def _compile(lowered):
    """``lowered.compile()``, once per distinct program text in this process (the text holds
    the shapes, dtypes and shardings; the compiler and its flags are the process's own)."""
    key = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    compiled = _COMPILED[key] = lowered.compile()
    while len(_COMPILED) > COMPILED_KEPT:
        _COMPILED.popitem(last=False)
    return compiled


def _own(compiled, resident_args: int) -> int:
    """A compiled program's own bytes: arguments (less those resident anyway), outputs and
    temporaries, less what outputs alias of the arguments (donation)."""
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        - resident_args
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def planned_dtype(name: str, platform: str | None) -> str:
    """``--compute-dtype`` as the target platform resolves it (``auto``: bfloat16 on gpu and tpu,
    float32 on cpu); ``platform`` None: this process's backend."""
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    return "float32" if platform == "cpu" else "bfloat16"


def micro_rows(cfg, max_len: int, ways: int = 1) -> int:
    """Rows of the largest micro-batch at ``max_len`` tokens a row: ``--micro-batches``' equal
    split, or under ``--micro-batch-tokens N`` as many rows of that length as N holds (at least
    one; a multiple of the data-parallel ``ways``), as ``train.core.learner.token_budget_groups``
    packs them."""
    if not cfg.micro_batch_tokens:
        return cfg.micro_rows
    from mpo_jax.batch import padded_length

    width = padded_length(max_len)
    return max(ways, (max(1, cfg.micro_batch_tokens // width) // ways) * ways)


def device_memory() -> int | None:
    """The first local device's memory limit (GPU/TPU), or None where the runtime says none."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def make_plan(cfg, *, limit: int | None = None, platform: str | None = None):
    """The plan of ``cfg`` (a [`train.core.config.TrainConfig`][train.core.config.TrainConfig]) on
    this process's devices; ``platform`` (cpu, gpu, tpu; default this process's) resolves
    ``--compute-dtype auto``."""
    from flax import nnx

    import envs
    from mpo_jax import algorithms
    from train.core.build import lora_config, model_config, needs_reference, run_codec
    from train.core.learner import ActionRows, Models, UpdateFns, loss_fields, make_optimizer
    from train.core.scoring import Scorer
    from train.engine.sampler import (
        _decode_jit,
        _extend_jit,
        bucket,
        cache_sharding,
        cache_slots,
        splits_layers,
    )
    from train.model.lora import TRAINABLE, Adapted
    from train.model.qwen3 import KVCache, Qwen3ForCausalLM, Qwen3ValueModel
    from train.model.sharding import MeshShape, batch_sharding, batch_ways, param_shardings

    cfg = dataclasses.replace(cfg, compute_dtype=planned_dtype(cfg.compute_dtype, platform))
    algo = algorithms.get(cfg.preset, **cfg.algo_set)
    probe = envs.make(cfg.env, seed=0, **{"split": "train", **cfg.env_set})
    try:
        codec = run_codec(cfg, probe)
    except (ValueError, FileNotFoundError):  # a folder with config.json alone: the bundled one
        codec = run_codec(dataclasses.replace(cfg, model_path=None, init_from=None), probe)
    mc = model_config(cfg, codec)
    notes = []
    if mc.num_experts and jax.default_backend() == "cpu":
        # XLA's CPU compiler expands ragged_dot into every token through every expert; TPU and
        # cuDNN's grouped matmul do not: plan the experts as a grouped matmul (grouped_matmul).
        mc = dataclasses.replace(mc, moe_matmul="balanced")
        notes.append(
            f"MoE experts planned as a grouped matmul under balanced routing ({mc.num_experts} "
            f"experts, {mc.num_experts_per_tok} a token): the CPU compiler would expand "
            "ragged_dot through every expert; skewed routing needs more"
        )
    max_len = cfg.max_len or probe.max_episode_tokens(codec) or 8192
    max_new = cfg.max_new_tokens or probe.turn_budget or 256
    n = len(jax.devices())
    mesh = (cfg.mesh_shape() or MeshShape()).make()

    def compile_(fn, *args, **kwargs):
        with jax.set_mesh(mesh):  # as the trainer runs its device work: on the mesh
            return _compile(fn.lower(*args, **kwargs))

    def placed(model_cls):
        """(graphdef, parameters as ShapeDtypeStructs placed by the sharding rules)."""
        abstract = nnx.eval_shape(lambda: model_cls(mc, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        shardings = param_shardings(state, mesh)
        flat = [
            (
                path,
                var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=shardings[path])),
            )
            for path, var in nnx.to_flat_state(state)
        ]
        return graphdef, nnx.from_flat_state(flat)

    base_def, base = placed(Qwen3ForCausalLM)  # the policy as sampled (LoRA: the merged base)
    # trained: what the optimizer holds; read: what a loss or scoring reads (LoRA: Adapted)
    if cfg.lora_rank:
        mc = lora_config(cfg, mc)
        actor_def, actor_all = placed(Qwen3ForCausalLM)
        actor = nnx.state(actor_all, TRAINABLE)
        read = {"actor": Adapted(base, actor)}
        critic_def = critic = None
        if algo.needs_critic:
            critic_def, critic_all = placed(Qwen3ValueModel)
            critic = nnx.state(critic_all, TRAINABLE)
            read["critic"] = Adapted(nnx.State({"model": base["model"]}), critic)
    else:
        actor_def, actor = base_def, base
        critic_def, critic = placed(Qwen3ValueModel) if algo.needs_critic else (None, None)
        read = {"actor": actor, "critic": critic}
    opt = dict(warmup_steps=cfg.warmup_steps, clip=cfg.grad_clip, weight_decay=cfg.weight_decay)
    fns = UpdateFns(
        Models(actor_def, critic_def),
        algo,
        make_optimizer(cfg.lr, **opt),
        make_optimizer(cfg.critic_lr, **opt),
        temperature=cfg.temperature,
        entropy_coef=cfg.entropy_coef,
        opt_dtype=jnp.dtype(cfg.opt_dtype),
    )
    models = {"actor": actor} | ({"critic": critic} if critic is not None else {})
    opts = {}
    replicated = jax.sharding.NamedSharding(mesh, jax.P())

    def on_mesh(sharding):  # scalars of the state come back on one device: replicate them
        return sharding if set(sharding.device_set) == set(mesh.devices.flat) else replicated

    for which, params in models.items():
        init = compile_(fns.init_fn(which, params), params)
        shardings = jax.tree.map(on_mesh, init.output_shardings)
        opts[which] = _abstract(init.out_info, shardings)

    state = {}
    if cfg.lora_rank:  # one frozen base: the actor's, the critic's trunk and the reference
        state["base parameters (frozen: actor, critic trunk, reference)"] = _bytes_per_device(base)
    state["actor adapters" if cfg.lora_rank else "actor parameters"] = _bytes_per_device(actor)
    state["actor optimizer state"] = _bytes_per_device(opts["actor"])
    if critic is not None:
        name = "critic adapters and value head" if cfg.lora_rank else "critic parameters"
        state[name] = _bytes_per_device(critic)
        state["critic optimizer state"] = _bytes_per_device(opts["critic"])
    if needs_reference(cfg, algo) and not cfg.lora_rank:
        state["reference parameters"] = state["actor parameters"]
    resident = sum(state.values())
    episodes = cfg.prompts_per_step * cfg.group_size // jax.process_count()
    # the engine's decode slots (one per episode unless --slots says fewer)
    rows = min(cfg.slots, episodes) if cfg.slots and cfg.engine == "continuous" else episodes
    slots = cache_slots(max_len)
    cache_shard = cache_sharding(mc, rows, mesh)
    cache_shape = jax.eval_shape(lambda: KVCache.empty(mc, rows, slots))
    cache = _abstract(cache_shape, KVCache(cache_shard, cache_shard))
    state["sampler KV cache (rollouts only)"] = _bytes_per_device(cache)
    grads = _bytes_per_device(actor)
    state["gradient accumulator (updates only)"] = grads

    def host(shape, dtype, sharded=False):
        spec = batch_sharding(mesh) if sharded else jax.sharding.NamedSharding(mesh, jax.P())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=spec)

    actor_bytes = _bytes_per_device(base)
    sampler_resident = resident
    if cfg.lora_rank:  # generation reads W + (alpha / r) A B: new arrays for the adapted kernels
        merged = _bytes_per_device(_adapted_kernels(base, actor))
        state["merged kernels for generation (rollouts only)"] = merged
        sampler_resident += merged
    if splits_layers(base, platform or jax.default_backend()):  # the sampler's own rule
        # the sampler's own copy of the weights, one array a layer (Sampler's split_layers)
        state["sampler weights, one array a layer (rollouts only)"] = actor_bytes
        sampler_resident += actor_bytes
    programs = []

    def gathered(params) -> int:
        """The whole weights as stored, unless fsdp shards them already: what an fsdp program
        gathers (Qwen3-8B at 32k: the eight-device plan's 94.9 GiB is matched by a whole
        float32 copy beside one device's activations, 97.5 estimated, not by a bfloat16 one,
        82.2)."""
        sharded = mesh.shape["fsdp"] * mesh.shape["context"] > 1
        return 0 if sharded else _bytes_per_device(_abstract(params))

    chunk = min(512, bucket(max_len))
    vocab = mc.vocab_size
    prefill = compile_(
        _extend_jit, base_def, base, cache, host((rows, chunk), jnp.int32),
        host((rows,), jnp.int32), host((rows,), jnp.int32), host((rows, vocab), jnp.float32),
    )  # fmt: skip
    rollout_flags = "--slots (decode rows), --max-len, --mesh"
    own = _own(prefill, actor_bytes)
    programs.append(
        Program("sampler prefill", own, sampler_resident, rollout_flags, own, gathered(base))
    )
    decode = compile_(
        _decode_jit, base_def, max_len, base, cache, host((rows,), jnp.int32),
        host((rows, vocab), jnp.float32), host((rows,), bool), host((rows,), jnp.int32),
        jax.random.key(0), max_new,
        cfg.temperature, 0, 1.0, (1,), jnp.int32(1),
    )  # fmt: skip
    own = _own(decode, actor_bytes)
    programs.append(
        Program("sampler decode", own, sampler_resident, rollout_flags, own, gathered(base))
    )

    micro = micro_rows(cfg, max_len, batch_ways(mesh))
    rows_spec = dict(sharded=micro % batch_ways(mesh) == 0)
    # the worst case: rows of --max-len tokens, every one of them an action token
    tokens = host((micro, max_len), jnp.int32, **rows_spec)
    positions = host((micro, max_len), jnp.int32, **rows_spec)
    scorer = Scorer(rows=micro, temperature=cfg.temperature)
    score_flags = "--micro-batch-tokens, --max-len, --mesh"
    logp = compile_(
        scorer._logp, actor_def, read["actor"], tokens, positions, temperature=cfg.temperature
    )
    own = _own(logp, _bytes_per_device(read["actor"]))
    programs.append(Program("scoring (actor)", own, resident, score_flags, 0, gathered(base)))
    if critic is not None:
        values = compile_(
            scorer._values, critic_def, read["critic"], tokens, positions,
            host((micro,), jnp.int32, **rows_spec),
        )  # fmt: skip
        own = _own(values, _bytes_per_device(read["critic"]))
        programs.append(
            Program("scoring (critic)", own, resident, score_flags, 0, gathered(read["critic"]))
        )

    dtypes = {"loss_mask": bool, "turn_ids": jnp.int32}
    batch = ActionRows(
        tokens=tokens,
        positions=positions,
        **{
            name: host((micro, max_len), dtypes.get(name, jnp.float32), **rows_spec)
            for name in ("loss_mask", "turn_ids", *loss_fields(algo))
        },
    )
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    train_flags = "--remat, --micro-batch-tokens, --max-len, --mesh (fsdp)"
    accumulate = grads if cfg.micro_batches > 1 or cfg.micro_batch_tokens else 0
    for which, grad_fn, extra in (
        ("actor", fns.actor_grad, (scalar, scalar)),
        ("critic", fns.critic_grad, (scalar,)),
    ):
        if which not in models:
            continue
        params = models[which]
        step = compile_(grad_fn, read[which], batch, *extra)
        own = _own(step, _bytes_per_device(read[which]))
        programs.append(
            Program(
                f"training micro-step ({which})", own, resident + accumulate, train_flags,
                shardable=min(own, _bytes_per_device(params)),  # the gradients it returns
                gathered=gathered(read[which]),
            )
        )  # fmt: skip
        update = compile_(fns.apply, which, params, opts[which], params, scalar)
        own = _own(update, _bytes_per_device(params) + _bytes_per_device(opts[which]))
        update_flags = "--mesh (fsdp), --param-dtype, --opt-dtype"
        programs.append(
            Program(f"optimizer update ({which})", own, resident, update_flags, shardable=own)
        )
    shape = (
        f"{cfg.prompts_per_step * cfg.group_size} episodes a step on {rows} decode slots, "
        f"--max-len {max_len}, micro-batches of {micro} rows, compute {cfg.compute_dtype}, "
        f"parameters {cfg.param_dtype}, moments {cfg.opt_dtype}, --remat {cfg.remat}, "
        f"mesh {dict(mesh.shape)}"
        + (f", LoRA rank {cfg.lora_rank} on {','.join(mc.lora_targets)}" if cfg.lora_rank else "")
    )
    return Plan(
        n, state, programs, limit, notes, shape=shape, max_len=max_len, batch_ways=batch_ways(mesh)
    )


# What lowers each program, tried in this order: the decode rows for the sampler, the remat and
# then the token budget for the training micro-steps, the token budget for scoring. The
# optimizer update (parameters and moments) has no knob on the given devices: fsdp over more.
# When one row of --max-len is too big for a device at the floor of those, its tokens split over
# more devices (``context``: `train.model.context`), taken from the data axis, then from fsdp.
KNOBS = {
    "sampler": ("slots",),
    "scoring": ("micro_batch_tokens", "context"),
    "training micro-step": ("remat", "micro_batch_tokens", "context"),
    "optimizer update": (),
}
BLOCKED_BY = {
    "micro_batch_tokens": ("micro_batch_tokens", "micro_batches"),
    "slots": ("slots",),
    "context": ("mesh",),
}


@dataclasses.dataclass
class Proposal:
    """Settings the search chose, their plan, and what the user's own flags stood in the way of
    (``blocked``: the settings that fit if those flags change; empty when the plan fits as
    chosen or when nothing on these devices fits)."""

    cfg: object
    plan: Plan
    changes: dict
    blocked: dict
    needs: str = ""  # what would fit when nothing on these devices does

    def flags(self, changes: dict | None = None) -> str:
        items = self.changes if changes is None else changes
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in items.items())

    def verdict(self) -> str:
        line = self.plan.verdict()
        if self.plan.fits and self.changes:
            return f"{line} with the settings chosen: {self.flags()}"
        if not self.plan.fits and self.blocked:
            return f"{line}; with {self.flags(self.blocked)} instead it fits"
        if not self.plan.fits and self.needs:
            return f"{line}; {self.needs}"
        return line


def _category(program: str) -> str:
    return next(k for k in KNOBS if program.startswith(k))


def _below(value: int, scale: float, floor: int) -> int:
    """The largest power of two <= value x scale (at most value / 2), never below ``floor``."""
    target = max(1, min(value // 2, int(value * max(scale, 0.0))))
    return max(floor, 1 << (target.bit_length() - 1))


def _lowered(cfg, field: str, max_len: int, scale: float = 0.5, ways: int = 1) -> dict | None:
    """The changes that lower ``field`` from ``cfg``'s value, or None at its floor. ``scale``:
    the share of the program's own bytes that would fit (a knob that scales it is cut to the
    power of two below that share at once, at least halved). ``ways``: the devices a
    micro-batch's rows split over (its floor is one row each)."""
    from mpo_jax.batch import padded_length

    if field == "remat":
        return {"remat": "full"} if cfg.remat != "full" else None
    if field == "context":
        return more_context(cfg, len(jax.devices()))
    if field == "slots":
        episodes = cfg.prompts_per_step * cfg.group_size
        current = min(cfg.slots or episodes, episodes)
        if current <= 1:
            return None
        return {"engine": "continuous", "slots": _below(current, scale, 1)}
    width = padded_length(max_len)
    floor = width * ways  # one row of --max-len a device: the budget cannot go lower
    current = cfg.micro_batch_tokens or micro_rows(cfg, max_len, ways) * width
    if current <= floor:
        return None
    return {"micro_batch_tokens": _below(current, scale, floor), "micro_batches": 1}


def more_context(cfg, devices: int) -> dict | None:
    """``--mesh`` over ``devices`` with the context axis doubled, the devices taken from data,
    else from fsdp (the weights stay sharded over fsdp x context); None when neither has two to
    give."""
    from train.model.sharding import MeshShape

    shape = cfg.mesh_shape() or MeshShape()
    data = devices // (shape.fsdp * shape.tensor * shape.context)
    data = data if shape.data == -1 else shape.data
    if data % 2 == 0:
        shape = shape._replace(data=data // 2, context=shape.context * 2)
    elif shape.fsdp % 2 == 0:
        shape = shape._replace(data=data, fsdp=shape.fsdp // 2, context=shape.context * 2)
    else:
        return None
    return {"mesh": ",".join(str(n) for n in shape)}


def _search(cfg, limit, platform, given, tries, say, plan=None):
    changes, blocked = {}, {}
    plan = plan or make_plan(cfg, limit=limit, platform=platform)
    max_len = plan.max_len
    while not plan.fits and tries > 0:
        tries -= 1
        step = None
        worst = plan.worst()
        scale = (limit - worst.resident) / max(worst.own, 1)  # the share of it that would fit
        for field in KNOBS[_category(worst.name)]:
            lowered = _lowered(cfg, field, max_len, scale, plan.batch_ways)
            if lowered is None:
                continue
            if any(name in given for name in BLOCKED_BY.get(field, (field,))):
                blocked.update(lowered)
                continue
            step = lowered
            break
        if step is None:
            break
        changes.update(step)
        cfg = dataclasses.replace(cfg, **step)
        say(f"plan: {plan.worst().name} needs {plan.worst().peak / GIB:.2f} GiB; trying "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in step.items()))  # fmt: skip
        plan = make_plan(cfg, limit=limit, platform=platform)
    return cfg, plan, changes, blocked


def propose(
    cfg, *, limit: int, platform: str | None = None, given=(), tries: int = 24, say=None
) -> Proposal:
    """Searches the settings left to their defaults until the plan fits ``limit`` bytes a device.

    The program that does not fit says which knob to turn (`KNOBS`): fewer decode slots
    (``--slots``: more episodes in flight than slots), ``--remat full``, a smaller
    ``--micro-batch-tokens`` (down to one row of ``--max-len``); a knob that scales the
    program's own bytes is cut at once to the power of two below the share that would fit (at
    least halved), then the plan is compiled again. Fields in ``given`` (the
    user's own flags) are never changed; when they stand in the way, the search is run again
    without them and ``blocked`` holds what would fit. When nothing fits on these devices,
    ``needs`` names the way out (`_needs`): the fewest devices that would fit with fsdp,
    estimated from the plan at every knob's floor, or a shorter ``--max-len``."""
    say = say or (lambda message: None)
    plan = make_plan(cfg, limit=limit, platform=platform)
    if plan.resident_state > limit:  # the weights and moments alone: no setting lowers them
        adapters = _with_lora(cfg, limit, platform, given, tries, say)
        if adapters is not None:
            return adapters
        return Proposal(cfg, plan, {}, {}, needs=_needs(cfg, plan, limit, platform, say))
    chosen, plan, changes, blocked = _search(cfg, limit, platform, set(given), tries, say, plan)
    proposal = Proposal(chosen, plan, changes, {})
    if plan.fits:
        return proposal
    if blocked:
        _, freed, freed_changes, _ = _search(cfg, limit, platform, set(), tries, say)
        if freed.fits:
            proposal.blocked = freed_changes
            return proposal
    adapters = _with_lora(cfg, limit, platform, given, tries, say)
    if adapters is not None:
        return adapters
    proposal.needs = _needs(cfg, plan, limit, platform, say)
    return proposal


# the rank the proposer turns LoRA on with, where full fine-tuning cannot fit
PROPOSED_LORA_RANK = 16


def _with_lora(cfg, limit, platform, given, tries, say) -> Proposal | None:
    """Full fine-tuning does not fit: the proposal with LoRA (`PROPOSED_LORA_RANK` on every
    projection: one frozen base, moments for the adapters alone, no reference copy), when it
    fits and the user did not set ``--lora-rank`` themselves."""
    if cfg.lora_rank or "lora_rank" in given:
        return None
    adapted = dataclasses.replace(cfg, lora_rank=PROPOSED_LORA_RANK)
    say(f"plan: full fine-tuning does not fit; trying --lora-rank {PROPOSED_LORA_RANK}")
    plan = make_plan(adapted, limit=limit, platform=platform)
    if plan.resident_state > limit:
        return None
    chosen, plan, changes, _ = _search(adapted, limit, platform, set(given), tries, say, plan)
    if not plan.fits:
        return None
    return Proposal(chosen, plan, {"lora_rank": PROPOSED_LORA_RANK, **changes}, {})


def floor_settings(max_len: int) -> dict:
    """Every knob of `KNOBS` at its floor: one decode slot, ``--remat full``,
    micro-batches of one row of ``max_len``."""
    from mpo_jax.batch import padded_length

    width = padded_length(max_len)
    return dict(engine="continuous", slots=1, remat="full", micro_batch_tokens=width,
                micro_batches=1)  # fmt: skip


def devices_needed(plan: Plan, limit: int, most: int = 1 << 16) -> int | None:
    """The fewest devices, ``plan.devices`` times a power of two (at least 2), on which every
    program of ``plan`` would fit ``limit`` with fsdp over all of them (`Program.peak_on`:
    fsdp divides the weights, moments, gradients and decode rows; one row's activations stay
    whole on its device, beside the weights it gathers). None when that undivided part alone
    does not fit, on any count."""
    k = 2
    while plan.devices * k <= most:
        if all(p.peak_on(k) <= limit for p in plan.programs):
            return plan.devices * k
        k *= 2
    return None


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 100 else f"{n / 2**20:.2f} MiB"


def _needs(cfg, plan: Plan, limit: int, platform, say) -> str:
    """The way out when nothing on these devices fits, from the plan with every knob at its
    floor (`floor_settings`): fsdp over `devices_needed` devices, else (one row's
    activations alone too big) a shorter ``--max-len``; LoRA in both cases."""
    floor = dataclasses.replace(cfg, **floor_settings(plan.max_len))
    say("plan: nothing fits on these devices; planning every setting at its floor")
    floor_plan = make_plan(floor, limit=limit, platform=platform)
    rows = cfg.prompts_per_step * cfg.group_size // cfg.minibatches
    return way_out(plan, floor_plan, limit, rows)


def way_out(plan: Plan, floor_plan: Plan, limit: int, minibatch_rows: int) -> str:
    """What `_needs` says, from the plan that does not fit and its floor plan
    (``minibatch_rows``: the rows a minibatch splits over the devices named)."""
    if plan.resident_state > limit:
        why = f"the weights, moments and reference alone take {_size(plan.resident_state)} a device"
    else:
        why = f"{plan.worst().name} at its floor"
    devices = devices_needed(floor_plan, limit)
    if devices is None:
        worst = max(floor_plan.programs, key=lambda p: p.peak_on(1 << 30))
        return (
            f"nothing on {plan.devices} device(s) fits ({why}), nor on any number of devices "
            f"with fsdp: {worst.name} keeps {_size(worst.peak_on(1 << 30))} a "
            f"device at its floor (one row of --max-len {plan.max_len}), which more devices do "
            f"not divide; try a shorter --max-len{_lora_hint(plan)}"
        )
    k = devices // plan.devices
    estimate = max(p.peak_on(k) for p in floor_plan.programs)
    split = (
        f"; a minibatch's {minibatch_rows} rows must split over them: more --prompts-per-step "
        "or fewer --minibatches"
        if minibatch_rows % devices
        else ""
    )
    return (
        f"nothing on {plan.devices} device(s) fits ({why}); try {devices} devices with fsdp "
        f"(--mesh 1,{devices},1: about {_size(estimate)} a device with every setting at its "
        f"floor, an estimate that python -m train.plan --devices {devices} --mesh 1,{devices},1 "
        f"checks{split}), or a shorter --max-len{_lora_hint(plan)}"
    )


def _lora_hint(plan: Plan) -> str:
    """LoRA as a way out, unless the plan trains adapters already."""
    if any(name.startswith("base parameters") for name in plan.state):
        return ""
    return f", or LoRA (--lora-rank {PROPOSED_LORA_RANK}: a frozen base, no reference copy)"


def _split_argv(argv):
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--device-memory", type=float, default=None)
    parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default=None)
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Prints the plan of a run's flags (plus ``--devices N`` and ``--device-memory BYTES``)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print("plan flags: --devices N (fake N CPU devices), --device-memory BYTES, --platform")
        print("cpu|gpu|tpu (the dtypes 'auto' resolves to); and every flag of train.run --help")
        return 0
    ours, rest = _split_argv(argv)
    if ours.devices:
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():  # fake the devices before JAX starts
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", ours.devices)
        elif len(jax.devices()) != ours.devices:  # too late in this process: a fresh one
            if os.environ.get("MPO_JAX_PLAN_CHILD"):
                raise SystemExit(f"--devices: could not fake {ours.devices} devices")
            import subprocess

            env = {**os.environ, "MPO_JAX_PLAN_CHILD": "1"}
            cmd = [sys.executable, "-m", "train.plan", *argv]
            return subprocess.run(cmd, env=env).returncode
    from train.core.config import parse_args

    cfg = parse_args(["--run-dir", os.devnull, *rest] if "--run-dir" not in rest else rest)
    limit = int(ours.device_memory) if ours.device_memory else device_memory()
    plan = make_plan(cfg, limit=limit, platform=ours.platform)
    if plan.fits or limit is None:
        print(plan.table())
        print()
        print(plan.verdict())
        return 0 if plan.fits else 1
    given = getattr(cfg, "given_fields", ())
    proposal = propose(cfg, limit=limit, platform=ours.platform, given=given, say=print)
    print(proposal.plan.table())
    print()
    print(proposal.verdict())
    return 0 if proposal.plan.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
