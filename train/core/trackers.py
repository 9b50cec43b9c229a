"""Where a run's figures go besides ``metrics.jsonl``: TensorBoard, Weights & Biases, Trackio.

    python -m train.run --loggers jsonl,tensorboard,wandb      # W&B beside the defaults
    python -m train.run --loggers jsonl,trackio                # a local-first dashboard

``metrics.jsonl`` is always written: it is the run's record (``--resume``, ``train.plot`` and the
studies read it), so ``jsonl`` may be named or not. Every other tracker gets, by step, every
number of that file's lines (held-out evaluations included, at the step they follow), the run's
``config.json`` with the run's name and directory, and on ``--resume`` continues the same tracker
run (its identity is kept in ``RUN/trackers.json``).

- ``tensorboard``: event files in ``RUN/tensorboard`` (tensorboardX; always installed).
- ``wandb``: Weights & Biases (``pip install 'mpo-jax[wandb]'``). Offline, into ``RUN/wandb``,
  when no API key is set (``WANDB_API_KEY`` or ``wandb login``) and the user set no
  ``WANDB_MODE``; ``wandb sync RUN/wandb/offline-run-*`` uploads it later.
- ``trackio``: Hugging Face's local-first tracker (``pip install 'mpo-jax[trackio]'``): one
  SQLite file a project under ``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``), read by
  ``trackio show``; nothing leaves the machine.

A tracker that fails to start or to log is a warning on stderr, said once; it is dropped and the
run goes on (the JSONL stays the record). A tracker named but not installed is refused before
anything is written, naming the extra that installs it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import netrc
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "LOGGERS",
    "DEFAULT_LOGGERS",
    "parse_loggers",
    "check_loggers",
    "Tracker",
    "Trackers",
    "open_trackers",
    "scalars",
]

LOGGERS = ("jsonl", "tensorboard", "wandb", "trackio")
DEFAULT_LOGGERS = "jsonl,tensorboard"
# The trackers that are optional extras: the module each imports, and the extra installing it.
_EXTRAS = {"wandb": "wandb", "trackio": "trackio"}
IDENTITY_FILE = "trackers.json"


def parse_loggers(text: str) -> tuple[str, ...]:
    """``--loggers``' comma-separated names, in order, ``jsonl`` first (always written)."""
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"loggers: {unknown} not among {', '.join(LOGGERS)}")
    return tuple(dict.fromkeys(["jsonl", *names]))


