"""Train a multi-turn agent with any preset of ``mpo_jax.algorithms``.

    python -m train.run                       # the embedded default: a tiny Qwen3-architecture
                                              # policy and critic learn synthetic-nav
    python -m train.run --preset grpo --run-dir runs/grpo
    python -m train.run --resume --run-dir runs/grpo          # continue a killed run

This module is the command: flags, the refusals that write nothing, the memory plan, then the
loop over steps with metrics and checkpoints. Each step is
[`train.core.trainer.Trainer.step`][train.core.trainer.Trainer.step].
"""

from __future__ import annotations

import dataclasses
import sys
import time
from functools import partial
from pathlib import Path

import jax

from train.core.checkpoint import Checkpoints
from train.core.config import TrainConfig, parse_args, read_run_config, resumed_changes
from train.core.config import save_config as write_config
from train.core.distributed import initialize_from_env
from train.core.evaluation import EvaluationFailed, evaluate_after_save, evaluation_pending
from train.core.metrics import MetricsLog
from train.core.trackers import check_loggers
from train.core.trainer import Trainer
from train.engine.servers import ServerError

__all__ = ["main", "check_memory_plan", "with_step_rate"]


def _refusal(cfg: TrainConfig, run_dir: Path) -> str | None:
    """Why this start must not touch ``run_dir`` (read-only checks), or None."""
    if cfg.resume:
        return None  # parse_args checked that the run's config.json exists
    has_checkpoints = (run_dir / "checkpoints").is_dir() and any(
        (run_dir / "checkpoints").iterdir()
    )
    if has_checkpoints or (run_dir / "config.json").exists():
        return (
            f"{run_dir} holds a run; pass --resume to continue it or choose another --run-dir "
            "(nothing was written)"
        )
    return None


def _write_config(trainer: Trainer, path: Path) -> None:
    """config.json for a new run; on resume, rewritten only when a resumable field changed."""
    cfg = trainer.cfg
    if cfg.resume and path.exists():
        stored = read_run_config(path)
        changed = resumed_changes(cfg, stored)
        if not changed:
            return
        cfg = dataclasses.replace(cfg, run_dir=stored.get("run_dir", cfg.run_dir), **changed)
    write_config(cfg, path, algorithm=trainer.resolved())


def check_memory_plan(cfg: TrainConfig) -> TrainConfig:
    """The start-up memory check, before a weight is read: the run's programs compiled on
    abstract shapes (`train.plan.make_plan`) against ``--device-memory`` (default: what the
    GPU/TPU runtime reports; none on the CPU, where memory is the host's). When they do not fit,
    the settings the user left to their defaults are searched (`train.plan.propose`) and
    the run starts with the ones that fit, said on stderr; returns the configuration to run.
    Raises ``ValueError`` naming the change that fits (the user's own flags, more devices)."""
    if cfg.device_memory < 0:
        return cfg
    from train.plan import device_memory, make_plan, propose

    limit = int(cfg.device_memory) or device_memory()
    if limit is None:
        return cfg
    lead = jax.process_index() == 0
    plan = make_plan(cfg, limit=limit)
    if plan.fits:
        if lead:
            print(plan.verdict(), file=sys.stderr)
        return cfg
    given = getattr(cfg, "given_fields", ())
    proposal = propose(cfg, limit=limit, given=given)
    if not proposal.plan.fits:
        raise ValueError(f"the memory plan does not fit: {proposal.verdict()}")
    if lead:
        print(f"settings chosen to fit: {proposal.verdict()}", file=sys.stderr)
    chosen = proposal.cfg
    chosen.given_fields = given
    return chosen


def main(argv: list[str] | None = None) -> int:
    """One process of a run (several under ``jax.distributed``; see train/core/distributed.py). With
    several, the run directory must be on a filesystem they share; process 0 writes the config
    and metrics, and all of them write their checkpoint shards. Nothing is written before every
    check has passed."""
    initialize_from_env()
    try:
        cfg = parse_args(argv)
    except ValueError as e:  # a field's rule (TrainConfig names the field)
        print(f"refused (nothing was written): {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    refusal = _refusal(cfg, run_dir)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    try:
        check_loggers(cfg.loggers)
        cfg = check_memory_plan(cfg)
        trainer = Trainer(cfg)
    except (ValueError, FileNotFoundError) as e:  # our start-up checks name the flag or file
        print(f"refused (nothing was written): {e}", file=sys.stderr)
        return 2
    cfg = trainer.cfg
    lead = jax.process_index() == 0
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(trainer, run_dir / "config.json")
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    if checkpoints.latest() is not None:
        trainer.state = checkpoints.restore(trainer.state)
    start = int(trainer.state["step"])
    pending = evaluation_pending(run_dir, start, trainer.evaluation_due(start))
    log = None
    if lead:
        log = MetricsLog.of_run(run_dir, cfg, start_step=start)
    steps = range(start, cfg.steps)
    if cfg.max_staleness:  # rollouts from a worker running ahead (train/core/async_rollouts.py)
        results = trainer.run_async(steps)
    else:
        results = (trainer.step(step) for step in steps)
    try:
        if pending:  # the saved step's evaluation failed or was cut: it runs first
            run = partial(trainer.evaluate, start)
            evaluate_after_save(run, step=start, run_dir=run_dir, log=log)
        for step, metrics in zip(steps, with_step_rate(results), strict=False):
            # the step is written and saved before its evaluation, which may fail
            evaluate = trainer.evaluation_due(step + 1)
            if log is not None:
                log.write(metrics)
            if evaluate or (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                checkpoints.save(step + 1, trainer.state)
                if log is not None:
                    log.flush()
            if evaluate:
                checkpoints.wait()
                run = partial(trainer.evaluate, step + 1)
                evaluate_after_save(run, step=step + 1, run_dir=run_dir, log=log)
    except EvaluationFailed as e:
        print(f"stopped: {e}; continue with python -m train.run --resume --run-dir {run_dir}",
              file=sys.stderr)  # fmt: skip
        return 1
    except ServerError as e:  # the rollout servers failed: stop here, resumable
        checkpoints.wait()
        last = checkpoints.latest()
        print(
            f"stopped: {e}\nthe run resumes from its last checkpoint (step {last}): "
            f"python -m train.run --resume --run-dir {run_dir} [--rollout-url URL]",
            file=sys.stderr,
        )
        return 3
    finally:
        checkpoints.wait()
        if log is not None:
            log.close()
    return 0


def with_step_rate(results):
    """The steps' metrics with ``steps_per_s``: one over the wall time since the previous step
    was handed over (logging and checkpoints of the previous step included)."""
    last = time.perf_counter()
    for metrics in results:
        now = time.perf_counter()
        yield {**metrics, "steps_per_s": 1.0 / max(now - last, 1e-9)}
        last = now


if __name__ == "__main__":
    raise SystemExit(main())
