"""The continuous-batching rollout engine: lockstep equivalence, greedy equivalence against
transformers whatever the slots, bookkeeping, weight swaps and environments that hang."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import envs
from envs.base import StepResult
from envs.rollout import collect
from mpo_jax.batch import validate
from tests.models import tiny_model_config
from train.engine.continuous import collect_continuous
from train.engine.sampler import Sampler
from train.model.qwen3 import Qwen3ForCausalLM


def _fields(out):
    b = out.batch
    return {
        "tokens": b.tokens,
        "loss_mask": b.loss_mask,
        "turn_ids": b.turn_ids,
        "rewards": b.rewards,
        "sampler_logp": b.sampler_logp,
        "truncated": b.truncated,
        "step_keys": b.step_keys,
        "boundaries": out.boundary_lengths,
    }


@pytest.fixture(scope="module")
def nav_model():
    cfg = tiny_model_config(
        vocab_size=envs.make("synthetic-nav-longturns", seed=0).codec.vocab_size
    )
    return Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))


def _nav(n=6, name="synthetic-nav-longturns"):
    batch = [envs.make(name, seed=i) for i in range(n)]
    return batch, batch[0].codec


def _run(model, engine: bool, n=6, **kw):
    batch, codec = _nav(n)
    sampler = Sampler(model, capacity=256)
    args = dict(
        group_ids=[i // 2 for i in range(n)],
        max_len=256,
        max_new_tokens=batch[0].turn_length,
        temperature=1.0,
        seed=jax.random.key(7),
    )
    if engine:
        return collect_continuous(batch, codec, sampler, **args, **kw)
    return collect(batch, codec, sampler, **args)


def test_one_slot_per_episode_and_whole_turn_chunks_reproduce_lockstep_bit_for_bit(nav_model):
    lockstep = _run(nav_model, engine=False)
    engine = _run(nav_model, engine=True)
    assert lockstep.episodes == engine.episodes
    for name, value in _fields(lockstep).items():
        np.testing.assert_array_equal(value, _fields(engine)[name], err_msg=name)
    assert engine.stats.chunks == max(ep["turns"] for ep in engine.episodes)


# refill: chunks that end early once a share of their slots ended their turns
@pytest.mark.parametrize(
    "slots,chunk,workers,refill", [(1, 3, 0, 0.0), (3, 64, 2, 0.5), (6, 1, 3, 0.0)]
)
def test_every_episode_runs_once_to_its_end_and_every_slot_is_freed(
    nav_model, slots, chunk, workers, refill
):
    out = _run(
        nav_model, engine=True, n=7, slots=slots, chunk=chunk, env_workers=workers, refill=refill
    )
    validate(out.batch)
    # every episode samples from its own stream: the tokens are lockstep's whatever the slots,
    # chunks, threads and recomputed prefixes (log-probs to rounding: a recomputed prefix's
    # logits come from the prefill program instead of the decode's)
    lockstep = _run(nav_model, engine=False, n=7)
    np.testing.assert_array_equal(out.batch.tokens, lockstep.batch.tokens)
    np.testing.assert_array_equal(out.batch.loss_mask, lockstep.batch.loss_mask)
    np.testing.assert_allclose(out.batch.sampler_logp, lockstep.batch.sampler_logp, atol=1e-5)
    assert len(out.episodes) == 7
    for i, ep in enumerate(out.episodes):
        n = ep["tokens"]
        assert ep["turns"] >= 1 and not ep.get("env_exception"), ep
        # the row holds its own prompt: episodes were not swapped between rows
        env = envs.make("synthetic-nav-longturns", seed=i)
        prompt = env.codec.prompt(env.reset(), env.tools)
        assert out.batch.tokens[i, : len(prompt)].tolist() == prompt
        assert not out.batch.loss_mask[i, n:].any()
        # each turn's token count is within the turn budget
        turns = out.batch.turn_ids[i][out.batch.loss_mask[i]]
        assert np.bincount(turns).max() <= env.turn_length
    assert 0 < out.stats.utilisation <= 1
    assert out.stats.live_steps == int(out.batch.loss_mask.sum())
    # chunks started while an episode waited for a slot: some with fewer slots than episodes
    stats = out.stats
    assert stats.contended_live_steps <= stats.live_steps
    assert stats.contended_slot_steps <= stats.slot_steps
    assert (stats.contended_slot_steps > 0) == (slots < 7)
    assert 0 < stats.contended_utilisation <= 1 or slots == 7


def test_bad_engine_settings_are_named(nav_model):
    with pytest.raises(ValueError, match="slots"):
        _run(nav_model, engine=True, slots=0)
    with pytest.raises(ValueError, match="chunk"):
        _run(nav_model, engine=True, chunk=0)
    with pytest.raises(ValueError, match="env_timeout"):
        _run(nav_model, engine=True, env_timeout=1.0)


# -- greedy: the same outputs as transformers, whatever the slots and the admission order -----


class _Codec:
    stop_ids = (2,)
    end_of_turn = (2,)
    vocab_size = 96

    def prompt(self, messages, tools=None):
        return list(messages[0]["content"])

    def observation(self, obs):
        return list(obs)

    def turn_text(self, ids):
        return ids

    def encode(self, text):
        return []


class _Talk:
    """Three turns; the observation after turn k is a fixed run of ids; the turn's ids are kept."""

    tools: list = []
    max_turns = 3
    gold_answer = None

    def __init__(self, prompt, delay=0.0):
        self.prompt, self.delay, self.turns = prompt, delay, []

    def reset(self):
        self.turns = []
        return [{"role": "user", "content": self.prompt}]

    def step(self, ids):
        time.sleep(self.delay)
        self.turns.append(list(ids))
        done = len(self.turns) == 3
        return StepResult([40 + len(self.turns), 7, 9][: len(self.turns) + 1], 0.0, done, False, {})


