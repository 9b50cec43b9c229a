"""The host-side rollout loop: many episodes at once, token ids built incrementally.

Each round makes one batched call to the policy (the KV-cache sampler, or a scripted policy in
tests) for every live episode, then steps each environment with its turn's text. Sampled ids are
kept exactly as sampled; each observation is encoded once and appended to the live cache; the
conversation is never re-rendered. The result is the padded turn-segment batch of docs/design.md §2.

The loop talks to two things through the protocols declared here: a [`Policy`][envs.rollout.Policy]
(the KV-cache sampler of ``train.engine.sampler``, or a scripted policy in tests) and a
[`Codec`][envs.rollout.Codec] (the text <-> token mapping an environment names as ``env.codec``:
``envs.chat.ChatFormat`` for the Qwen3 chat environments, ``envs.synthetic.WordCodec`` for the
synthetic ones).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from envs.base import Env
from envs.strategies import STRATEGY_FIGURES
from mpo_jax.batch import TurnBatch, padded_length

__all__ = [
    "Codec",
    "Policy",
    "Rollouts",
    "collect",
    "EPISODE_FIGURES",
    "EPISODE_INFO",
    "Episode",
    "record_turn",
    "start_episodes",
    "record_result",
    "record_failure",
    "to_batch",
]


class Codec(Protocol):
    """Text <-> token ids for one environment family.

    ``stop_ids`` end a sampled turn; ``end_of_turn`` are the ids a well-formed turn ends with
    (the chat template's ``<|im_end|>``; empty for a codec whose turns have a fixed length): a
    turn that does not end with them was cut (by the token budget, or stopped on another stop id
    such as ``<|endoftext|>``) and gets them appended as non-action tokens before the next
    observation.
    """

    stop_ids: Sequence[int]
    end_of_turn: Sequence[int]

    @property
    def vocab_size(self) -> int: ...

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The ids of the first messages (rendered once)."""

    def observation(self, obs: Any) -> list[int]:
        """The ids of what the environment says after a turn (appended as they are)."""

    def turn_text(self, ids: Sequence[int]) -> str:
        """The text of a sampled turn, as the environment reads it."""

    def encode(self, text: str) -> list[int]: ...


class Policy(Protocol):
    """Samples every live conversation's next turn from a KV cache it keeps."""

    def start(self, prompts: Sequence[Sequence[int]]) -> None: ...

    def generate(
        self,
        *,
        max_new_tokens: int,
        temperature: float,
        stop_ids: Sequence[int],
        seed: Any,
        active: Sequence[bool],
        streams: Sequence[int],
    ) -> Any:
        """``.tokens[i]`` and ``.logprobs[i]``: row i's sampled ids and their log-probs (empty for
        inactive rows or rows out of room). ``streams[i]``: the episode row i samples for (its
        random stream under ``seed``)."""

    def extend(self, rows: Sequence[Sequence[int] | None]) -> None:
        """Appends observation ids to the rows that have them."""

    def close(self) -> None:
        """Releases what `start` allocated (the KV cache)."""


# The numbers an episode's last ``info`` may add to its summary (search, bfcl, tau2 figures) ...
EPISODE_FIGURES = (
    "evidence_recall",
    "f1",
    "em",
    "question_pass_rate",
    "tool_calls",
    "tool_errors",
    "db_match",
    "format_error_rate",
    "partial_credit",
    "invalid_move",
    *STRATEGY_FIGURES,
)
# ... and everything it may add (the reasons an episode failed or broke, as text).
EPISODE_INFO = (*EPISODE_FIGURES, "failure", "env_exception")


@dataclasses.dataclass
class Rollouts:
    """A padded batch plus what the trainer needs beside it.

    ``batch`` carries tokens, loss_mask, turn_ids, rewards, group_ids, truncated,
    ``sampler_logp`` (the sampler's log-probs on action tokens), ``step_keys`` and
    ``boundary_mask``; scoring adds the rest.
    ``boundary_lengths[b, k]`` is the prefix length at tool-call boundary k (0: the prompt; k: after
    turn k-1 and its observation); ``answer_ids`` are the gold answers' ids (TRACE).
    ``turn_quality[b, k]`` is the environment's ``action_quality`` of turn k (NaN where it gives
    none). Each episode summary says whether it was ``truncated`` (by the environment's turn budget
    or by the rollout) and, apart from that, whether the length budget cut it (``length_cut``).

    ``batch.truncated`` marks the rows whose outcome is unknown: the rollout cut them before the
    environment ended them (the length budget, a full cache, an environment that raised), so a
    critic bootstraps them. An episode the environment ended, by success or by its own turn budget,
    is finished for the learner: its reward is final (a turn budget is a rule of the task: running
    out of turns is failing it).
    """

    batch: TurnBatch
    boundary_lengths: np.ndarray
    answer_ids: list[list[int]]
    episodes: list[dict[str, Any]]
    seconds: float
    turn_quality: np.ndarray | None = None
    token_versions: np.ndarray | None = None  # [B, T]: the policy version of each sampled token
    stats: Any = None  # what the rollout engine measured (train.engine.continuous.EngineStats)


@dataclasses.dataclass
class Episode:
    """One episode's conversation as it grows: ids, action mask, turn ids, log-probs, rewards,
    boundaries and the versions that sampled its tokens; and how it ended."""

    tokens: list[int]
    mask: list[bool]
    turn_ids: list[int]
    logp: list[float]
    rewards: list[float]
    boundaries: list[int]
    keys: list[Any] = dataclasses.field(default_factory=list)
    turns: int = 0
    cut_turns: int = 0  # turns that did not end with the codec's end of turn
    active: bool = True
    truncated: bool = False
    length_cut: bool = False
    broken: bool = False  # the environment raised
    success: bool = False
    total_reward: float = 0.0
    errors: int = 0
    last_info: dict = dataclasses.field(default_factory=dict)
    quality: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # per token; -1: not sampled

    def append(self, ids, *, action: bool, turn: int = -1, logp=None, version=-1):
        """``version``: the policy version of the sampled ids, one int or one per id."""
        self.tokens += list(ids)
        if not action:
            self.versions += [-1] * len(ids)
        elif isinstance(version, int):
            self.versions += [version] * len(ids)
        else:
            self.versions += list(version)
        self.mask += [action] * len(ids)
        self.turn_ids += [turn if action else -1] * len(ids)
        self.logp += list(logp) if logp is not None else [0.0] * len(ids)
        self.rewards += [0.0] * len(ids)


def collect(
    envs: Sequence[Env],
    codec: Codec,
    policy: Policy,
    *,
    group_ids: Sequence[int],
    max_len: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: Any = 0,
    max_step_keys: int | None = None,
) -> Rollouts:
    """Runs one episode in each env with the policy; returns the padded batch.

    An episode ends when its env terminates or truncates (its turn limit), or when the next turn
    or observation would not fit in ``max_len`` tokens: then it is truncated, never crashed. An
    environment whose ``step`` raises ends its own episode (truncated, the exception in the
    episode's ``env_exception``); the other episodes go on. ``seed`` is an int or a JAX key;
    episode i samples from its own stream of it (``streams`` of the policy's ``generate``: the
    slot engine draws the same tokens whatever its slots, chunks and threads).

    A turn that does not end with ``codec.end_of_turn`` (cut by ``max_new_tokens`` or stopped on
    another stop id) is closed: the end-of-turn ids are appended as non-action tokens before the
    next observation, and the episode counts it (``turns_cut``). The batch is padded to
    [`mpo_jax.batch.padded_length`][mpo_jax.batch.padded_length] of its longest row (never beyond
    ``max_len``).
    """
    t0 = time.perf_counter()
    episodes, prompts = start_episodes(envs, codec, group_ids, max_len, max_new_tokens)
    policy.start(prompts)
    try:
        _play(episodes, envs, codec, policy, max_len, max_new_tokens, temperature, seed)
    finally:
        close = getattr(policy, "close", None)
        if close is not None:
            close()
    return to_batch(episodes, envs, codec, group_ids, max_len, max_step_keys, t0)


def start_episodes(envs, codec, group_ids, max_len, max_new_tokens):
    """(episodes, prompts): each env reset, its prompt rendered once and booked as the start of
    its [`Episode`][envs.rollout.Episode]. Raises ``ValueError`` for a group id count that differs
    from the environments' or a prompt that leaves no room for a turn in ``max_len``."""
    if len(group_ids) != len(envs):
        raise ValueError(f"group_ids: {len(group_ids)} ids for {len(envs)} environments")
    episodes, prompts = [], []
    for env in envs:
        prompt = codec.prompt(env.reset(), env.tools)
        if len(prompt) + max_new_tokens > max_len:
            raise ValueError(
                f"max_len: {max_len} leaves no room for a turn after a {len(prompt)}-token prompt"
            )
        ep = Episode([], [], [], [], [], [len(prompt)])
        ep.append(prompt, action=False)
        episodes.append(ep)
        prompts.append(prompt)
    return episodes, prompts


def _play(episodes, envs, codec, policy, max_len, max_new_tokens, temperature, seed) -> None:
    """Rounds of one batched policy call and one step of every live environment, to the end."""
    b = len(episodes)
    end_of_turn = list(getattr(codec, "end_of_turn", ()))
    version = int(getattr(policy, "version", 0))
    while any(ep.active for ep in episodes):
        active = [ep.active for ep in episodes]
        gen = policy.generate(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop_ids=tuple(codec.stop_ids),
            seed=seed,
            active=active,
            streams=list(range(b)),  # episode i samples from its own stream (see Sampler)
        )
        extend: list[list[int] | None] = [None] * b
        for i, (ep, env) in enumerate(zip(episodes, envs, strict=True)):
            if not active[i]:
                continue
            close = record_turn(ep, env, gen.tokens[i], gen.logprobs[i], end_of_turn, version)
            if close is None:
                continue
            try:
                result = env.step(codec.turn_text(gen.tokens[i]))
            except Exception as e:  # noqa: BLE001  (one broken environment never kills a run)
                record_failure(ep, e)
                continue
            extend[i] = record_result(ep, result, close, codec, max_len, max_new_tokens)
        if any(e is not None for e in extend):
            policy.extend(extend)


def record_turn(ep, env, ids, logp, end_of_turn, version=0) -> list[int] | None:
    """Books a sampled turn into ``ep``; returns the ids that close it (``end_of_turn`` if the
    turn did not end with them, else none), or None when the turn is empty (no room left in the
    cache: the episode is cut by length). ``version``: the policy version that sampled it (one
    int, or one per id)."""
    if not ids:
        ep.active, ep.truncated, ep.length_cut = False, True, True
        return None
    ep.keys.append(getattr(env, "state_key", ep.turns))
    ep.append(ids, action=True, turn=ep.turns, logp=logp, version=version)
    if end_of_turn and list(ids[-len(end_of_turn) :]) != end_of_turn:
        ep.cut_turns += 1
        return list(end_of_turn)
    return []


def record_failure(ep, error: BaseException | str) -> None:
    """The environment raised (or hung) on ``ep``'s turn: the episode ends, truncated and
    broken, the reason in its ``env_exception``."""
    ep.turns += 1
    ep.active, ep.truncated, ep.broken = False, True, True
    ep.errors += 1
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    ep.last_info = {"env_exception": reason}


def record_result(ep, result, close, codec, max_len, max_new_tokens) -> list[int] | None:
    """Books the environment's answer to ``ep``'s turn; returns the ids to append to the
    conversation (``close`` + the observation), or None when the episode ended (the environment
    ended it, or the next turn would not fit in ``max_len``: cut, not crashed)."""
    ep.turns += 1
    ep.rewards[-1] += float(result.reward)  # on the turn's last token
    ep.total_reward += float(result.reward)
    ep.last_info = dict(result.info)
    ep.quality.append(float(result.info.get("action_quality", np.nan)))
    ep.success = bool(result.info.get("success", ep.success))
    ep.errors += int(bool(result.info.get("error")))
    if result.terminated or result.truncated:
        ep.active = False
        ep.truncated = bool(result.truncated and not result.terminated)
        return None
    obs = close + codec.observation(result.observation)
    if len(ep.tokens) + len(obs) + max_new_tokens > max_len:
        ep.active, ep.truncated, ep.length_cut = False, True, True
        return None
    ep.append(obs, action=False)
    ep.boundaries.append(len(ep.tokens))
    return obs


def to_batch(episodes, envs, codec, group_ids, max_len, max_step_keys, t0) -> Rollouts:
    b = len(episodes)
    width = padded_length(max(len(ep.tokens) for ep in episodes), cap=max_len)
    tokens = np.zeros((b, width), np.int32)
    mask = np.zeros((b, width), bool)
    tid = np.full((b, width), -1, np.int32)
    logp = np.zeros((b, width), np.float32)
    rewards = np.zeros((b, width), np.float32)
    versions = np.full((b, width), -1, np.int32)
    k = max_step_keys or max(1, max(ep.turns for ep in episodes))
    m = max(len(ep.boundaries) for ep in episodes)
    step_keys = np.full((b, k), -1, np.int32)
    boundary_lengths = np.zeros((b, m), np.int32)
    boundary_mask = np.zeros((b, m), bool)
    quality = np.full((b, max(1, max(ep.turns for ep in episodes))), np.nan, np.float32)
    key_ids: dict[Any, int] = {}
    for i, ep in enumerate(episodes):
        n = len(ep.tokens)
        tokens[i, :n] = ep.tokens
        mask[i, :n] = ep.mask
        tid[i, :n] = ep.turn_ids
        logp[i, :n] = ep.logp
        rewards[i, :n] = ep.rewards
        versions[i, :n] = ep.versions
        for j, key in enumerate(ep.keys[:k]):
            step_keys[i, j] = key_ids.setdefault(key, len(key_ids))
        # TRACE's boundaries: the prompt, then one after each turn that got an observation.
        boundary_lengths[i, : len(ep.boundaries)] = ep.boundaries
        boundary_mask[i, : len(ep.boundaries)] = True
        quality[i, : len(ep.quality)] = ep.quality
    answers = [codec.encode(env.gold_answer) if env.gold_answer else [] for env in envs]
    batch = TurnBatch(
        tokens=tokens,
        loss_mask=mask,
        turn_ids=tid,
        rewards=rewards,
        group_ids=np.asarray(group_ids, np.int32),
        truncated=np.array([ep.length_cut or ep.broken for ep in episodes]),
        sampler_logp=logp,
        boundary_mask=boundary_mask,
        step_keys=step_keys,
    )
    info = [
        {
            "success": ep.success,
            "reward": ep.total_reward,
            "turns": ep.turns,
            "turns_cut": ep.cut_turns,
            "tokens": len(ep.tokens),
            "truncated": ep.truncated,
            "length_cut": ep.length_cut,
            "errors": ep.errors,
            **{k: v for k, v in ep.last_info.items() if k in EPISODE_INFO},
        }
        for ep in episodes
    ]
    seconds = time.perf_counter() - t0
    return Rollouts(
        batch,
        boundary_lengths,
        answers,
        info,
        seconds,
        turn_quality=quality,
        token_versions=versions,
    )
