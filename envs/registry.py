"""``list_envs()`` names every registered environment; ``make(name, seed=..., **options)``."""

from __future__ import annotations

from collections.abc import Callable

from envs.base import Env

__all__ = ["register", "list_envs", "make"]

_REGISTRY: dict[str, Callable[..., Env]] = {}


def register(name: str, factory: Callable[..., Env]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"env: {name!r} is already registered")
    _REGISTRY[name] = factory


def list_envs() -> list[str]:
    return sorted(_REGISTRY)


def make(
    name: str,
    *,
    seed: int = 0,
    tool_latency: float = 0.0,
    tool_latency_sigma: float = 0.5,
    **options,
) -> Env:
    """Builds environment ``name``; unknown names list the registered ones.

    ``tool_latency`` > 0 (seconds, the median) makes every ``step`` first sleep a log-normal
    delay of spread ``tool_latency_sigma`` (``envs.latency.WithLatency``): any environment, as
    slow as a real tool, for the rollout engine's benchmarks.
    """
    if name not in _REGISTRY:
        raise ValueError(f"env: unknown environment {name!r}; choose one of {list_envs()}")
    env = _REGISTRY[name](seed=seed, **options)
    if tool_latency:
        from envs.latency import WithLatency

        env = WithLatency(env, median=tool_latency, sigma=tool_latency_sigma, seed=seed)
    return env
