"""The tool dispatcher: every malformed call is an error the agent reads, never an exception."""

from __future__ import annotations

import threading
import time

import pytest

from envs.chat import format_tool_call
from envs.tools import Tool, ToolBox, ToolTimeout, check_arguments, run_with_time_limit

SCHEMA = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "k": {"type": "integer"},
        "mode": {"type": "string", "enum": ["fast", "slow"]},
        "ids": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["query"],
}


def _box(**kw):
    def echo(query, k=1, mode="fast", ids=()):
        return {"query": query, "k": k}

    def boom(query):
        raise RuntimeError("disk on fire")

    def sleepy(query):
        time.sleep(5)
        return "late"

    def huge(query):
        return "x" * 50_000

    tools = [
        Tool("echo", "", SCHEMA, echo),
        Tool("boom", "", {"type": "object", "properties": {"query": {"type": "string"}}}, boom),
        Tool("sleepy", "", {"type": "object", "properties": {"query": {"type": "string"}}}, sleepy),
        Tool("huge", "", {"type": "object", "properties": {"query": {"type": "string"}}}, huge),
    ]
    return ToolBox(tools, **kw)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({}, "missing required argument 'query'"),
        ({"query": 3}, "'query' must be of type string, got int"),
        ({"query": "a", "k": True}, "'k' must be of type integer, got bool"),
        ({"query": "a", "k": 1.5}, "'k' must be of type integer, got float"),
        ({"query": "a", "mode": "medium"}, "'mode' must be one of"),
        ({"query": "a", "ids": [1, "2"]}, "'ids' must be a list of integer"),
        ({"query": "a", "extra": 1}, "unexpected argument 'extra'"),
        ({"query": "a" * 3000}, "'query' is 3002 characters long"),
    ],
)
def test_argument_rules_name_the_argument(arguments, message):
    assert message in check_arguments(SCHEMA, arguments, max_chars=2000)


def test_valid_arguments_pass():
    assert (
        check_arguments(SCHEMA, {"query": "a", "k": 2, "mode": "slow", "ids": [1]}, max_chars=100)
        is None
    )


def test_every_failure_is_an_observation():
    box = _box(time_limit_s=0.3, max_calls=3)
    turns = {
        "no call at all": None,
        "<tool_call>{not json</tool_call>": "invalid JSON",
        "<tool_call>[1, 2]</tool_call>": 'expected {"name"',
        '<tool_call>{"name": "echo", "arguments": {"query": "a"}}': "unclosed <tool_call>",
        format_tool_call(
            "nope", {}
        ): "unknown tool 'nope'; the tools are: boom, echo, huge, sleepy",
        format_tool_call("echo", {"query": 1}): "must be of type string",
        format_tool_call("boom", {"query": "a"}): "boom raised RuntimeError: disk on fire",
        format_tool_call("sleepy", {"query": "a"}): "sleepy ran past its time limit of 0.3 s",
        format_tool_call("huge", {"query": "a"}): "[cut at 4000 characters]",
    }
    for text, expected in turns.items():
        results = box.run_turn(text)
        if expected is None:
            assert results == []
            continue
        assert len(results) == 1, text
        assert expected in results[0].text, (text, results[0].text)
        assert results[0].ok == (expected.startswith("[cut")), text


def test_a_good_call_returns_its_value_and_json_text():
    [r] = _box().run_turn(format_tool_call("echo", {"query": "a", "k": 2}))
    assert r.ok and r.value == {"query": "a", "k": 2} and r.text == '{"query": "a", "k": 2}'


def test_too_many_calls_in_one_turn_are_refused():
    box = _box(max_calls=2)
    results = box.run_turn("\n".join(format_tool_call("echo", {"query": str(i)}) for i in range(4)))
    assert [r.ok for r in results] == [True, True, False, False]
    assert "more than 2 tool calls" in results[3].text


def test_time_limit_off_the_main_thread():
    box = _box(time_limit_s=0.2)
    out = {}

    def worker():
        out["r"] = box.run_turn(format_tool_call("sleepy", {"query": "a"}))

    t = threading.Thread(target=worker)
    t.start()
    t.join(3)
    assert "ran past its time limit" in out["r"][0].text


def test_run_with_time_limit_restores_the_alarm():
    assert run_with_time_limit(lambda: 7, 1.0) == 7
    with pytest.raises(ToolTimeout):
        run_with_time_limit(lambda: time.sleep(2), 0.1)
    time.sleep(0.2)  # no stray alarm fires after the call


def test_duplicate_tool_names_are_rejected():
    t = Tool("a", "", {"type": "object"}, lambda: 1)
    with pytest.raises(ValueError, match="share a name"):
        ToolBox([t, t])
