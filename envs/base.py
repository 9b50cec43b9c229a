"""The environment contract: Gymnasium-style, text in and text out.

``env.reset()`` returns the first observation: chat messages (a system prompt and the task) and
the tool schemas in ``env.tools``. ``env.step(text)`` takes the assistant's whole turn as text and
returns ``(observation, reward, terminated, truncated, info)``. Whatever the model writes, the
environment answers and keeps going: malformed tool calls, unknown tools, bad arguments, a tool
that raises or runs too long all become an error observation, never an exception.

``info`` carries what the trainer needs: ``state_key`` (a hashable key of the state the turn acted
in, for GiGPO), ``gold_answer`` (for TRACE), ``tool_calls`` (count so far), ``success``, and
environment-specific extras such as evidence recall (search: ``em``, ``f1``, ``evidence_recall``;
tau2: ``db_match``; bfcl: ``questions_passed``) and, where a cheap ground truth exists,
``action_quality`` (how good the turn's decision was; the synthetic tasks).

Attributes the trainer reads: ``split`` ("train" or "test": every environment draws its tasks from
one split, so held-out evaluation never sees a training task), ``task_id`` (the current episode's
task, hashable, after ``reset``), ``eval_fresh`` (whether fresh episodes of the training split are
worth evaluating beside the held-out ones: small task spaces), ``max_episode_tokens(codec)`` (the
longest episode in tokens, or None when unknown) and ``codec`` (the text <-> token codec the
environment speaks: [`envs.rollout.Codec`][envs.rollout.Codec]; the chat environments speak Qwen3's
format, [`envs.chat.qwen3_chat_format`][envs.chat.qwen3_chat_format]), plus ``state_key`` (GiGPO's
key of the current state) and ``gold_answer`` (TRACE's gold answer) as attributes.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["Observation", "StepResult", "Env"]


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the environment says after a turn: tool responses and/or a user message."""

    tool_responses: tuple[str, ...] = ()
    user: str | None = None


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: Observation
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]

    def __iter__(self):  # (observation, reward, terminated, truncated, info), Gymnasium order
        return iter((self.observation, self.reward, self.terminated, self.truncated, self.info))


class Env(abc.ABC):
    """One episode at a time; ``max_turns`` assistant turns at most (then truncation)."""

    tools: list[dict] = []
    max_turns: int = 8
    split: str = "train"
    eval_fresh: bool = False
    codec: Any = None  # every environment names its codec (see the module docstring)
    chat_format: bool = False  # True: speaks a chat template (a checkpoint's codec may replace it)
    gold_answers: bool = False  # every task has a gold answer (what TRACE scores)

    @property
    def turn_budget(self) -> int | None:
        """Tokens a turn may take (the trainer's default ``--max-new-tokens``): the
        environment's ``turn_length`` where it has one, else None (the trainer's 256)."""
        return getattr(self, "turn_length", None)

    @property
    def task_id(self):
        """The current episode's task (hashable); None before ``reset``."""
        return None

    def max_episode_tokens(self, codec=None) -> int | None:
        """The longest episode in tokens under ``codec``, or None when the environment cannot
        say (free-text turns)."""
        return None

    def task_prompts(self) -> Iterator[tuple[Any, list[dict], list[dict]]] | None:
        """(task id, first messages, tool schemas) of every task of this environment's split,
        so that a trainer can check each prompt against its length budget before it starts;
        None when the tasks cannot be listed (their prompts are short by construction)."""
        return None

    @abc.abstractmethod
    def reset(self) -> list[dict]:
        """Starts an episode; returns the first messages (system prompt, task)."""

    @abc.abstractmethod
    def step(self, text: str) -> StepResult:
        """Takes the assistant's whole turn as text."""

    @property
    def gold_answer(self) -> str | None:
        """The episode's gold answer (TRACE scores the reference model's belief in it)."""
        return None
