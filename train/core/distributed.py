"""Several hosts, one program: ``jax.distributed`` set-up and moving data between host and mesh.

Every host runs the same trainer (JAX's multi-controller model). Each rolls out its share of a
step's tasks with a sampler on its own devices (`host_share`), then the hosts exchange their
rollouts (`gather_rollouts`), so that every host holds the same global batch, computes the
same advantages and feeds the same global arrays to the sharded update. With one process every
function here is the identity.

Initialisation (`initialize_from_env`) follows the usual environment:

- ``JAX_COORDINATOR_ADDRESS`` (host:port), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``: explicit;
- otherwise a cluster JAX detects itself (SLURM with more than one task, Open MPI, TPU pods):
  ``jax.distributed.initialize()`` with auto-detection, asked for by ``MPO_JAX_DISTRIBUTED=auto``
  or by those schedulers' variables;
- nothing set: one process, no initialisation.

On CPU the cross-process collectives use gloo (``jax_cpu_collectives_implementation``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from envs.rollout import EPISODE_FIGURES
from mpo_jax.batch import FIELD_FILL, pad_width

__all__ = [
    "initialize_from_env",
    "is_multiprocess",
    "host_share",
    "to_host",
    "put_global",
    "gather_rollouts",
    "gather_array",
]


def _cluster_detected() -> bool:
    env = os.environ
    if env.get("MPO_JAX_DISTRIBUTED", "").lower() == "auto":
        return True
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env:
        return True
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return True
    return len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1


def initialize_from_env() -> bool:
    """Calls ``jax.distributed.initialize`` when the environment names several processes.

    Returns whether it did. Must run before anything touches a JAX device.
    """
    env = os.environ
    explicit = env.get("JAX_COORDINATOR_ADDRESS")
    if explicit and ("JAX_NUM_PROCESSES" not in env or "JAX_PROCESS_ID" not in env):
        raise ValueError(
            "JAX_COORDINATOR_ADDRESS is set: JAX_NUM_PROCESSES and JAX_PROCESS_ID must be set too"
        )
    if not explicit and not _cluster_detected():
        return False
    # Cross-process collectives on the CPU backend (ignored by GPU and TPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        n, pid = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
        if not 0 <= pid < n:
            raise ValueError(f"JAX_PROCESS_ID: must be in [0, {n}), got {pid}")
        jax.distributed.initialize(coordinator_address=explicit, num_processes=n, process_id=pid)
    else:
        jax.distributed.initialize()
    return True


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def host_share(n: int, *, what: str = "prompts_per_step") -> slice:
    """This host's contiguous share of ``n`` items (tasks): items are split evenly, in process
    order, so concatenating the hosts' shares gives back the whole list."""
    count, index = jax.process_count(), jax.process_index()
    if n % count:
        raise ValueError(f"{what}: {n} is not divisible by the {count} processes")
    per = n // count
    return slice(index * per, (index + 1) * per)


def to_host(x) -> np.ndarray:
    """A (possibly multi-host) array as NumPy on this host: the global value."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def put_global(tree: Any, sharding) -> Any:
    """Host values that are the same on every process, placed as global arrays with
    ``sharding``: each process fills only the shards on its own devices."""

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, tree)


def gather_array(local: np.ndarray) -> np.ndarray:
    """Every host's ``local`` rows concatenated in process order (same trailing shape)."""
    if not is_multiprocess():
        return np.asarray(local)
    return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def _gather_width(x: np.ndarray, fill) -> np.ndarray:
    """Every host's rows, the second axis padded to the widest host's."""
    width = int(gather_array(np.array([x.shape[1]])).max())
    return gather_array(pad_width(x, width, fill))


_EPISODE_FIELDS = (
    "success",
    "reward",
    "turns",
    "turns_cut",
    "tokens",
    "truncated",
    "length_cut",
    "errors",
)
_FLAGS = ("success", "truncated", "length_cut")


def gather_rollouts(rollouts):
    """Every host's [`envs.rollout.Rollouts`][envs.rollout.Rollouts] as one global ``Rollouts``,
    rows in process order. Ragged parts (step-key and boundary widths, answer ids) are padded to the
    widest host; step-key ids are made distinct per host; episodes keep the fields the metrics read,
    the environments' own figures included (absent ones travel as NaN and are dropped again)."""
    if not is_multiprocess():
        return rollouts
    b = rollouts.batch
    if b.step_keys is not None:  # step-key ids are per host: make them distinct
        offset = jax.process_index() * 10_000_000
        b = b.replace(
            step_keys=np.where(b.step_keys >= 0, b.step_keys + offset, -1).astype(np.int32)
        )
    fields = {
        name: _gather_width(np.asarray(x), FIELD_FILL.get(name, 0))
        if np.ndim(x) >= 2
        else gather_array(np.asarray(x))
        for name, x in b.present().items()
    }
    boundary_lengths = _gather_width(rollouts.boundary_lengths, 0)
    lengths = np.array([len(a) for a in rollouts.answer_ids], np.int32)
    width = max(1, int(gather_array(np.array([lengths.max(initial=0)])).max()))
    answers = np.zeros((len(lengths), width), np.int32)
    for i, ids in enumerate(rollouts.answer_ids):
        answers[i, : len(ids)] = ids
    answers, lengths = gather_array(answers), gather_array(lengths)
    answer_ids = [answers[i, :n].tolist() for i, n in enumerate(lengths)]
    names = _EPISODE_FIELDS + EPISODE_FIGURES
    table = np.array(
        [
            [_number(e.get(k, 0 if k in _EPISODE_FIELDS else np.nan)) for k in names]
            for e in rollouts.episodes
        ]
    )
    table = gather_array(table.reshape(len(rollouts.episodes), len(names)))
    episodes = [
        {
            k: (bool(v) if k in _FLAGS else v)
            for k, v in zip(names, row, strict=True)
            if not np.isnan(v)
        }
        for row in table
    ]
    quality = _gather_width(np.asarray(rollouts.turn_quality, np.float32), np.nan)
    versions = rollouts.token_versions
    if versions is not None:  # padded like the batch's tokens (its width is the global one)
        versions = _gather_width(np.asarray(versions, np.int32), -1)
    seconds = float(gather_array(np.array([rollouts.seconds])).max())
    batch = b.replace(**fields)
    return dataclasses.replace(
        rollouts,
        batch=batch,
        boundary_lengths=boundary_lengths,
        answer_ids=answer_ids,
        episodes=episodes,
        seconds=seconds,
        turn_quality=quality,
        token_versions=versions,
        stats=rollouts.stats,  # this host's engine figures
    )


def _number(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")
