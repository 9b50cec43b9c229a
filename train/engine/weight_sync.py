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

A LoRA run passes the base and adapters apart ([`Adapted`][train.model.lora.Adapted]) and an
[`AdapterFolder`][train.engine.weight_sync.AdapterFolder]: with ``mode`` ``auto`` the push writes
the adapters alone as a PEFT folder (megabytes, not the model) and has the servers load it
([`Servers.load_adapter`][train.engine.servers.Servers.load_adapter]); a server that does not take
adapters (``AdaptersRefused``: SGLang here, or vLLM started without LoRA) gets the merged weights
``W + (α / r) A B`` from then on, said once on stderr. ``adapters`` makes that refusal an error,
``merged`` always pushes the merge (a server's LoRA kernels cost time a token that merged weights
do not).
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from flax import nnx

from train.engine.servers import AdaptersRefused
from train.model.lora import Adapted, lora_scale, merge_weights, save_peft
from train.model.weights import save_pretrained

__all__ = ["WeightPush", "AdapterFolder", "PUSH_MODES"]

PUSH_MODES = ("auto", "adapters", "merged")


@dataclasses.dataclass(frozen=True)
class AdapterFolder:
    """What writing a LoRA run's adapters as PEFT's folder needs: the adapted model's config
    (rank, alpha, targets) and the base's path and fingerprint."""

    cfg: Any
    base_path: str
    base_hash: str

    @property
    def scale(self) -> float:
        return lora_scale(self.cfg.lora_rank, self.cfg.lora_alpha)


class WeightPush:
    def __init__(
        self,
        servers,
        graphdef,
        root: str | Path,
        *,
        dtype: str | None = "bfloat16",
        lora: AdapterFolder | None = None,
        mode: str = "auto",
    ):
        if mode not in PUSH_MODES:
            raise ValueError(f"rollout_push: {mode!r} is not one of {PUSH_MODES}")
        self.servers, self.graphdef = servers, graphdef
        self.root, self.dtype = Path(root), dtype
        self.lora, self.mode = lora, mode
        self.adapters = mode != "merged"  # still pushing adapters alone (LoRA runs)
        # adapters load as "<run>-v<version>": a name of this push's own, so a resumed run (or
        # another run on the same server) never meets a name the server already holds
        self.run_name = f"mpo-{secrets.token_hex(3)}"
        self.version: int | None = None  # what the servers hold (None: not ours yet)
        self.last: dict[str, float] = {}

    def __call__(self, params, version: int) -> bool:
        """Pushes ``params`` (a state, or a LoRA run's `Adapted`) as ``version`` unless the
        servers hold it; True when it pushed."""
        version = int(version)
        if version == self.version:
            return False
        folder = self.root / f"v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        if isinstance(params, Adapted) and self.adapters:
            try:
                self._push(folder, version, lambda: self._write_adapters(params, folder), True)
                return True
            except AdaptersRefused as e:
                if self.mode == "adapters":
                    raise
                self.adapters = False
                print(f"rollout_push: {e}; pushing merged weights", file=sys.stderr)
                shutil.rmtree(folder, ignore_errors=True)

        def write_merged():
            state = params
            if isinstance(params, Adapted):
                state = merge_weights(params.base, params.adapters, self.lora.scale)
            save_pretrained(nnx.merge(self.graphdef, state), folder, dtype=self.dtype)

        self._push(folder, version, write_merged, False)
        return True

    def _write_adapters(self, params: Adapted, folder: Path) -> None:
        lora = self.lora
        save_peft(folder, params.adapters, lora.cfg, base_path=lora.base_path,
                  base_hash=lora.base_hash)  # fmt: skip

    def _push(self, folder: Path, version: int, write, adapters: bool) -> None:
        started = time.perf_counter()
        write()
        wrote = time.perf_counter()
        if adapters:
            self.servers.load_adapter(str(folder.absolute()), version, self.adapter_name(version))
        else:
            self.servers.load_weights(str(folder.absolute()), version)
        done = time.perf_counter()
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        self.last = {"write_s": wrote - started, "reload_s": done - wrote, "bytes": float(size),
                     "adapter": float(adapters)}  # fmt: skip
        for old in self.root.glob("v*"):
            if old.is_dir() and old.name not in (f"v{version}", f"v{self.version}"):
                shutil.rmtree(old, ignore_errors=True)
        self.version = version

    def adapter_name(self, version: int) -> str:
        return f"{self.run_name}-v{int(version)}"

    def figures(self) -> dict[str, float]:
        if not self.last:
            return {}
        return {
            "weight_sync_write_s": self.last["write_s"],
            "weight_sync_reload_s": self.last["reload_s"],
            "weight_sync_gb": self.last["bytes"] / 1e9,
            "weight_sync_adapter": self.last["adapter"],
        }
