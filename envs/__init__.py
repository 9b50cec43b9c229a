"""Environments (text in, text out) and the rollout loop that turns episodes into batches.

import envs
envs.list_envs()                      # every registered environment
env = envs.make("synthetic-nav", seed=0)

The real-data environments (search, bfcl, tau2-*) and TextArena's games (textarena and its
short names) are registered lazily: their modules, and the
data packages they read, load on the first ``make``.
"""

import importlib

from envs import calls, synthetic  # noqa: F401  (registers the synthetic tasks)
from envs.base import Env, Observation, StepResult
from envs.registry import list_envs, make, register
from envs.textarena import SHORT_NAMES  # the table only: textarena itself loads on make

__all__ = ["Env", "Observation", "StepResult", "list_envs", "make", "register"]


def _lazy(module: str, attr: str, **fixed):
    def factory(**options):
        return getattr(importlib.import_module(module), attr)(**fixed, **options)

    return factory


register("search", _lazy("envs.search.env", "SearchEnv"))
register("bfcl", _lazy("envs.bfcl", "BFCLEnv"))
register("tau2-retail", _lazy("envs.tau2", "Tau2Env", domain="retail"))
register("tau2-airline", _lazy("envs.tau2", "Tau2Env", domain="airline"))
register("textarena", _lazy("envs.textarena", "TextArenaEnv"))
for _short, _game in SHORT_NAMES.items():
    register(_short, _lazy("envs.textarena", "TextArenaEnv", game=_game))
