"""Held-out evaluation: one set of tasks played by the policy, scored the same way everywhere.

The trainer's periodic evaluation and ``python -m train.evaluate`` both call
[`evaluate_set`][train.core.evaluation.evaluate_set]: ``episodes`` tasks (seeded apart from
training's, `train.core.episodes.EVAL_TASK_OFFSET`) x ``k`` samples each, played on the run's
rollout engine (``train.engine.rollouts.play``); the result is the success rate, unbiased pass@1 and
pass@k (Chen et al. 2021), and the environment's own figures (exact match, F1, evidence recall,
database match, questions passed) as means over the episodes that report them, each under
``eval_<name>_*``. With ``transcripts=True`` it also returns every episode's conversation as text,
with its outcome.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from envs.rollout import EPISODE_FIGURES
from train.core.distributed import gather_array
from train.core.episodes import EVAL_TASK_OFFSET, make_episodes
from train.core.metrics import pass_at_k, read_metrics
from train.engine.rollouts import EngineSettings, play

__all__ = [
    "evaluate_set",
    "evaluate_after_save",
    "evaluation_due",
    "evaluation_pending",
    "EvaluationFailed",
]


def evaluate_set(
    name: str,
    *,
    env: str,
    options: dict,
    codec,
    sampler,
    seed: int,
    episodes: int,
    k: int,
    max_len: int,
    max_new_tokens: int,
    temperature: float,
    key,
    transcripts: bool = False,
    engine: EngineSettings | None = None,
    progress: bool = False,
) -> tuple[dict[str, float], list[dict]]:
    """(metrics, transcripts) of one evaluation set (see the module docstring). With
    ``progress`` a bar on stderr counts the episodes that ended and the success so far."""
    batch_envs, groups = make_episodes(
        env, seed=seed, step=0, prompts=episodes, group=k, options=options, offset=EVAL_TASK_OFFSET
    )
    bar = None
    if progress:
        bar = tqdm(total=len(batch_envs), desc=f"eval {name}", unit="episode", dynamic_ncols=True)
        played = batch_envs
        batch_envs = [_Watched(e, bar) for e in batch_envs]
    try:
        out = play(
            batch_envs,
            codec,
            sampler,
            engine,
            group_ids=groups,
            max_len=max_len,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=key,
        )
    except BaseException:
        if bar is not None:
            bar.close()
        raise
    if bar is not None:  # episodes the rollout cut by length end here; the true figures
        batch_envs = played
        bar.set_postfix(success=f"{np.mean([ep['success'] for ep in out.episodes]):.2f}")
        bar.update(bar.total - bar.n)
        bar.close()
    success = gather_array(np.array([ep["success"] for ep in out.episodes], float))
    correct = success.reshape(-1, k).sum(axis=1).astype(int)
    metrics = {
        f"eval_{name}_success_rate": float(success.mean()),
        f"eval_{name}_pass@1": float(np.mean([pass_at_k(k, c, 1) for c in correct])),
        f"eval_{name}_pass@{k}": float(np.mean([pass_at_k(k, c, k) for c in correct])),
    }
    for figure in EPISODE_FIGURES:
        values = np.array([float(ep.get(figure, np.nan)) for ep in out.episodes])
        values = gather_array(values)
        if np.isfinite(values).any():
            metrics[f"eval_{name}_env_{figure}"] = float(np.nanmean(values))
    records = []
    if transcripts:
        for i, (ep, e) in enumerate(zip(out.episodes, batch_envs, strict=True)):
            records.append(
                {
                    "set": name,
                    "task": str(e.task_id),
                    "group": int(groups[i]),
                    **{key_: ep[key_] for key_ in ep if key_ != "tokens"},
                    "tokens": int(ep["tokens"]),
                    "text": codec.decode(out.batch.tokens[i, : ep["tokens"]].tolist()),
                }
            )
    return metrics, records


class _Watched:
    """An environment that moves ``bar`` on when its episode ends (the environment ended it;
    episodes cut by length are counted when the set is done), with the success so far.
    Environments may be stepped from several threads: the count is under a lock."""

    _lock = threading.Lock()

    def __init__(self, env, bar):
        self.env, self.bar = env, bar

    def step(self, text):
        result = self.env.step(text)
        if result.terminated or result.truncated:
            with self._lock:
                bar = self.bar
                bar.wins = getattr(bar, "wins", 0) + bool(result.info.get("success", False))
                bar.update(1)
                bar.set_postfix(success=f"{bar.wins / max(bar.n, 1):.2f}")
        return result

    def __getattr__(self, name):
        return getattr(self.env, name)


class EvaluationFailed(RuntimeError):
    """An evaluation raised after its step was saved; the message is one line and names the file
    holding the traceback."""


def evaluate_after_save(
    evaluate: Callable[[], dict[str, float]], *, step: int, run_dir: str | Path, log=None
) -> dict[str, float]:
    """Runs ``evaluate()`` for a step whose metrics line and checkpoint are already written, and
    adds its figures to that line (``log.amend``). When it raises, the traceback goes to
    ``run_dir/errors/evaluation-step<N>.txt`` and
    [`EvaluationFailed`][train.core.evaluation.EvaluationFailed] says so in one line:
    the step's training is kept, and ``--resume`` runs this evaluation again first."""
    try:
        figures = evaluate()
    except Exception as e:
        path = Path(run_dir) / "errors" / f"evaluation-step{step}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(traceback.format_exc())
        raise EvaluationFailed(
            f"the evaluation after step {step} failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); step {step} is saved, the traceback is "
            f"in {path}"
        ) from e
    if log is not None:
        log.amend(figures)
    return figures


def evaluation_due(steps_done: int, every: int, steps: int) -> bool:
    """Whether held-out evaluation runs after ``steps_done`` steps: every ``every`` steps
    (0: never) and after the last of ``steps``."""
    return bool(every) and (steps_done % every == 0 or steps_done == steps)


def evaluation_pending(run_dir: str | Path, steps_done: int, due: bool) -> bool:
    """Whether a resumed run's saved step ``steps_done`` still lacks the evaluation it was due
    (its evaluation failed, or the run was killed during it): its ``metrics.jsonl`` line has no
    ``eval_`` figure. Read from the file, so every process of a run reads the same answer."""
    if not due or steps_done <= 0:
        return False
    lines = [m for m in read_metrics(run_dir) if m.get("step") == steps_done]
    return bool(lines) and not any(k.startswith("eval_") for k in lines[-1])
