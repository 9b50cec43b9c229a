"""Held-out evaluation: one set of tasks played by the policy, scored the same way everywhere.

The trainer's periodic evaluation and ``python -m train.evaluate`` both call :func:`evaluate_set`:
``episodes`` tasks (seeded apart from training's, :data:`train.core.episodes.EVAL_TASK_OFFSET`) x
``k`` samples each, played on the run's rollout engine (``train.engine.rollouts.play``); the result
is the success rate, unbiased pass@1 and pass@k (Chen et al. 2021), and the environment's own
figures (exact match, F1, evidence recall, database match, questions passed) as means over the
episodes that report them, each under ``eval_<name>_*``. With ``transcripts=True`` it also
returns every episode's conversation as text, with its outcome.
"""

from __future__ import annotations

import numpy as np

from envs.rollout import EPISODE_FIGURES
from train.core.distributed import gather_array
from train.core.episodes import EVAL_TASK_OFFSET, make_episodes
from train.core.metrics import pass_at_k
from train.engine.rollouts import EngineSettings, play

__all__ = ["evaluate_set"]


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
) -> tuple[dict[str, float], list[dict]]:
    """(metrics, transcripts) of one evaluation set (see the module docstring)."""
    batch_envs, groups = make_episodes(
        env, seed=seed, step=0, prompts=episodes, group=k, options=options, offset=EVAL_TASK_OFFSET
    )
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
