"""Checkpoints with orbax: the training state saved atomically every N steps, one item per part.

A checkpoint holds the parts a run cannot rebuild: ``actor`` and, where the preset has a critic,
``critic`` (parameters), their optimizer states (``actor_opt``, ``critic_opt``), ``step`` (the
data position is a function of the step) and, for asynchronous runs, what the rollout worker needs
to resume. A LoRA run's ``actor`` and ``critic`` are its adapters (and the critic's value head)
alone, and ``base`` names the frozen base they belong to (its path and fingerprint). The
reference model (and a LoRA run's base) is not written: it is the initial weights, re-read from
where the run started (the model path, ``--init-from``, or the seed of a random model).

Each part is an orbax item of its own, so a reader restores only what it needs
(``train.export`` and ``train.evaluate`` read ``actor`` alone, without building optimizer
states). orbax writes each checkpoint to a temporary directory and renames it when complete, so
a run killed at any moment (SIGKILL included) resumes from its last complete checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpoints", "JSON_PARTS"]

# parts saved as JSON: the step, and for a LoRA run the base it belongs to (path, fingerprint)
JSON_PARTS = ("step", "base")


class Checkpoints:
    def __init__(self, directory: Path, *, keep: int = 2, create: bool = True):
        directory = Path(directory).absolute()
        if not create and not directory.is_dir():
            raise FileNotFoundError(f"{directory}: no checkpoints")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
        self.manager = ocp.CheckpointManager(directory, options=options)

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Saves every part of ``state`` (a dict of pytrees; ``step`` an int)."""
        items = {
            name: ocp.args.JsonSave(int(value) if name == "step" else value)
            if name in JSON_PARTS
            else ocp.args.StandardSave(value)
            for name, value in state.items()
        }
        self.manager.save(step, args=ocp.args.Composite(**items))

    def restore(self, like: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """The parts named in ``like`` saved at ``step`` (default: the latest), each shaped (and
        sharded) like its entry in ``like`` (arrays or ``jax.ShapeDtypeStruct``)."""
        step = self.latest() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.manager.directory}: no checkpoint to restore")
        items = {}
        for name, value in like.items():
            if name in JSON_PARTS:
                items[name] = ocp.args.JsonRestore()
            else:
                abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, value)
                items[name] = ocp.args.StandardRestore(abstract)
        out = dict(self.manager.restore(step, args=ocp.args.Composite(**items)))
        if "step" in out:
            out["step"] = int(out["step"])
        return out

    def wait(self) -> None:
        self.manager.wait_until_finished()