PROMPTS = [[5, 17, 3, 44, 9, 1, 3], [7, 7], [60, 3, 31, 4], [11, 12, 13], [50] * 9]


def _torch_greedy(torch_model, prefix, n):
    ids = torch.tensor([prefix])
    with torch.no_grad():  # an explicit mask: a sampled id 0 (the pad id) is not padding
        out = torch_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prefix) :].tolist()


@pytest.mark.parametrize("slots,chunk,workers,refill", [(3, 6, 0, 0.5), (1, 3, 2, 0), (3, 1, 2, 0)])
def test_greedy_turns_equal_transformers_whatever_the_slots(
    tiny_qwen3, slots, chunk, workers, refill
):
    torch_model, model = tiny_qwen3
    talks = [_Talk(p, delay=0.01 * (i % 3) if workers else 0.0) for i, p in enumerate(PROMPTS)]
    out = collect_continuous(
        talks, _Codec(), Sampler(model, capacity=64), group_ids=list(range(len(talks))),
        max_len=64, max_new_tokens=6, temperature=0.0, slots=slots, chunk=chunk,
        env_workers=workers, refill=refill,
    )  # fmt: skip
    for i, talk in enumerate(talks):
        prefix = list(PROMPTS[i])
        for k, turn in enumerate(talk.turns):
            assert turn == _torch_greedy(torch_model, prefix, 6), (i, k)
            close = [] if turn[-1] == 2 else [2]
            prefix += turn + close + [40 + k + 1, 7, 9][: k + 2]
        n = out.episodes[i]["tokens"]
        assert out.batch.tokens[i, :n].tolist() == prefix[:n]
    if workers and slots < len(talks):  # episodes gave their slot up while their tool ran
        assert out.stats.recomputed > 0


# -- environments that hang or raise, and weights swapped between chunks -----------------------


class _Hangs(_Talk):
    def __init__(self, prompt, event):
        super().__init__(prompt)
        self.event, self.returned = event, False

    def step(self, ids):
        self.event.wait(120.0)  # hangs until the test lets it go, far past the time limit
        self.returned = True
        return super().step(ids)


class _Raises(_Talk):
    def step(self, ids):
        raise RuntimeError("backend crashed")


def test_a_hung_or_raising_environment_ends_only_its_own_episode(tiny_qwen3):
    _, model = tiny_qwen3
    event = threading.Event()
    talks = [_Talk(PROMPTS[0]), _Hangs(PROMPTS[1], event), _Raises(PROMPTS[2]), _Talk(PROMPTS[3])]
    out = collect_continuous(
        talks, _Codec(), Sampler(model, capacity=64), group_ids=[0, 1, 2, 3], max_len=64,
        max_new_tokens=6, temperature=0.0, slots=2, env_workers=4, env_timeout=0.3,
    )  # fmt: skip
    assert not talks[1].returned  # the collection ended without waiting for the hung call
    event.set()
    assert out.episodes[0]["turns"] == out.episodes[3]["turns"] == 3
    assert "TimeoutError" in out.episodes[1]["env_exception"] and out.episodes[1]["truncated"]
    assert "backend crashed" in out.episodes[2]["env_exception"]
    assert out.batch.truncated.tolist() == [False, True, True, False]


