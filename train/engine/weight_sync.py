"""The learner's weights out to inference servers: a Hugging Face folder on a shared disk, then
a reload with a version.

    push = WeightPush(servers, graphdef, "runs/x/rollout-weights", dtype="bfloat16")
    push(params, version=3)        # no-op when the servers already have version 3
    push.last                      # {'write_s', 'reload_s', 'bytes'} of the last push

Each push writes ``<root>/v<version>/`` (``config.json`` and ``model.safetensors``, sharded past
5 GiB: `train.model.weights.save_pretrained`, the ``train.export`` path) and has every
server reload it ([`load_weights`][train.engine.servers.Servers.load_weights]: pause, reload,
resume). The folder of the version before stays until the next push has landed (a server may still
be reading it), older ones are deleted. ``root`` must be a path the servers can read at the same
name (a shared or local disk).

Cost: the write is ``bytes / disk bandwidth`` plus the device-to-host copy, the reload the same
read back by each server; an in-memory transfer (NCCL, or vLLM's weight-transfer endpoints)
skips both disks. Each step logs the push's times and size (``weight_sync_*``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from flax import nnx

from train.model.weights import save_pretrained

__all__ = ["WeightPush"]


class WeightPush:
    def __init__(self, servers, graphdef, root: str | Path, *, dtype: str | None = "bfloat16"):
        self.servers, self.graphdef = servers, graphdef
        self.root, self.dtype = Path(root), dtype
        self.version: int | None = None  # what the servers hold (None: not ours yet)
        self.last: dict[str, float] = {}

    def __call__(self, params, version: int) -> bool:
        """Pushes ``params`` as ``version`` unless the servers hold it; True when it pushed."""
        version = int(version)
        if version == self.version:
            return False
        folder = self.root / f"v{version}"
        started = time.perf_counter()
        if folder.exists():
            shutil.rmtree(folder)
        save_pretrained(nnx.merge(self.graphdef, params), folder, dtype=self.dtype)
        wrote = time.perf_counter()
        self.servers.load_weights(str(folder.absolute()), version)
        done = time.perf_counter()
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        self.last = {"write_s": wrote - started, "reload_s": done - wrote, "bytes": float(size)}
        for old in self.root.glob("v*"):
            if old.is_dir() and old.name not in (f"v{version}", f"v{self.version}"):
                shutil.rmtree(old, ignore_errors=True)
        self.version = version
        return True

    def figures(self) -> dict[str, float]:
        if not self.last:
            return {}
        return {
            "weight_sync_write_s": self.last["write_s"],
            "weight_sync_reload_s": self.last["reload_s"],
            "weight_sync_gb": self.last["bytes"] / 1e9,
        }
