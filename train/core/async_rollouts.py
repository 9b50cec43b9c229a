"""Asynchronous rollouts: a worker that samples ahead of the learner, with bounded staleness.

    python -m train.run --max-staleness 2 ...     # K = 2; 0 is the synchronous loop

Versions: the policy's version is the number of updates applied, so the synchronous loop's
step s samples with version s. With ``--max-staleness K`` the learner's step s consumes
rollouts sampled by a version v in [s - K, s]. A worker thread generates the rollouts of steps
s = start, start + 1, ... in order: it starts step s once the learner has published version
s - K (waiting otherwise), with the newest weights published, and hands (s, v, rollouts) to the
learner. The learner scores them with its current weights (the proximal policy of the update),
corrects the gap to the behaviour policy with truncated importance weights
(``mpo_jax.losses.behaviour_weights`` at ``--is-level``), updates, and publishes version s + 1
(a copy of the weights: the update donates its own buffers). Generation is not interruptible:
all the episodes of a batch are sampled with the version the worker took when it started them,
so every turn of a row carries that version (``TurnBatch.policy_version``).

Device work of the two threads goes through a first-come-first-served lock (`FairLock`),
held by the worker for one sampler call and by the learner for one scoring group or one
minibatch: neither waits for more than one unit of the other's device work, and the host work
(environment steps and tools, tokenisation, batching, credit on the host) overlaps the other
thread's device work. Several hosts: each runs its own worker for its share of the tasks, and
every collective (gathering the rollouts, publishing the weights) happens on the learner thread
in program order, so no two hosts interleave collectives differently.

Reliability: an exception in the worker is re-raised by the learner, which then ends the run (no
hang); a learner that waits longer than ``--worker-timeout`` seconds for a batch raises, naming
the step and what the worker was doing (a watchdog). A resumed run starts with an empty queue:
the worker regenerates from the resumed step with the checkpoint's weights (staleness 0 at
first). Runs with K > 0 are not bit-reproducible: which version samples which step depends on
timing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FairLock", "RolloutWorker", "WorkerStalled"]


class WorkerStalled(RuntimeError):
    """The learner waited past the watchdog's timeout for the worker's batch."""


class FairLock:
    """A first-come-first-served lock (a ticket lock), with the seconds spent waiting for it.

    ``with lock:`` blocks until every earlier ``with`` has left; ``waited[thread name]`` sums
    each thread's waiting time (its idle time at the device)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next = self._serving = 0
        self.waited: dict[str, float] = {}

    def __enter__(self):
        start = time.perf_counter()
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()
        name = threading.current_thread().name
        self.waited[name] = self.waited.get(name, 0.0) + time.perf_counter() - start
        return self

    def __exit__(self, *exc):
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class RolloutWorker:
    """Generates the rollouts of steps ``start .. steps - 1`` ahead of the learner.

    Args:
      generate: ``generate(step, params) -> rollouts`` (this host's share, sampled with params).
      start, steps: the steps to generate.
      max_staleness: K: step s is generated with a version >= s - K.
      timeout: the watchdog: seconds `take` waits before it raises.
    """

    def __init__(
        self,
        generate: Callable[[int, Any], Any],
        *,
        start: int,
        steps: int,
        max_staleness: int,
        timeout: float,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        self.generate, self.start, self.steps = generate, start, steps
        self.k, self.timeout = max_staleness, timeout
        self._cond = threading.Condition()
        self._version, self._params = -1, None
        self._stop = False
        self._queue: queue.Queue = queue.Queue()
        self.doing = "not started"
        self.idle_s = 0.0  # waiting for a version within the staleness bound
        self.sampling_version = -1  # the version the current step started with
        self._thread = threading.Thread(target=self._run, name="rollout-worker", daemon=True)

    # -- learner side --------------------------------------------------------------------------

    def publish(self, version: int, params) -> None:
        """Makes ``params`` (version ``version``) the weights the worker samples with next."""
        with self._cond:
            self._version, self._params = version, params
            self._cond.notify_all()

    def begin(self) -> None:
        self._thread.start()

    def newest(self) -> tuple[Any, int]:
        """(params, version) the learner published last: what the worker's engine swaps to
        between decode chunks, mid-step."""
        with self._cond:
            return self._params, self._version

    def take(self, step: int) -> tuple[Any, int, float]:
        """(rollouts, version that sampled them, seconds the worker spent generating them) of
        ``step``; re-raises the worker's exception; raises `WorkerStalled` after
        ``timeout`` seconds without the batch."""
        try:
            item = self._queue.get(timeout=self.timeout)
        except queue.Empty:
            alive = "alive" if self._thread.is_alive() else "dead"
            raise WorkerStalled(
                f"rollout worker: no batch for step {step} after {self.timeout:g} s (the worker "
                f"is {alive}, last {self.doing}); raise --worker-timeout if its steps are slower"
            ) from None
        if isinstance(item, BaseException):
            raise RuntimeError(f"rollout worker failed at step {step}: {item!r}") from item
        got, version, rollouts, seconds = item
        if got != step:
            raise RuntimeError(f"rollout worker: got step {got}'s batch for step {step}")
        return rollouts, version, seconds

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    # -- worker side ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for step in range(self.start, self.steps):
                running, params, version = self._wait_for(step - self.k)
                if not running:
                    return
                self.doing = f"generating step {step} with version {version}"
                self.sampling_version = version
                t0 = time.perf_counter()
                rollouts = self.generate(step, params)
                self._queue.put((step, version, rollouts, time.perf_counter() - t0))
                self.doing = f"finished step {step}"
        except BaseException as e:  # noqa: BLE001  (handed to the learner, which re-raises it)
            self._queue.put(e)

    def _wait_for(self, version: int):
        """(running, params, version): the newest published weights once their version is >=
        ``version``; running is False when the learner stopped the worker."""
        t0 = time.perf_counter()
        self.doing = f"waiting for version {version}"
        with self._cond:
            while self._version < version and not self._stop:
                self._cond.wait()
            self.idle_s += time.perf_counter() - t0
            return not self._stop, self._params, self._version


def stream(worker: RolloutWorker, steps: range) -> Iterator[tuple[int, Any, int, float]]:
    """(step, rollouts, version, generation seconds) for each step, from the worker."""
    for step in steps:
        rollouts, version, seconds = worker.take(step)
        yield step, rollouts, version, seconds
