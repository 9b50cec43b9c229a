"""One call that plays a batch of episodes on the engine a run chose.

    settings = EngineSettings(slots=16, decode_chunk=32, env_workers=8)
    out = play(envs, codec, sampler, settings, group_ids=groups, max_len=4096,
               max_new_tokens=256, temperature=1.0, seed=key)

``continuous`` (the default) is
[`train.engine.continuous.collect_continuous`][train.engine.continuous.collect_continuous]; its
defaults (a slot per episode, a chunk of a whole turn budget, environments stepped inline) give the
lockstep rounds' rollouts bit for bit, so a run changes only where a user asks for more slots' worth
of concurrency. ``lockstep`` is ``envs.rollout.collect``: the reference loop (scripted policies in
the environment tests use it), kept as a flag to compare against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from envs.rollout import Rollouts, collect
from train.engine.continuous import REFILL, collect_continuous

__all__ = ["ENGINES", "EngineSettings", "play"]

ENGINES = ("continuous", "lockstep")


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """How episodes are played. 0 means the default: ``slots`` one per episode, ``decode_chunk``
    the turn budget, ``env_workers`` inline stepping, ``env_timeout`` no limit; ``decode_refill``
    the early chunk end (default `REFILL`, 0: chunks run to their end; see
    [`train.engine.continuous.collect_continuous`][train.engine.continuous.collect_continuous])."""

    engine: str = "continuous"
    slots: int = 0
    decode_chunk: int = 0
    env_workers: int = 0
    env_timeout: float = 0.0
    recompute: bool = True
    decode_refill: float = REFILL

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine: {self.engine!r} is not one of {ENGINES}")
        for name in ("slots", "decode_chunk", "env_workers", "env_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.decode_refill <= 1:
            raise ValueError(f"decode_refill: must be in [0, 1], got {self.decode_refill}")
        if self.env_timeout and not self.env_workers:
            raise ValueError("env_timeout: needs env_workers > 0 (an inline step cannot be timed)")
        if self.engine == "lockstep":  # any of the continuous engine's settings off its default
            given = [
                n
                for n in ("slots", "decode_chunk", "env_workers", "env_timeout", "decode_refill")
                if getattr(self, n) != getattr(EngineSettings, n)
            ]
            if given:
                raise ValueError(f"{given[0]}: a setting of the continuous engine, not lockstep")


def play(envs, codec, sampler, settings: EngineSettings | None = None, **kwargs: Any) -> Rollouts:
    """One episode in each env on the engine ``settings`` name; ``kwargs`` are
    ``envs.rollout.collect``'s (group_ids, max_len, max_new_tokens, temperature, seed, ...) and
    ``publish`` (weights between decode chunks; the continuous engine only)."""
    s = settings or EngineSettings()
    if s.engine == "lockstep":  # a round is sampled whole: no weights between chunks
        kwargs.pop("publish", None)
        return collect(envs, codec, sampler, **kwargs)
    return collect_continuous(
        envs,
        codec,
        sampler,
        slots=s.slots or None,
        chunk=s.decode_chunk or None,
        env_workers=s.env_workers,
        env_timeout=s.env_timeout or None,
        recompute=s.recompute,
        refill=s.decode_refill,
        **kwargs,
    )
