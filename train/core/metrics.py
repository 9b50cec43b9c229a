"""Run observability: ``metrics.jsonl`` (one JSON object per step), the trackers beside it
(TensorBoard by default; W&B, Trackio: [`train.core.trackers`][train.core.trackers]), a progress bar
with the live success rate, unbiased pass@k, and the phase timer of a step."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from train.core.trackers import DEFAULT_LOGGERS, open_trackers

__all__ = ["MetricsLog", "PhaseTimer", "pass_at_k", "read_metrics"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: ``1 - C(n - c, k) / C(n, k)``
    (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLog:
    """Appends to ``metrics.jsonl``; on resume, drops the lines of steps after the checkpoint
    (they will be run again), so the file never holds a step twice. Each line's numbers also go
    to the trackers ``loggers`` names
    ([`train.core.trackers.open_trackers`][train.core.trackers.open_trackers]; ``config``:
    the run's configuration they record, ``config.json``'s by default)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        start_step: int,
        progress: bool,
        total: int,
        loggers: str = DEFAULT_LOGGERS,
        config: dict[str, Any] | None = None,
        project: str = "mpo-jax",
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        kept = [m for m in read_metrics(run_dir) if m.get("step", 0) <= start_step]
        self.path.write_text("".join(json.dumps(m) + "\n" for m in kept[:-1]))
        self.file = open(self.path, "a")  # noqa: SIM115 (closed in close())
        self._last: tuple[int, dict[str, Any]] | None = None
        if kept:  # the last kept line through write's bookkeeping: amend() can reach it
            self._append(kept[-1])
        self.trackers = open_trackers(
            loggers, Path(run_dir), start_step=start_step, config=config, project=project
        )
        self.bar = tqdm(total=total, initial=start_step, disable=not progress, dynamic_ncols=True)

    @classmethod
    def of_run(cls, run_dir: Path, cfg, *, start_step: int) -> MetricsLog:
        """The log of a ``train.run`` or ``train.sft`` run: its progress bar, step count,
        ``--loggers`` and ``--tracker-project`` from ``cfg`` (a ``TrainConfig``)."""
        return cls(
            run_dir,
            start_step=start_step,
            progress=cfg.progress,
            total=cfg.steps,
            loggers=cfg.loggers,
            project=cfg.tracker_project,
        )

    def write(self, metrics: dict[str, Any]) -> None:
        """Appends one step's line (flushed: a crash after it keeps the step)."""
        self._append(metrics)
        self._show(metrics, metrics)
        self.bar.update(1)

    def _append(self, metrics: dict[str, Any]) -> None:
        """Appends ``metrics`` as a line, remembering where it starts (for `amend`)."""
        self.file.flush()
        self._last = (self.file.tell(), dict(metrics))
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()

    def amend(self, extra: dict[str, Any]) -> None:
        """Adds ``extra`` (a held-out evaluation run after the step was written) to the last
        step's line, so that the file still holds one line per step."""
        if self._last is None:
            raise ValueError("amend: no step was written by this log")
        offset, metrics = self._last
        metrics.update(extra)
        self.file.truncate(offset)
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        self._last = (offset, metrics)
        self._show({"step": metrics["step"], **extra}, metrics)

    def last(self) -> dict[str, Any] | None:
        """The file's last line (on resume: the checkpoint's step), or None."""
        return self._last[1] if self._last else None

    def _show(self, new: dict[str, Any], metrics: dict[str, Any]) -> None:
        """``new``'s numbers to the trackers; the bar's figures from ``metrics``."""
        self.trackers.log(new["step"], new)
        shown = {}
        if "success_rate" in metrics:
            shown["success"] = f"{metrics['success_rate']:.2f}"
        elif "loss" in metrics:
            shown["loss"] = f"{metrics['loss']:.3f}"
        for key in sorted(metrics):
            if key.startswith("eval_") and key.endswith("_success_rate"):
                shown[key[5:-13]] = f"{metrics[key]:.2f}"
        self.bar.set_postfix(shown)

    def flush(self) -> None:
        self.file.flush()
        self.trackers.flush()

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        self.trackers.close()


class PhaseTimer:
    """Wall time of a step's phases: ``with timer("rollout"): ...``; `metrics` gives
    ``<phase>_s``, ``<phase>_tok_s`` (tokens per second) and ``<phase>_frac`` (share of the
    timed total) for each phase, in the order they ran."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self, tokens: int) -> dict[str, float]:
        total = max(sum(self.seconds.values()), 1e-9)
        out: dict[str, float] = {}
        for phase, s in self.seconds.items():
            out[f"{phase}_s"] = s
            out[f"{phase}_tok_s"] = tokens / max(s, 1e-9)
            out[f"{phase}_frac"] = s / total
        return out
