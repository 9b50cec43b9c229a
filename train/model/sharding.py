"""Sharding as a table of rules: logical axis names on parameters -> axes of a device mesh.

Every parameter of ``train.model.qwen3`` carries logical names (``vocab``, ``embed``, ``heads``,
``kv_heads``, ``mlp``, ``expert``); `DEFAULT_RULES` maps them onto a mesh with axes
(``data``, ``fsdp``, ``context``, ``tensor``, ``expert``). ``context`` splits each row's tokens
(`train.model.context`); the devices of a context group hold the same weights, so they shard
them as fsdp does (the ``embed`` dimension over fsdp x context). Changing the parallelism
layout is a change of the mesh shape or of the rules, not of the model code (MaxText's idea).
A dimension that its mesh axes do not divide is replicated instead.

Meshes use ``AxisType.Auto``: JAX's default Explicit axes make tensor-parallel contractions in
``nnx.Linear`` raise ``ShardingTypeError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

__all__ = [
    "MeshShape",
    "BATCH_AXES",
    "DECODE_AXES",
    "row_axes",
    "DEFAULT_RULES",
    "MESH_AXES",
    "make_mesh",
    "param_shardings",
    "shard_params",
    "batch_sharding",
    "batch_ways",
]

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")

BATCH_AXES = ("data", "fsdp")  # the axes a batch's rows split over (the "batch" rule)
# Decode (`extend`) splits its rows over the context axis too: it does not split tokens, and
# without it every device of a context group would hold and decode the same rows.
DECODE_AXES = (*BATCH_AXES, "context")


DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", ("fsdp", "context")),  # the context axis shards weights too (ZeRO over it)
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
)


def row_axes(mesh, rows: int, axes: tuple[str, ...] = BATCH_AXES) -> tuple[str, ...] | None:
    """The mesh axes ``rows`` rows split over: ``axes`` (those the mesh has) where the rows
    divide over them, else the data-parallel ones where they divide; None where neither splits
    them (every device holds every row). ``mesh``: concrete or abstract."""
    for candidate in dict.fromkeys((axes, BATCH_AXES)):
        present = tuple(a for a in candidate if a in mesh.axis_names)
        ways = int(np.prod([mesh.shape[a] for a in present]))
        if ways > 1 and rows % ways == 0:
            return present
    return None


class MeshShape(NamedTuple):
    """``--mesh data,fsdp,tensor[,context]``: the sizes of the mesh's axes (data may be -1)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    context: int = 1

    def make(self, devices=None):
        """The mesh of this shape over ``devices`` (`make_mesh`)."""
        return make_mesh(**self._asdict(), devices=devices)


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, expert: int = 1, devices=None, context: int = 1
):
    """A mesh over ``devices`` (default: all); ``-1`` for data takes what the others leave.
    ``context`` splits each row's tokens (`train.model.context`)."""
    devices = list(jax.devices() if devices is None else devices)
    rest = fsdp * context * tensor * expert
    if data == -1:
        if len(devices) % rest:
            raise ValueError(
                f"mesh: {len(devices)} devices are not divisible by fsdp x context x tensor x "
                f"expert = {rest}"
            )
        data = len(devices) // rest
    shape = (data, fsdp, context, tensor, expert)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh: shape {dict(zip(MESH_AXES, shape, strict=True))} needs "
            f"{int(np.prod(shape))} devices, have {len(devices)}"
        )
    grid = np.asarray(devices).reshape(shape)
    return jax.sharding.Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _spec(names: Sequence[str | None], shape, mesh, rules) -> PartitionSpec:
    table = dict(rules)
    out = []
    for name, size in zip(names, shape, strict=True):
        axes = table.get(name) if name else None
        if axes is None:
            out.append(None)
            continue
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
        ways = int(np.prod([mesh.shape[a] for a in axes_t]))
        out.append(axes if size % ways == 0 and ways > 1 else None)
    return PartitionSpec(*out)


def param_shardings(state: nnx.State, mesh, rules=DEFAULT_RULES) -> dict[tuple, NamedSharding]:
    """``{parameter path: NamedSharding}`` for an ``nnx.State`` of parameters (abstract or not)."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        names = var.get_metadata().get("out_sharding") or (None,) * len(value.shape)
        out[path] = NamedSharding(mesh, _spec(names, value.shape, mesh, rules))
    return out


def shard_params(state: nnx.State, mesh, rules=DEFAULT_RULES) -> nnx.State:
    """``state`` placed on the mesh by the rules."""
    shardings = param_shardings(state, mesh, rules)

    def place(value, sharding):
        if sharding.is_fully_addressable:
            return jax.device_put(value, sharding)
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            # a global array already (a critic copied from a placed actor): resharded where it
            # lies, since no process holds all of it (with context across processes)
            return jax.device_put(value, sharding)
        # A mesh over several processes: every process holds the same initial values (same seed
        # or checkpoint) and fills the shards on its own devices.
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return nnx.from_flat_state(
        [
            (path, var.replace(place(var.get_value(), shardings[path])))
            for path, var in nnx.to_flat_state(state)
        ]
    )


def batch_sharding(mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Rows of a batch split over the data-parallel axes."""
    return NamedSharding(mesh, PartitionSpec(dict(rules)["batch"]))


def batch_ways(mesh, rules=DEFAULT_RULES) -> int:
    """How many ways `batch_sharding` splits the rows: the product of the data axes' sizes.
    A batch is placed row-split only when its rows divide by it (the one divisibility rule)."""
    axes = dict(rules)["batch"]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return int(np.prod([mesh.shape[a] for a in axes]))
