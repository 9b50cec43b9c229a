"""Tools the agent calls, and the one dispatcher that never lets a model output raise.

A `Tool` is a name, a description, a JSON-schema ``parameters`` object and a Python
callable. `ToolBox` reads every ``<tool_call>`` of an assistant turn
([`envs.chat.parse_tool_calls`][envs.chat.parse_tool_calls]), checks each call against its tool's
schema and runs it under a time limit. Every failure becomes a `ToolResult` whose text the agent
reads on its next turn:

- malformed or unclosed ``<tool_call>`` JSON, more calls in one turn than ``max_calls``;
- an unknown tool name (the known ones are listed);
- a missing required argument, an unexpected one, a value of the wrong JSON type or outside the
  schema's ``enum``, an argument longer than ``max_arg_chars``;
- a tool that raises (its exception type and message), or runs past ``time_limit_s``;
- an output longer than ``max_output_chars`` is cut, and says so.

The schemas are shown to the model in the chat template's OpenAI form
(``{"type": "function", "function": {...}}``).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from envs.chat import ToolCall, ToolCallError, parse_tool_calls

__all__ = ["Tool", "ToolResult", "ToolBox", "ToolTimeout", "check_arguments", "run_with_time_limit"]

# JSON-schema type names, plus the aliases BFCL's function docs use.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "float": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "tuple": (list,),
    "object": (dict,),
    "dict": (dict,),
    "null": (type(None),),
}


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """One call's outcome: ``text`` is what the agent sees; ``value`` the tool's return value."""

    name: str | None
    arguments: dict[str, Any] | None
    ok: bool
    text: str
    value: Any = None


class ToolTimeout(Exception):
    pass


def _type_ok(value: Any, type_name: Any) -> bool:
    if isinstance(type_name, list):
        return any(_type_ok(value, t) for t in type_name)
    allowed = _JSON_TYPES.get(str(type_name))
    if allowed is None:  # "any" or an unknown annotation: accept
        return True
    if isinstance(value, bool) and bool not in allowed:
        return False  # JSON true is not an integer
    return isinstance(value, allowed)


def check_arguments(
    parameters: dict[str, Any], arguments: dict[str, Any], *, max_chars: int
) -> str | None:
    """The first rule ``arguments`` break against the JSON-schema object ``parameters``, or None.

    Checked: required keys present, no key outside ``properties`` (unless
    ``additionalProperties`` is true), each value's JSON type (and an array's item type), ``enum``,
    and each value's JSON length at most ``max_chars``.
    """
    props = parameters.get("properties", {}) or {}
    for key in parameters.get("required", []) or []:
        if key not in arguments:
            return f"missing required argument {key!r}"
    for key, value in arguments.items():
        if key not in props:
            if parameters.get("additionalProperties") is True:
                continue
            return f"unexpected argument {key!r}; the arguments are {sorted(props)}"
        spec = props[key] or {}
        try:
            size = len(json.dumps(value))
        except (TypeError, ValueError, RecursionError):
            return f"argument {key!r} is not JSON-serialisable"
        if size > max_chars:
            return f"argument {key!r} is {size} characters long (at most {max_chars})"
        if "type" in spec and not (value is None and spec.get("nullable")):
            if not _type_ok(value, spec["type"]):
                return (
                    f"argument {key!r} must be of type {spec['type']}, got {type(value).__name__}"
                )
            items = spec.get("items")
            if isinstance(value, list) and isinstance(items, dict) and "type" in items:
                if not all(_type_ok(v, items["type"]) for v in value):
                    return f"argument {key!r} must be a list of {items['type']}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}, got {value!r}"
    return None


def run_with_time_limit(fn: Callable[[], Any], seconds: float) -> Any:
    """``fn()``, raising `ToolTimeout` when it runs past ``seconds``.

    On the main thread an interval timer (SIGALRM) interrupts the call itself. Elsewhere (signals
    only reach the main thread) the call runs in a daemon thread that is abandoned on timeout.
    """
    if seconds <= 0:
        return fn()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):

        def on_alarm(signum, frame):
            raise ToolTimeout(f"ran past its time limit of {seconds:g} s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (reported to the caller below)
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise ToolTimeout(f"ran past its time limit of {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _render(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        return str(value)


class ToolBox:
    """Runs an assistant turn's tool calls against ``tools``; never raises on model output.

    Args:
      tools: the tools (names must be unique).
      time_limit_s: per call; 0 disables the limit.
      max_calls: calls per turn (later ones are answered with an error, not run).
      max_arg_chars: per argument, as JSON.
      max_output_chars: the text of a result is cut to this length.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        time_limit_s: float = 5.0,
        max_calls: int = 8,
        max_arg_chars: int = 2_000,
        max_output_chars: int = 4_000,
    ):
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError("tools: two tools share a name")
        self.time_limit_s = time_limit_s
        self.max_calls = max_calls
        self.max_arg_chars = max_arg_chars
        self.max_output_chars = max_output_chars

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def run_turn(self, text: str) -> list[ToolResult]:
        """Every tool call in ``text``, run in order (none: an empty list)."""
        results = []
        for i, call in enumerate(parse_tool_calls(text)):
            if i >= self.max_calls:
                results.append(
                    ToolResult(
                        None,
                        None,
                        False,
                        f"Error: more than {self.max_calls} tool calls in one turn; not run",
                    )
                )
            elif isinstance(call, ToolCallError):
                results.append(ToolResult(None, None, False, f"Error: {call.reason}"))
            else:
                results.append(self.call(call))
        return results

    def call(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools))
            return ToolResult(
                call.name,
                call.arguments,
                False,
                f"Error: unknown tool {call.name!r}; the tools are: {known}",
            )
        problem = check_arguments(tool.parameters, call.arguments, max_chars=self.max_arg_chars)
        if problem is not None:
            return ToolResult(call.name, call.arguments, False, f"Error: {call.name}: {problem}")
        try:
            value = run_with_time_limit(lambda: tool.fn(**call.arguments), self.time_limit_s)
        except ToolTimeout as e:
            return ToolResult(call.name, call.arguments, False, f"Error: {call.name} {e}")
        except (Exception, SystemExit) as e:  # noqa: BLE001  (a raising tool is an observation)
            return ToolResult(
                call.name,
                call.arguments,
                False,
                f"Error: {call.name} raised {type(e).__name__}: {e}",
            )
        text = _render(value)
        if len(text) > self.max_output_chars:
            text = (
                text[: self.max_output_chars] + f" ... [cut at {self.max_output_chars} characters]"
            )
        return ToolResult(call.name, call.arguments, True, text, value)
