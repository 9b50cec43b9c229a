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


def make(name: str, *, seed: int = 0, **options) -> Env:
    """Builds environment ``name``; unknown names list the registered ones."""
    if name not in _REGISTRY:
        raise ValueError(f"env: unknown environment {name!r}; choose one of {list_envs()}")
    return _REGISTRY[name](seed=seed, **options)