def check_loggers(text: str) -> tuple[str, ...]:
    """[`parse_loggers`][train.core.trackers.parse_loggers], and a refusal naming the extra of a
    tracker not installed."""
    names = parse_loggers(text)
    for name in names:
        module = _EXTRAS.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ValueError(
                f"loggers: {name} is named but the {module} package is not installed; "
                f"pip install 'mpo-jax[{name}]' (or leave {name} out of --loggers)"
            )
    return names


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line (the step, strings and lists left out)."""
    return {
        k: v
        for k, v in metrics.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class Tracker(Protocol):
    name: str

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files in ``RUN/tensorboard``; on resume, the steps after the checkpoint are purged
    (they will be written again)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _wandb_key_set() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    """A W&B run with the id kept in ``trackers.json`` (``resume="allow"``: a resumed run
    continues it). Every number is logged with its ``step`` as a field and plotted against it
    (``define_metric``), not against W&B's own row counter: a step run again after a resume is a
    second point at the same step (the later one is the JSONL's), never a dropped one."""

    name = "wandb"

    def __init__(self, identity: dict[str, Any], run_dir: Path, config: dict, project: str):
        import wandb

        mode = None
        if not os.environ.get("WANDB_MODE") and not _wandb_key_set():
            mode = "offline"
            print(
                f"wandb: offline (no API key set): the run is kept in {run_dir / 'wandb'}; "
                f"`wandb sync {run_dir / 'wandb'}/offline-run-*` uploads it later "
                "(set WANDB_MODE to choose)",
                file=sys.stderr,
            )
        self.run = wandb.init(
            project=project,
            name=identity["name"],
            id=identity["id"],
            resume="allow",
            dir=str(run_dir),
            config=config,
            mode=mode,
            settings=wandb.Settings(console="off"),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "step": step})

    def flush(self) -> None:
        pass  # W&B writes on its own thread; finish() waits for it

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """A Trackio run of ``project``, named in ``trackers.json`` (``resume="allow"``); its SQLite
    store lies under ``TRACKIO_DIR``."""

    name = "trackio"

    def __init__(self, identity: dict[str, Any], config: dict, project: str):
        import trackio

        with contextlib.redirect_stdout(sys.stderr):  # its banner: stdout stays the command's
            self.run = trackio.init(
                project=project,
                name=identity["name"],
                config=config,
                resume="allow",
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({k: v for k, v in values.items() if math.isfinite(v)}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self.run.finish()


def _identity(run_dir: Path, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Each tracker's run identity: read from ``trackers.json`` (a resumed run), or made and
    written there (the run's directory name, and an id that two runs of one name never share)."""
    path = run_dir / IDENTITY_FILE
    stored = json.loads(path.read_text()) if path.exists() else {}
    changed = False
    for name in names:
        if name in _EXTRAS and name not in stored:
            suffix = uuid.uuid4().hex[:8]
            stored[name] = {"name": f"{run_dir.resolve().name}-{suffix}", "id": suffix}
            changed = True
    if changed:
        path.write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
    return stored


class Trackers:
    """The trackers of one run. A tracker that raises, starting or logging, is said once on
    stderr and dropped: the run goes on, and ``metrics.jsonl`` stays its record."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.trackers)

    def _guarded(self, what: str, call) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as e:  # a tracker must never stop training
                self.trackers.remove(tracker)
                if what != "closing":
                    with contextlib.suppress(Exception):
                        tracker.close()  # what it holds is released, if it still can
                print(
                    f"warning: the {tracker.name} tracker failed {what} ({type(e).__name__}: "
                    f"{e}); it is dropped for the rest of the run (metrics.jsonl keeps the record)",
                    file=sys.stderr,
                )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = scalars(metrics)
        if values:
            self._guarded(f"logging step {step}", lambda t: t.log(step, values))

    def flush(self) -> None:
        self._guarded("flushing", lambda t: t.flush())

    def close(self) -> None:
        self._guarded("closing", lambda t: t.close())
        self.trackers = []


def open_trackers(
    loggers: str | tuple[str, ...],
    run_dir: Path,
    *,
    start_step: int,
    config: dict[str, Any] | None = None,
    project: str = "mpo-jax",
) -> Trackers:
    """The trackers ``loggers`` names beyond the JSONL, started for ``run_dir``. ``config``:
    what the trackers record as the run's configuration (``config.json``'s values by default),
    with ``run_name`` and ``run_dir`` added."""
    names = check_loggers(loggers) if isinstance(loggers, str) else tuple(loggers)
    run_dir = Path(run_dir)
    if config is None:
        path = run_dir / "config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
    config = {**config, "run_name": run_dir.resolve().name, "run_dir": str(run_dir.resolve())}
    identity = _identity(run_dir, names) if any(n in _EXTRAS for n in names) else {}
    starters = {
        "tensorboard": lambda: TensorBoardTracker(run_dir, start_step),
        "wandb": lambda: WandbTracker(identity["wandb"], run_dir, config, project),
        "trackio": lambda: TrackioTracker(identity["trackio"], config, project),
    }
    started: list[Tracker] = []
    for name in names:
        if name == "jsonl":
            continue
        try:
            started.append(starters[name]())
        except Exception as e:  # a tracker must never stop training
            print(
                f"warning: the {name} tracker failed to start ({type(e).__name__}: {e}); the "
                "run goes on without it (metrics.jsonl keeps the record)",
                file=sys.stderr,
            )
    return Trackers(started)
