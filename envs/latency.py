"""Tool latency injected into any environment: each ``step`` first sleeps a log-normal time.

    env = envs.make("search", seed=0, tool_latency=0.2)          # median 0.2 s a step
    env = envs.make("search", seed=0, tool_latency=0.2, tool_latency_sigma=1.0)

A benchmark's stand-in for tools that take time (a search backend, a sandbox, a web call):
``median · exp(σ · z)``, ``z ~ N(0, 1)``, drawn from a stream of the environment's own seed, so
the delays are the same on every run. The wrapped environment is unchanged otherwise (every
attribute reads through).
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["WithLatency"]


class WithLatency:
    """``env`` whose ``step`` sleeps ``median · exp(sigma · z)`` seconds first."""

    def __init__(self, env, *, median: float, sigma: float = 0.5, seed: int = 0):
        if median < 0 or sigma < 0:
            raise ValueError(
                f"tool_latency: median and sigma must be >= 0, got {median} and {sigma}"
            )
        self.env, self.median, self.sigma = env, float(median), float(sigma)
        self._rng = np.random.default_rng([seed, 0x1A7E])

    def delay(self) -> float:
        """The next step's delay in seconds."""
        return self.median * float(np.exp(self.sigma * self._rng.standard_normal()))

    def step(self, text):
        if self.median:
            time.sleep(self.delay())
        return self.env.step(text)

    def __getattr__(self, name):
        return getattr(self.env, name)
