"""The BFCL multi-turn environment: gold calls solve every task, silence and hostility do not."""

from __future__ import annotations

import numpy as np
import pytest

import envs
from envs.bfcl import EXCLUDED, BFCLEnv, load_tasks
from envs.chat import format_tool_call
from envs.checks import play_episode


def test_tasks_load_and_split():
    tasks = load_tasks("all")
    assert len(tasks) + len(EXCLUDED) == 200
    assert set(EXCLUDED) == {"multi_turn_base_173"}  # its gold call breaks its own schema
    train, test = load_tasks("train"), load_tasks("test")
    assert len(train) + len(test) == len(tasks)
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    assert all(len(t.questions) == len(t.gold) >= 1 for t in tasks)
    with pytest.raises(ValueError, match="split: must be"):
        load_tasks("dev")


def test_gold_calls_solve_every_task():
    failures = []
    for task in load_tasks("all"):
        env = BFCLEnv(task=task, split="all")
        r = play_episode(env, lambda e: e.oracle_turn())
        if not (r.terminated and r.reward == 1.0 and r.info["success"]):
            failures.append((task.task_id, r.info.get("failure")))
        assert r.info["question"] == len(task.questions) - 1
    assert not failures, failures


def test_a_silent_agent_gets_zero_on_every_task():
    for task in load_tasks("all"):
        r = play_episode(BFCLEnv(task=task, split="all"), lambda e: "I cannot help with that.")
        assert r.terminated and r.reward == 0.0, task.task_id


def test_wrong_arguments_fail_the_state_check():
    # the file-system task's first request, done with the wrong folder name
    task = next(t for t in load_tasks("all") if t.task_id == "multi_turn_base_0")
    env = BFCLEnv(task=task, split="all")
    env.reset()
    env.step(
        format_tool_call("cd", {"folder": "document"})
        + format_tool_call("mkdir", {"dir_name": "tmp"})
    )
    r = env.step("Done.")
    assert r.terminated and r.reward == 0.0 and "state" in r.info["failure"]


def test_questions_arrive_one_after_another():
    task = next(t for t in load_tasks("all") if len(t.questions) >= 3)
    env = BFCLEnv(task=task, split="all")
    first = env.reset()
    assert first[-1]["content"] == task.questions[0]
    env.step(env.oracle_turn())
    r = env.step(env.oracle_turn())  # the plain reply closes the question
    assert r.observation.user == task.questions[1] and not r.terminated


def test_hostile_outputs_never_raise():
    rng = np.random.default_rng(0)
    env = envs.make("bfcl", seed=3, max_turns=40)
    env.reset()
    names = [t["function"]["name"] for t in env.tools]
    hostile = [
        "<tool_call>{oops</tool_call>",
        format_tool_call("exec", {"code": "import os"}),
        format_tool_call("__init__", {}),
        format_tool_call("_load_scenario", {"scenario": {}}),
        format_tool_call(names[0], {"no_such_argument": 1}),
        format_tool_call(names[0], {"x" * 5000: 1}),
        "".join(map(chr, rng.integers(1, 0x2FFF, size=400))) + "<tool_call>",
    ]
    for text in hostile:
        r = env.step(text)
        assert r.reward == 0.0 and not r.terminated, text
        assert all(x.startswith("Error") for x in r.observation.tool_responses), r.observation
    # every function with garbage arguments: an error observation each time
    for name in names:
        r = env.step(format_tool_call(name, {"a": object.__name__}))
        assert not r.terminated
    assert r.info["tool_errors"] >= len(hostile)


def test_concurrent_episodes_of_one_task_keep_their_own_state():
    # A group's rollouts of one task run side by side; a backend's shared mutable default
    # (TwitterAPI.post_tweet's mentions=[]) once leaked state between them.
    failures = []
    for task in load_tasks("all"):
        pair = [BFCLEnv(task=task, split="all") for _ in range(2)]
        for env in pair:
            env.reset()
        done = [None, None]
        while not all(done):
            for k, env in enumerate(pair):
                if done[k] is None:
                    r = env.step(env.oracle_turn())
                    if r.terminated or r.truncated:
                        done[k] = r
        failures += [task.task_id for r in done if r.reward != 1.0]
    assert not failures, failures
