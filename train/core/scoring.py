"""Scoring a rollout batch on the device, one micro-batch at a time (docs/design.md §4).

What the learner needs beside the rollout: the actor's log-probs of the sampled tokens at the
sampling temperature (``old_logp``: the proximal policy of the update), the critic's values and
bootstrap values, the reference model's log-probs, and TRACE's answer log-probs at each tool-call
boundary. Rows are sorted by length and scored ``rows`` at a time (the update's micro-batch), or in
groups of at most ``max_tokens`` padded tokens (``--micro-batch-tokens``), each
group narrowed to [`mpo_jax.batch.padded_length`][mpo_jax.batch.padded_length] of its longest row
and its log-probs and values computed at its action tokens alone (`train.core.learner.ActionRows`):
a batch of mostly short episodes runs short programs, no program holds more than one micro-batch's
activations, and the vocabulary-wide softmax never runs on prompts, observations or padding. The
results come back as [B, T] arrays (zero off the action tokens), the layout credit assignment reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import numpy as np

from mpo_jax.batch import TurnBatch, padded_length
from train.core.learner import (
    ActionRows,
    answer_logprobs,
    budget_micro_batches,
    token_logprobs,
    values_and_bootstrap,
)

__all__ = ["Scorer"]


def _logprobs_only(graphdef, params, tokens, positions, *, temperature: float):
    """`train.core.learner.token_logprobs` without the entropy, which scoring does not read
    (returned, it would be computed: a second pass over every [token, vocabulary] logit)."""
    return token_logprobs(graphdef, params, tokens, positions, temperature=temperature)[0]


def _pad(x: np.ndarray, n: int) -> np.ndarray:
    """``x`` with zeros appended up to ``n`` entries (a group's padded rows)."""
    return np.concatenate([x, np.zeros(n - len(x), x.dtype)]) if n > len(x) else x


class Scorer:
    """Args: rows (a group's rows: the micro-batch), max_tokens (instead: groups of at most this
    many padded tokens, `train.core.learner.budget_micro_batches`; ``multiple`` rows a
    group's row count divides by), temperature (of the sampler), put (a host array -> a jit
    input, sharded where a mesh is set), to_host (a device array -> NumPy)."""

    def __init__(
        self,
        *,
        rows: int,
        temperature: float,
        max_tokens: int = 0,
        multiple: int = 1,
        put: Callable = np.asarray,
        to_host: Callable = np.asarray,
        device=None,
    ):
        self.rows, self.temperature = rows, temperature
        self.max_tokens, self.multiple = max_tokens, multiple
        self.put, self.to_host = put, to_host
        # held around each group's program (a lock shared with a rollout worker, if any)
        self.device = device if device is not None else contextlib.nullcontext()
        self._logp = jax.jit(_logprobs_only, static_argnums=0, static_argnames="temperature")
        self._values = jax.jit(values_and_bootstrap, static_argnums=0)
        self._answers = jax.jit(answer_logprobs, static_argnums=0)

    def groups(self, batch: TurnBatch) -> list[tuple[np.ndarray, ActionRows]]:
        """(row indices, their `ActionRows`) of each group: rows sorted by length,
        ``rows`` a group (or ``max_tokens`` padded tokens a group)."""
        if self.max_tokens:
            return budget_micro_batches(batch, self.max_tokens, multiple=self.multiple)
        order = np.argsort(batch.row_lengths(), kind="stable")
        out = []
        for lo in range(0, len(order), self.rows):
            rows = order[lo : lo + self.rows]
            out.append((rows, ActionRows.of(batch.take_rows(rows))))
        return out

    def logprobs(self, graphdef, params, groups, shape) -> np.ndarray:
        """[B, T] log-probs of each action token given the ones before it (0 elsewhere)."""
        out = np.zeros(shape, np.float32)
        for rows, act in groups:
            with self.device:
                logp = self._logp(
                    graphdef,
                    params,
                    self.put(act.tokens),
                    self.put(act.positions),
                    temperature=self.temperature,
                )
                logp = self.to_host(logp)
            out[rows] = act.scatter(logp, (len(rows), shape[1]))
        return out

    def values(self, graphdef, params, groups, lengths: np.ndarray, shape):
        """([B, T] values of the state before each action token, [B] the value after
        ``lengths`` tokens of each row: a truncated row's bootstrap)."""
        values = np.zeros(shape, np.float32)
        boot = np.zeros(shape[0], np.float32)
        for rows, act in groups:
            with self.device:
                v, b = self._values(
                    graphdef,
                    params,
                    self.put(act.tokens),
                    self.put(act.positions),
                    self.put(_pad(lengths[rows].astype(np.int32), len(act.tokens))),
                )
                v, b = self.to_host(v), self.to_host(b)
            values[rows] = act.scatter(v, (len(rows), shape[1]))
            boot[rows] = b[: len(rows)]
        return values, boot

    def answers(self, graphdef, params, tokens, prefix_lengths, answers, answer_lengths):
        """[N] TRACE's mean answer log-probs after each prefix (see
        `train.core.learner.answer_logprobs`), ``rows`` prefixes a call, each group narrowed
        to its longest prefix (the last group padded with copies of its first row)."""
        n = len(tokens)
        out = np.zeros(n, np.float32)
        order = np.argsort(prefix_lengths, kind="stable")
        for lo in range(0, n, self.rows):
            rows = order[lo : lo + self.rows]
            fill = np.concatenate([rows, np.full(self.rows - len(rows), rows[0])])
            width = padded_length(int(prefix_lengths[fill].max()), cap=tokens.shape[1])
            with self.device:
                scores = self._answers(
                    graphdef,
                    params,
                    self.put(tokens[fill, :width]),
                    self.put(prefix_lengths[fill].astype(np.int32)),
                    self.put(answers[fill]),
                    self.put(answer_lengths[fill].astype(np.int32)),
                )
                scores = self.to_host(scores)
            out[rows] = scores[: len(rows)]
        return out
