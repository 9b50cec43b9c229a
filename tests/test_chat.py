"""The real Qwen3 tokenizer offline; incremental conversations; tool-call parsing."""

from __future__ import annotations

import socket

import pytest

from envs.chat import (
    ChatFormat,
    ToolCall,
    ToolCallError,
    format_tool_call,
    load_tokenizer,
    parse_tool_calls,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the corpus.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(load_tokenizer())  # its own prompt cache


def test_tokenizer_loads_with_the_network_off(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network is off in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = load_tokenizer.__wrapped__()  # a fresh load, not the process's cached tokenizer
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert len(tok) >= 151643
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_rendered_tool_prompt(chat):
    ids = chat.prompt(
        [{"role": "system", "content": "You are a researcher."}, {"role": "user", "content": "Q?"}],
        tools=TOOLS,
    )
    text = chat.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a researcher.\n\n# Tools")
    assert '"name": "search"' in text and "<tools>" in text
    assert text.endswith(
        "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_incremental_conversation_keeps_what_was_sampled(chat):
    messages = [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Find X."}]
    prompt = chat.prompt(messages, tools=TOOLS)
    call = format_tool_call("search", {"query": "X"})
    turn1 = chat.encode(call) + [chat.im_end]  # as if sampled, the stop token included
    obs = chat.observation_ids(["doc 1: X is 42"])
    turn2 = chat.encode("X is 42.") + [chat.im_end]
    ids = prompt + turn1 + obs + turn2
    # Every segment is kept exactly: the ids are the concatenation, and decode in place.
    text = chat.decode(ids)
    assert (
        text == chat.decode(prompt) + call + "<|im_end|>" + chat.decode(obs) + "X is 42.<|im_end|>"
    )
    assert chat.assistant_text(turn1) == call
    # The observation is the template's own tool-response block plus the next generation prompt.
    rendered = chat.tokenizer.apply_chat_template(
        messages
        + [
            {"role": "assistant", "content": call},
            {"role": "tool", "content": "doc 1: X is 42"},
            {"role": "assistant", "content": "X is 42."},
        ],
        tools=TOOLS,
        tokenize=False,
    )
    assert rendered.endswith(chat.decode(obs + turn2) + "\n")
    # Re-rendering is what we never do: the template rewrites the first turn's think block, so a
    # re-tokenised conversation would not match the sampled ids (verl's retokenisation drift).
    assert chat.decode(prompt + turn1) not in rendered


def test_tool_call_round_trip_and_hostile_text():
    text = "Let me look.\n" + format_tool_call("search", {"query": "capital of France"})
    assert parse_tool_calls(text) == [ToolCall("search", {"query": "capital of France"})]
    string_args = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(string_args) == [ToolCall("f", {"a": 1})]
    assert parse_tool_calls("no call at all") == []
    bad = {
        "<tool_call>{not json}</tool_call>": "invalid JSON",
        '<tool_call>{"arguments": {}}</tool_call>': "expected",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "JSON object",
        '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>': "not JSON",
        '<tool_call>{"name": "f"': "unclosed",
        "<tool_call>" + "[" * 100_000 + "</tool_call>": "longer than",
        "<tool_call>" + "[" * 5_000 + "]" * 5_000 + "</tool_call>": "",
    }
    for text, reason in bad.items():
        (result,) = parse_tool_calls(text)
        assert isinstance(result, ToolCallError), text[:40]
        assert reason in result.reason
