"""Asynchronous rollouts: the worker's version bookkeeping, the watchdog, K = 0 as the synchronous
loop, and an asynchronous run that trains, corrects, logs and resumes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from train import run
from train.core import trainer as trainer_module
from train.core.async_rollouts import FairLock, RolloutWorker, WorkerStalled
from train.core.config import parse_args
from train.core.metrics import read_metrics

TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--kv-heads", "1", "--prompts-per-step",
        "4", "--group-size", "2", "--eval-every", "0", "--no-progress",
        "--minibatches", "2"]  # fmt: skip


@pytest.mark.parametrize("k", [0, 1, 3])
def test_each_step_is_sampled_by_a_version_within_the_staleness_bound(k):
    used = {}

    def generate(step, params):
        used[step] = params  # the weights the worker sampled step `step` with
        time.sleep(0.01)
        return f"rollouts {step}"

    worker = RolloutWorker(generate, start=0, steps=12, max_staleness=k, timeout=30)
    worker.publish(0, 0)
    worker.begin()
    for step in range(12):
        rollouts, version, _ = worker.take(step)
        assert rollouts == f"rollouts {step}" and used[step] == version
        assert step - k <= version <= step
        time.sleep(0.03)  # a learner slower than the worker: the bound binds
        worker.publish(step + 1, step + 1)
    versions = [used[s] for s in range(12)]
    assert versions == sorted(versions)
    if k:
        assert any(s - v == k for s, v in enumerate(versions))  # the worker did run ahead
    else:
        assert versions == list(range(12))  # K = 0: every step sampled by the newest weights


def test_the_watchdog_names_what_the_worker_was_doing_and_failures_reach_the_learner():
    release = threading.Event()

    def stuck(step, params):
        release.wait(5)
        return step

    worker = RolloutWorker(stuck, start=0, steps=2, max_staleness=1, timeout=0.2)
    worker.publish(0, None)
    worker.begin()
    with pytest.raises(WorkerStalled, match=r"no batch for step 0 after 0.2 s \(the worker is "
                       r"alive, last generating step 0 with version 0\)"):  # fmt: skip
        worker.take(0)
    release.set()
    worker.stop()

    def broken(step, params):
        raise OSError("the environment's server went away")

    worker = RolloutWorker(broken, start=0, steps=2, max_staleness=1, timeout=5)
    worker.publish(0, None)
    worker.begin()
    with pytest.raises(RuntimeError, match="rollout worker failed at step 0: OSError"):
        worker.take(0)


def test_the_fair_lock_serves_in_arrival_order():
    lock, order = FairLock(), []
    lock.__enter__()  # held: the threads below queue up in the order they start

    def take(i):
        with lock:
            order.append(i)

    threads = []
    for i in range(5):
        threads.append(threading.Thread(target=take, args=(i,)))
        threads[-1].start()
        time.sleep(0.05)
    lock.__exit__()
    for t in threads:
        t.join()
    assert order == list(range(5))


def _numbers(metrics):
    timing = ("_s", "_tok_s", "_frac", "steps_per_s")
    phases = ("rollout", "scoring", "credit", "update", "learner", "worker", "device")
    return {
        k: v
        for k, v in metrics.items()
        if not (k.endswith(timing) and k.startswith(phases))
        and not k.startswith("staleness")
        and k not in ("steps_per_s",)
    }


def test_the_worker_at_staleness_zero_reproduces_the_synchronous_loop(tmp_path):
    # The asynchronous machinery with K = 0 samples every step with the newest weights: the same
    # numbers as the synchronous loop, step by step.
    cfg = parse_args([*TINY, "--steps", "3", "--run-dir", str(tmp_path)])
    sync = trainer_module.Trainer(cfg)
    expected = [_numbers(sync.step(s)) for s in range(3)]
    worker_run = trainer_module.Trainer(cfg)
    got = [_numbers(m) for m in worker_run.run_async(range(3))]
    assert got == expected
    for x, y in zip(_leaves(sync.state), _leaves(worker_run.state), strict=True):
        np.testing.assert_array_equal(x, y)


def _leaves(state):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves({k: state[k] for k in ("actor", "critic")})]


def test_an_asynchronous_run_trains_corrects_logs_and_resumes(tmp_path):
    args = [*TINY, "--max-staleness", "1", "--is-level", "turn", "--epochs", "2",
            "--run-dir", str(tmp_path)]  # fmt: skip
    assert run.main([*args, "--steps", "3", "--checkpoint-every", "2"]) == 0
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 <= r["staleness_mean"] <= r["staleness_max"] <= 1
        for key in ("behaviour_kl", "is_truncated_frac", "is_turn_affected_frac",
                    "worker_generate_s", "learner_wait_s", "steps_per_s"):  # fmt: skip
            assert np.isfinite(r[key]), key
        assert r["is_weight_mean"] > 0
    # the first step is sampled by the initial weights: nothing stale, weights equal 1 (numerics)
    assert rows[0]["staleness_max"] == 0 and rows[0]["behaviour_kl"] < 1e-6
    # resumed: the queue starts empty, the worker regenerates from the resumed step
    assert run.main(["--resume", "--run-dir", str(tmp_path), "--steps", "4"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_stale_rows_are_corrected_by_the_behaviour_weights(tmp_path):
    # A batch sampled by older weights and scored by newer ones: the weights are the truncated
    # ratio proximal / behaviour of the configured span, and they reach the update.
    from mpo_jax import losses

    cfg = parse_args([*TINY, "--max-staleness", "2", "--is-cap", "1.5", "--steps", "2",
                      "--run-dir", str(tmp_path)])  # fmt: skip
    trainer = trainer_module.Trainer(cfg)
    old = trainer._published()
    trainer.step(0)  # the learner moves on
    stale = trainer.local_rollouts(1, old, trainer.sampler)  # sampled with version 0
    batch, scored = trainer.score(stale)
    expected = losses.behaviour_weights(
        batch.old_logp, batch.sampler_logp, batch.loss_mask, batch.turn_ids, cap=1.5
    )
    np.testing.assert_allclose(batch.is_weights, expected, rtol=1e-6)
    assert scored["behaviour_kl"] > 0 and batch.is_weights[batch.loss_mask].max() <= 1.5
    assert not np.allclose(batch.is_weights[batch.loss_mask], 1.0)
