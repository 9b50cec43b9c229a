"""Environments (text in, text out) and the rollout loop that turns episodes into batches.

import envs
envs.list_envs()                      # every registered environment
env = envs.make("synthetic-nav", seed=0)
"""

from envs import synthetic  # noqa: F401  (registers the synthetic tasks)
from envs.base import Env, Observation, StepResult
from envs.registry import list_envs, make, register

__all__ = ["Env", "Observation", "StepResult", "list_envs", "make", "register"]
