"""tau2-bench retail and airline: gold actions solve the tasks; doing nothing or wrong fails."""

from __future__ import annotations

import numpy as np
import pytest

import envs
from envs.chat import format_tool_call
from envs.checks import play_episode
from envs.tau2 import Tau2Env, _gold_hash, _import, _pristine_db, _pristine_hash, load_tasks


def _oracle_failures(domain, tasks):
    failures = []
    for task in tasks:
        env = Tau2Env(domain=domain, task=task)
        env.reset()
        r = play_episode(env, env.oracle_turns())
        if not (r.terminated and r.reward == 1.0):
            failures.append((task.task_id, r.info))
    return failures


@pytest.mark.parametrize("domain, n", [("retail", 12), ("airline", 6)])
def test_gold_actions_solve_tasks(domain, n):
    tasks = load_tasks(domain, "all")
    picks = np.random.default_rng(0).choice(len(tasks), size=n, replace=False)
    assert not _oracle_failures(domain, [tasks[i] for i in sorted(picks)])


@pytest.mark.slow
@pytest.mark.parametrize("domain", ["retail", "airline"])
def test_gold_actions_solve_every_task(domain):
    assert not _oracle_failures(domain, load_tasks(domain, "all"))
    kit_class, _ = _import(domain)  # and the shared pristine database was never written
    assert kit_class(_pristine_db(domain)).get_db_hash() == _pristine_hash(domain)


def _doing_nothing_fails(domain, tasks):
    changing = [t for t in tasks if _gold_hash(domain, t) != _pristine_hash(domain)]
    assert len(changing) >= len(tasks) // 3
    for task in changing:
        r = play_episode(
            Tau2Env(domain=domain, task=task), ["I am sorry, I cannot help with that."]
        )
        assert r.terminated and r.reward == 0.0 and not r.info["db_match"], task.task_id


@pytest.mark.parametrize("domain", ["retail", "airline"])
def test_doing_nothing_fails_tasks_that_change_the_database(domain):
    _doing_nothing_fails(domain, load_tasks(domain, "all")[:12])


@pytest.mark.slow
@pytest.mark.parametrize("domain", ["retail", "airline"])
def test_doing_nothing_fails_every_task_that_changes_the_database(domain):
    _doing_nothing_fails(domain, load_tasks(domain, "all"))


def test_a_wrong_write_fails():
    # the first retail task exchanges two items; exchanging only one leaves a different database
    task = next(t for t in load_tasks("retail", "all") if t.task_id == "0")
    name, args = task.actions[-1]
    wrong = dict(args, item_ids=args["item_ids"][:1], new_item_ids=args["new_item_ids"][:1])
    r = play_episode(Tau2Env(domain="retail", task=task), [format_tool_call(name, wrong), "Done."])
    assert r.terminated and r.reward == 0.0


def test_communicate_info_is_required():
    task = next(t for t in load_tasks("airline", "all") if t.communicate)
    env = Tau2Env(domain="airline", task=task)
    env.reset()
    turns = env.oracle_turns()
    r = play_episode(Tau2Env(domain="airline", task=task), turns[:-1] + ["Done."])
    assert r.info["db_match"] and not r.info["communicated"] and r.reward == 0.0


def test_splits_and_registry():
    for domain in ("retail", "airline"):
        train, test = load_tasks(domain, "train"), load_tasks(domain, "test")
        assert train and test and not {t.task_id for t in train} & {t.task_id for t in test}
    env = envs.make("tau2-airline", seed=0)
    messages = env.reset()
    assert "<policy>" in messages[0]["content"] and messages[1]["role"] == "user"
    assert {"book_reservation", "cancel_reservation"} <= {t["function"]["name"] for t in env.tools}
    with pytest.raises(ValueError, match="domain: must be one of"):
        load_tasks("telecom")


def test_hostile_outputs_never_raise():
    rng = np.random.default_rng(0)
    env = envs.make("tau2-retail", seed=2, max_turns=30)
    env.reset()
    names = [t["function"]["name"] for t in env.tools]
    for text in [
        "<tool_call>{{{</tool_call>",
        format_tool_call("get_order_details", {"order_id": 12}),
        format_tool_call("get_order_details", {"order_id": "#nope"}),
        format_tool_call("cancel_pending_order", {"order_id": "#W0000000", "reason": "x"}),
        format_tool_call("drop_database", {}),
        "".join(map(chr, rng.integers(1, 0x2FFF, size=300))) + "<tool_call>",
    ] + [format_tool_call(n, {}) for n in names]:
        r = env.step(text)
        assert not r.terminated and r.reward == 0.0, text
        assert r.observation.tool_responses
    assert r.info["tool_errors"] >= 6


@pytest.mark.parametrize("domain", ["retail", "airline"])
def test_copy_on_read_database_matches_a_deep_copy(domain):
    import copy

    import envs.tau2 as tau2

    kit_class, _ = _import(domain)
    for task in load_tasks(domain, "all")[:5]:
        cow, full = tau2._fresh_kit(domain), kit_class(copy.deepcopy(_pristine_db(domain)))
        for name, args in task.actions:
            outs = []
            for kit in (cow, full):
                try:
                    outs.append(tau2._to_text(kit.use_tool(name, **copy.deepcopy(args))))
                except Exception as e:  # noqa: BLE001  (gold actions may fail; both must agree)
                    outs.append(repr(e))
            assert outs[0] == outs[1], (task.task_id, name)
        assert cow.get_db_hash() == full.get_db_hash(), task.task_id
        # reading every record through every path still leaves the pristine tables untouched
        for table in cow.db.__dict__.values():
            if isinstance(table, dict):
                list(table.values()), list(table.items())
    assert kit_class(_pristine_db(domain)).get_db_hash() == _pristine_hash(domain)