def test_weights_swapped_between_chunks_are_recorded_per_token(tiny_qwen3):
    _, model = tiny_qwen3
    sampler = Sampler(model, capacity=64)
    calls = []

    def publish():  # a new version before the third chunk
        calls.append(len(calls))
        return (sampler.state, 5) if len(calls) == 3 else None

    talks = [_Talk(p) for p in PROMPTS[:3]]
    out = collect_continuous(
        talks, _Codec(), sampler, group_ids=[0, 1, 2], max_len=64, max_new_tokens=6,
        temperature=0.0, chunk=2, publish=publish,
    )  # fmt: skip
    versions, mask = out.token_versions, out.batch.loss_mask
    assert (versions[~mask] == -1).all()
    assert set(np.unique(versions[mask])) == {0, 5}
    for i in range(3):
        row, turns = versions[i][mask[i]], out.batch.turn_ids[i][mask[i]]
        assert row[0] == 0 and (np.diff(row) >= 0).all()  # swapped once, never back
        assert (row[turns == 2] == 5).all()  # the third turn starts at chunk 3 or later
    # chunks of 2 tokens: the first two chunks sampled at most 4 tokens a row with version 0
    assert 0 < int((versions[mask] == 0).sum()) <= 3 * 4


# -- settings and injected tool latency --------------------------------------------------------


def test_engine_settings_refuse_what_does_not_apply():
    from train.core.config import parse_args

    for flags, field in (
        (["--engine", "vllm"], "engine"),
        (["--slots", "-1"], "slots"),
        (["--env-timeout", "3"], "env_timeout"),
        (["--engine", "lockstep", "--decode-chunk", "8"], "decode_chunk"),
        (["--decode-refill", "1.5"], "decode_refill: must be in"),
        (["--engine", "lockstep", "--decode-refill", "0"], "decode_refill"),
        (["--rollout-backend", "vllm", "--rollout-url", "http://h:1", "--decode-refill", "1"],
         "decode_refill: a setting of our own engine"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            parse_args(flags)
    assert parse_args(["--slots", "8", "--env-workers", "4"]).engine_settings().slots == 8
    assert parse_args([]).engine_settings().decode_refill == 0.5  # the engine's default
    assert parse_args(["--decode-refill", "0"]).engine_settings().decode_refill == 0
    assert parse_args(["--engine", "lockstep"]).engine_settings().engine == "lockstep"


def test_tool_latency_is_log_normal_around_its_median_and_the_same_per_seed():
    from envs.latency import WithLatency

    env = envs.make("synthetic-nav", seed=3, tool_latency=0.2, tool_latency_sigma=0.5)
    assert (
        isinstance(env, WithLatency) and env.turn_length == envs.make("synthetic-nav").turn_length
    )
    delays = [env.delay() for _ in range(4000)]
    again = envs.make("synthetic-nav", seed=3, tool_latency=0.2)
    assert [again.delay() for _ in range(5)] == delays[:5]
    assert abs(np.median(delays) / 0.2 - 1) < 0.05
    assert abs(np.std(np.log(delays)) - 0.5) < 0.03
    env.reset()
    started = time.perf_counter()
    env.step(env.optimal_turn())
    assert time.perf_counter() - started >= 0.01  # it slept
    with pytest.raises(ValueError, match="tool_latency"):
        envs.make("synthetic-nav", tool_latency=-1)


def test_a_rows_version_is_the_oldest_that_sampled_it():
    from types import SimpleNamespace

    from train.core.trainer import row_versions

    tokens = np.array([[-1, 3, 3, -1, 4], [-1, -1, -1, -1, -1], [-1, 5, 6, 6, -1]])
    rollouts = SimpleNamespace(token_versions=tokens, batch=SimpleNamespace(tokens=tokens))
    assert row_versions(rollouts, 2).tolist() == [3, 2, 5]  # a row with no sampled token: given
    assert row_versions(rollouts, 2, newest=True).tolist() == [4, 2, 6]
    rollouts.token_versions = None  # the lockstep loop before versions: every row the given one
    assert row_versions(rollouts, 7).tolist() == [7, 7, 7]
