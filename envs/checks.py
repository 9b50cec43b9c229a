"""Checks a new environment should pass before anyone trains on it (used by the tests and by
``notebooks/03_your_environment.ipynb``).

    from envs.checks import check_environment
    report = check_environment(lambda seed: MyEnv(seed=seed))

* the scripted optimal policy (``optimal_turn``/``oracle_turn``/``oracle_turns``, see
  `envs.scripted.oracle_act`) solves it through the real rollout loop, and the batch it
  produces passes [`mpo_jax.batch.validate`][mpo_jax.batch.validate];
* hostile turns (`HOSTILE_TURNS`: empty, huge, control characters, random code points, ...)
  never raise and always get an observation;
* episodes end (within ``max_turns``) and fit the environment's ``max_episode_tokens``.

Each failure raises ``AssertionError`` naming the check and the episode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from envs.base import Env, StepResult
from envs.rollout import collect
from envs.scripted import ScriptedPolicy, oracle_act
from mpo_jax.batch import validate

__all__ = ["HOSTILE_TURNS", "check_environment", "play_episode"]


def play_episode(
    env: Env, turns: Iterable[str] | Callable[[Env], str], *, limit: int = 200
) -> StepResult:
    """Resets ``env`` and plays assistant turns on it until the episode ends (no tokenizer, no
    batch: the environment alone).

    ``turns`` is a list of turns, played in order, or a function ``env -> next turn`` (a scripted
    policy), called until the episode ends. Returns the result that ended the episode, or the
    last one when a list runs out first. A function that has not ended the episode after
    ``limit`` turns raises ``AssertionError``.
    """
    env.reset()
    scripted = callable(turns)
    stream = (turns(env) for _ in range(limit)) if scripted else iter(turns)
    result = None
    for turn in stream:
        result = env.step(turn)
        if result.terminated or result.truncated:
            return result
    if scripted:
        raise AssertionError(f"the episode did not end within {limit} turns")
    if result is None:
        raise ValueError("turns: no turn to play")
    return result


HOSTILE_TURNS: tuple[str, ...] = (
    "",
    " ",
    "\n\n\n",
    "<bos> <eot> <pad>",
    "é\x00\uffff\u202e",
    "x" * 10_000,
    "".join(map(chr, np.random.default_rng(0).integers(32, 0x2FFF, size=300))),
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "<tool_call>{not json</tool_call>",
)


def check_environment(
    make: Callable[[int], Env], *, episodes: int = 16, min_success: float = 1.0
) -> dict[str, float]:
    """Runs the checks of the module docstring on ``episodes`` environments ``make(seed)``.

    Returns what it measured: the scripted policy's success rate, its mean turns, the longest
    episode in tokens. ``min_success`` is the success rate the scripted policy must reach (below
    1 for stochastic tasks).
    """
    batch_envs = [make(seed) for seed in range(episodes)]
    first = batch_envs[0]
    codec = first.codec
    assert codec is not None, "env.codec: every environment names its codec"
    longest = first.max_episode_tokens(codec) or 8192
    turn = getattr(first, "turn_length", 256)
    acts: list = [None] * episodes

    def act(i):
        return acts[i]()

    for i, env in enumerate(batch_envs):
        original = env.reset
        acts[i] = None

        def reset(env=env, i=i, original=original):
            messages = original()
            acts[i] = oracle_act(env)
            return messages

        env.reset = reset
    out = collect(
        batch_envs,
        codec,
        ScriptedPolicy(codec, act),
        group_ids=list(range(episodes)),
        max_len=longest,
        max_new_tokens=turn,
    )
    validate(out.batch, vocab_size=codec.vocab_size)
    success = float(np.mean([e["success"] for e in out.episodes]))
    assert success >= min_success, f"scripted policy: success {success:.2f} < {min_success}"
    for i, e in enumerate(out.episodes):
        assert not e.get("length_cut"), f"episode {i}: longer than max_episode_tokens={longest}"
        assert e["turns"] <= first.max_turns, f"episode {i}: {e['turns']} > max_turns turns"
    for seed in range(min(episodes, 4)):
        env = make(seed)
        env.reset()
        for n, text in enumerate(HOSTILE_TURNS):
            try:
                obs, reward, terminated, truncated, info = env.step(text)
            except Exception as e:  # noqa: BLE001  (reported as the check's failure)
                raise AssertionError(f"hostile turn {n} ({text[:20]!r}) raised {e!r}") from e
            assert isinstance(info, dict), f"hostile turn {n}: info is not a dict"
            assert np.isfinite(reward), f"hostile turn {n}: reward {reward}"
            if terminated or truncated:
                env.reset()
    return {
        "scripted_success": success,
        "turns_mean": float(np.mean([e["turns"] for e in out.episodes])),
        "longest_tokens": float(max(e["tokens"] for e in out.episodes)),
    }
