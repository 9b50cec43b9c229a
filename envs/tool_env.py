"""What every tool-calling chat environment shares: the turn loop around a `ToolBox`.

A subclass provides the first messages (`ToolEnv._start`) and decides what a turn means
(`ToolEnv._respond`, given the turn's text and its tool results). This class counts turns and
calls, ends the episode by truncation at ``max_turns``, builds the ``info`` every environment
reports (``state_key``, ``tool_calls``, ``tool_errors``, ``success``, ``gold_answer``) and turns an
exception raised by the subclass itself into an error observation, so no model output can raise.
"""

from __future__ import annotations

import abc
import hashlib
import json
from typing import Any

from envs.base import Env, Observation, StepResult
from envs.tools import ToolBox, ToolResult

__all__ = ["ToolEnv", "Response", "exclude_tasks"]


class Response:
    """A subclass's answer to one turn."""

    def __init__(
        self,
        observation: Observation,
        *,
        reward: float = 0.0,
        terminated: bool = False,
        success: bool | None = None,
        info: dict[str, Any] | None = None,
    ):
        self.observation = observation
        self.reward = reward
        self.terminated = terminated
        self.success = success
        self.info = info or {}


def exclude_tasks(pool, exclude, key) -> list:
    """``pool`` without the tasks whose ``key(task)`` is in ``exclude`` (a trainer's
    ``--drop-long-tasks``); refuses to leave nothing."""
    if not exclude:
        return list(pool)
    drop = set(exclude)
    kept = [t for t in pool if key(t) not in drop]
    if not kept:
        raise ValueError(f"exclude_tasks: excludes every one of the {len(pool)} tasks")
    return kept


class ToolEnv(Env):
    """Args: toolbox (the tools), max_turns (assistant turns before truncation).

    Subclasses draw their tasks from ``self.pool`` and say what a task's first messages are
    (`_first_messages`) and its id (`_task_key`), so that `task_prompts` lists every prompt of the
    split."""

    turn_budget = 512  # tokens a turn (a tool call, a short reasoning, an answer)

    def __init__(self, toolbox: ToolBox, *, max_turns: int):
        if max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
        self.toolbox = toolbox
        self.max_turns = max_turns
        self.tools = toolbox.schemas()
        self.turns = 0
        self.tool_calls = 0
        self.tool_errors = 0
        self.success = False
        self._history: list[str] = []  # the successful calls so far (the GiGPO state)

    # -- what subclasses provide ------------------------------------------------------------
    @abc.abstractmethod
    def _start(self) -> list[dict]:
        """Picks the task; returns the first messages (system prompt, task)."""

    @abc.abstractmethod
    def _respond(self, text: str, results: list[ToolResult]) -> Response:
        """What the environment says after a turn whose tool calls gave ``results``."""

    def _task_id(self) -> str:
        return type(self).__name__

    def _task_key(self, task) -> str:
        """The id of one task of ``self.pool`` (what ``exclude_tasks`` names)."""
        return task.task_id

    def _first_messages(self, task) -> list[dict]:
        """The messages an episode of ``task`` starts with."""
        raise NotImplementedError

    def _schemas_for(self, task) -> list[dict]:
        """The tool schemas an episode of ``task`` is offered (default: the same for all)."""
        return self.tools

    def task_prompts(self):
        for task in self.pool:
            yield self._task_key(task), self._first_messages(task), self._schemas_for(task)

    @property
    def task_id(self) -> str:
        return self._task_id()

    chat_format = True  # speaks a chat template: the trainer may give it a checkpoint's codec

    @property
    def codec(self):
        """The bundled Qwen3 chat format with the real tokenizer (loaded on first use); a trainer
        with a checkpoint uses that checkpoint's own
        ([`envs.chat.chat_format`][envs.chat.chat_format])."""
        from envs.chat import (
            qwen3_chat_format,  # the tokenizer loads only when a codec is asked for
        )

        return qwen3_chat_format()

    def _close(self) -> None:
        """Called once when the episode ends (terminated or truncated): release its state."""

    # -- the loop ---------------------------------------------------------------------------
    def reset(self) -> list[dict]:
        self.turns = self.tool_calls = self.tool_errors = 0
        self.success = False
        self._history = []
        return self._start()

    @property
    def state_key(self) -> str:
        """The task and the successful calls so far, hashed (GiGPO's step key)."""
        body = json.dumps([self._task_id(), self._history], sort_keys=True, default=str)
        return hashlib.sha1(body.encode()).hexdigest()[:16]

    def step(self, text: str) -> StepResult:
        key = self.state_key
        self.turns += 1
        try:
            results = self.toolbox.run_turn(text)
            self.tool_calls += len(results)
            self.tool_errors += sum(not r.ok for r in results)
            self._history += [
                f"{r.name}:{json.dumps(r.arguments, sort_keys=True, default=str)}"
                for r in results
                if r.ok
            ]
            response = self._respond(text, results)
        except Exception as e:  # noqa: BLE001  (an environment bug is reported, not raised)
            response = Response(
                Observation(user=f"Error: the environment failed: {type(e).__name__}: {e}"),
                info={"error": True},
            )
        if response.success is not None:
            self.success = bool(response.success)
        terminated = response.terminated
        truncated = not terminated and self.turns >= self.max_turns
        if terminated or truncated:
            self._close()
        info = {
            "state_key": key,
            "success": self.success,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "gold_answer": self.gold_answer,
            **response.info,
        }
        return StepResult(response.observation, float(response.reward), terminated, truncated, info)

    @staticmethod
    def tool_observation(results: list[ToolResult], user: str | None = None) -> Observation:
        return Observation(tool_responses=tuple(r.text for r in results), user=user)
