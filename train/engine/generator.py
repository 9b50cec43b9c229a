"""What generates a turn, behind one interface: our own sampler or an inference server.

    gen = generator.generate(ids, max_new_tokens=256, temperature=1.0, stop_ids=(eos,), seed=7)
    gen.tokens, gen.logprobs, gen.finish, gen.version
    generator.pause(); generator.load_weights(folder, version=3); generator.resume()

Token ids in, token ids out: a turn is sampled from the conversation's ids exactly as the
rollout built them (never re-rendered, never re-tokenised), and comes back as the sampled ids with
their log-probs under the weights of ``version`` (the behaviour policy the decoupled correction of
``mpo_jax.losses`` reads). ``finish`` says why it ended: ``"stop"`` (a stop id, kept as the last
token) or ``"length"`` (the budget). Implementations are safe to call from several threads at
once (the server rollout loop runs an episode a thread).

[`SamplerGenerator`][train.engine.generator.SamplerGenerator] puts
[`Sampler`][train.engine.sampler.Sampler] behind the interface (one request at a time under a lock);
the in-process test servers use it, so what they return are real tokens and log-probs.
[`train.engine.servers`][train.engine.servers] puts vLLM and SGLang behind it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Protocol

__all__ = ["Generation", "Generator", "SamplerGenerator", "FINISH_REASONS"]

FINISH_REASONS = ("stop", "length")


@dataclasses.dataclass(frozen=True)
class Generation:
    """One sampled turn: ids, their log-probs, why it ended, the weights' version."""

    tokens: list[int]
    logprobs: list[float]
    finish: str
    version: int

    def __post_init__(self):
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(
                f"logprobs: {len(self.logprobs)} log-probs for {len(self.tokens)} tokens"
            )
        if self.finish not in FINISH_REASONS:
            raise ValueError(f"finish: {self.finish!r} is not one of {FINISH_REASONS}")


class Generator(Protocol):
    """Samples turns from token ids; takes new weights with a version."""

    version: int

    def generate(
        self,
        ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float,
        stop_ids: Sequence[int],
        seed: int,
        affinity: int = 0,
    ) -> Generation:
        """One turn continuing ``ids``. ``affinity``: requests with the same value go to the same
        replica where there are several (an episode keeps its server's prefix cache)."""

    def pause(self) -> None:
        """No new turn starts until `resume` (in-flight ones finish first)."""

    def resume(self) -> None: ...

    def load_weights(self, folder: str, version: int) -> None:
        """Reloads the weights from a Hugging Face folder; later turns report ``version``."""


class SamplerGenerator:
    """A [`Sampler`][train.engine.sampler.Sampler] as a
    [`Generator`][train.engine.generator.Generator]: one row, one request at a time (a lock);
    ``load_weights`` reads a Hugging Face folder with our loader."""

    def __init__(self, sampler, *, version: int = 0):
        self.sampler = sampler
        self.version = version
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()

    def generate(self, ids, *, max_new_tokens, temperature, stop_ids, seed, affinity=0):
        if not ids:
            raise ValueError("ids: an empty prompt")
        self._running.wait()
        with self._lock:
            s = self.sampler
            if len(ids) + 1 > s.capacity:
                raise ValueError(f"ids: {len(ids)} tokens leave no room in {s.capacity}")
            budget = min(max_new_tokens, s.capacity - len(ids))
            s.start([list(ids)])
            try:
                out = s.generate(
                    max_new_tokens=budget,
                    temperature=temperature,
                    stop_ids=tuple(stop_ids),
                    seed=int(seed),
                )
            finally:
                s.close()
            finish = "stop" if out.stopped[0] else "length"
            return Generation(out.tokens[0], out.logprobs[0], finish, self.version)

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def load_weights(self, folder: str, version: int) -> None:
        from flax import nnx

        from train.model.weights import load_pretrained

        cfg = self.sampler.cfg
        model = load_pretrained(folder, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        with self._lock:
            self.sampler.swap(nnx.state(model), version)
            self.version = int(version)
