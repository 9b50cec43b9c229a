"""Checkpoints with orbax: the whole training state (actor, critic, reference, optimizer states,
step; the data position is a function of the step) saved atomically every N steps.

orbax writes each checkpoint to a temporary directory and renames it when complete, so a run killed
at any moment (SIGKILL included) resumes from its last complete checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpoints"]


class Checkpoints:
    def __init__(self, directory: Path, *, keep: int = 2):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict[str, Any]) -> None:
        state = {**state, "step": np.asarray(state["step"], np.int64)}
        self.manager.save(step, args=ocp.args.StandardSave(state))

    def restore(self, like: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """The state saved at ``step`` (default: the latest), shaped like ``like``."""
        step = self.latest() if step is None else step
        like = {**like, "step": np.asarray(like["step"], np.int64)}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        state = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        state["step"] = int(state["step"])
        return state

    def wait(self) -> None:
        self.manager.wait_until_finished()
