"""Checks a command makes before its first step, so that nothing fails after work was done.

A run that trains for an hour and then finds, at its first evaluation, that its environment
cannot draw a held-out task has lost the hour. Every command that will later play a split
(``train.run``'s evaluation, ``train.evaluate``, ``train.sft``'s held-out demonstrations and
evaluation, the studies) draws one task of it here, at start-up, and refuses with the flag that
chose the split and the way out.
"""

from __future__ import annotations

import envs

__all__ = ["check_split_draws"]


def check_split_draws(env: str, options: dict, *, flag: str) -> None:
    """Draws one task of ``options['split']`` from environment ``env`` (one ``reset``).

    Raises ``ValueError`` naming ``flag`` (the command's flag for the split) when the environment
    cannot be built or cannot draw a task of that split; for a split other than ``train`` the
    message names ``flag train`` as the way out, and what it costs: the tasks are then not held
    out from training.
    """
    split = options.get("split", "train")
    try:
        envs.make(env, seed=0, **options).reset()
    except ValueError as e:
        way_out = ""
        if split != "train":
            way_out = (
                f"; evaluate on training tasks with {flag} train (its success is then measured "
                "on tasks training may also draw, not held out)"
            )
        raise ValueError(f"{flag} {split}: {env} cannot draw a {split!r} task: {e}{way_out}") from e
