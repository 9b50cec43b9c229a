"""Environments and the rollout loop: scripted policies, hostile outputs, token accounting."""

from __future__ import annotations

import numpy as np
import pytest

import envs
from envs.rollout import collect
from envs.scripted import ScriptedPolicy, oracle_act
from mpo_jax.batch import num_turns, validate


def nav_batch(n=12, act=None, seed=0, **options):
    batch_envs = [envs.make("synthetic-nav", seed=seed + i, **options) for i in range(n)]
    codec = batch_envs[0].codec
    act = act or (lambda i: batch_envs[i].optimal_turn())
    policy = ScriptedPolicy(codec, act)
    out = collect(
        batch_envs,
        codec,
        policy,
        group_ids=[i // 4 for i in range(n)],
        max_len=64,
        max_new_tokens=batch_envs[0].turn_length,
    )
    return out, batch_envs, codec, policy


def test_registry_lists_and_rejects():
    assert "synthetic-nav" in envs.list_envs()
    with pytest.raises(ValueError, match=r"unknown environment 'nav'; choose one of \["):
        envs.make("nav")


def test_scripted_optimal_policy_always_succeeds():
    out, *_ = nav_batch(n=24)
    assert all(ep["success"] for ep in out.episodes)
    assert out.batch.rewards.sum() == 24


def test_scripted_wrong_policy_gets_nothing():
    out, *_ = nav_batch(act=lambda i: "s0 s0")  # never names an exit
    assert not any(ep["success"] for ep in out.episodes)
    assert out.batch.rewards.sum() == 0
    assert all(ep["truncated"] for ep in out.episodes)  # the turn limit ends them


def test_random_policy_succeeds_sometimes():
    rng = np.random.default_rng(0)
    out, *_ = nav_batch(n=200, act=lambda i: f"s0 e{rng.integers(0, 4)}")
    rate = np.mean([ep["success"] for ep in out.episodes])
    assert 0.05 < rate < 0.8, rate


def test_hostile_outputs_never_raise():
    rng = np.random.default_rng(1)
    env = envs.make("synthetic-nav", seed=0)
    env.reset()
    for text in [
        "",
        " ",
        "e99",
        "e-1",
        "r3",
        "<bos> <eot>",
        "é\x00\uffff",
        "e" * 10_000,
        "".join(map(chr, rng.integers(0, 0x2FFF, size=300))),
    ]:
        obs, reward, terminated, truncated, info = env.step(text)
        assert isinstance(obs.user, str) and reward in (0.0, 1.0)
        if terminated or truncated:
            env.reset()


def test_token_accounting():
    rng = np.random.default_rng(2)
    out, batch_envs, codec, policy = nav_batch(
        act=lambda i: f"s{rng.integers(0, 1)} e{rng.integers(0, 4)}"
    )
    b = out.batch
    validate(b, vocab_size=codec.vocab_size)
    for i in range(len(batch_envs)):
        n = int(out.episodes[i]["tokens"])
        # decoding the batch's tokens reproduces the conversation the policy saw
        assert b.tokens[i, :n].tolist() == policy.history[i][:n]
        assert not b.loss_mask[i, n:].any()
        # loss_mask is True exactly on sampled tokens: every turn is turn_length tokens
        turns = out.episodes[i]["turns"]
        assert b.loss_mask[i].sum() == turns * batch_envs[i].turn_length
        assert int(num_turns(b.loss_mask, b.turn_ids)[i]) == turns
        assert (b.step_keys[i, :turns] >= 0).all()
        # boundaries: the prompt, then one after each turn that got an observation
        lengths = out.boundary_lengths[i][b.boundary_mask[i]]
        assert lengths[0] == codec.prompt(batch_envs[i].reset()).__len__() or lengths[0] > 0
        assert np.all(np.diff(lengths) > 0)
    # the outcome sits on the last action token
    rows = np.nonzero(b.rewards.sum(1))[0]
    for i in rows:
        last = np.nonzero(b.loss_mask[i])[0][-1]
        assert b.rewards[i, last] == 1.0


def test_length_budget_truncates_instead_of_crashing():
    batch_envs = [
        envs.make("synthetic-nav", seed=i, max_turns=20, max_distance=3) for i in range(4)
    ]
    codec = batch_envs[0].codec
    policy = ScriptedPolicy(codec, lambda i: "s0 s0")
    out = collect(batch_envs, codec, policy, group_ids=[0, 0, 1, 1], max_len=20, max_new_tokens=2)
    assert all(ep["truncated"] for ep in out.episodes)
    assert all(ep["tokens"] <= 20 for ep in out.episodes)
    validate(out.batch)


class _Recorder:
    """An environment's oracle, recording the turns it wrote."""

    def __init__(self, env):
        self.act = oracle_act(env)
        self.texts: list[str] = []

    def __call__(self, _row):
        self.texts.append(self.act())
        return self.texts[-1]


@pytest.mark.parametrize("name", ["search", "bfcl", "tau2-retail"])
def test_real_environments_through_the_rollout_loop_with_the_qwen3_format(name):
    from envs.chat import ChatFormat, load_tokenizer

    chat = ChatFormat(load_tokenizer())
    batch_envs = [envs.make(name, seed=s) for s in (0, 0, 1)]
    oracles = [_Recorder(e) for e in batch_envs]
    policy = ScriptedPolicy(chat, lambda i: oracles[i](i))
    out = collect(
        batch_envs, chat, policy, group_ids=[0, 0, 1], max_len=12_288, max_new_tokens=1_024
    )
    b = out.batch
    validate(b, vocab_size=len(chat.tokenizer))
    assert all(ep["success"] for ep in out.episodes), out.episodes
    assert b.rewards.sum() == 3 and (b.step_keys[0] == b.step_keys[1]).all()  # one group, one task
    for i, oracle in enumerate(oracles):
        n = int(out.episodes[i]["tokens"])
        assert b.tokens[i, :n].tolist() == policy.history[i][:n]
        turns = out.episodes[i]["turns"]
        assert int(num_turns(b.loss_mask, b.turn_ids)[i]) == turns == len(oracle.texts)
        # each turn's tokens are exactly the sampled ones (the text and the stop token)
        for k, text in enumerate(oracle.texts):
            ids = b.tokens[i][b.turn_ids[i] == k].tolist()
            assert ids == chat.encode(text) + [chat.im_end]
        # the whole row decodes to the conversation: prompt, turns, the env's observations
        decoded = chat.decode(b.tokens[i, :n].tolist())
        assert decoded.startswith("<|im_start|>system\n") and decoded.endswith("<|im_end|>")
        assert all(text in decoded for text in oracle.texts)
        last = np.nonzero(b.loss_mask[i])[0][-1]
        assert b.rewards[i, last] == 1.0 and b.rewards[i].sum() == 1.0


class _Exploding:
    tools: list = []
    max_turns = 4
    gold_answer = None

    def reset(self):
        return [{"role": "user", "content": "<bos>"}]

    def step(self, text):
        raise RuntimeError("backend crashed")


def test_an_environment_that_raises_ends_only_its_own_episode():
    good = envs.make("synthetic-nav", seed=0)
    codec = good.codec
    batch_envs = [good, _Exploding()]
    policy = ScriptedPolicy(codec, lambda i: batch_envs[0].optimal_turn() if i == 0 else "s0 e0")
    out = collect(
        batch_envs, codec, policy, group_ids=[0, 1], max_len=64, max_new_tokens=good.turn_length
    )
    assert out.episodes[0]["success"]
    assert out.episodes[1]["truncated"] and "backend crashed" in out.episodes[1]["env_exception"]
    validate(out.batch)


# -- held-out splits and the credit-assignment study's tasks --------------------------------

STUDY_ENVS = ("synthetic-nav-longturns", "synthetic-keydoor", "synthetic-nav-noisy")


def _task_ids(name, split, seeds):
    out = set()
    for s in seeds:
        env = envs.make(name, seed=s, split=split)
        env.reset()
        assert env.split == split
        out.add(env.task_id)
    return out


@pytest.mark.parametrize("name", envs.list_envs())
def test_held_out_tasks_are_disjoint_from_training_tasks(name):
    train = _task_ids(name, "train", range(400))
    test = _task_ids(name, "test", range(150))
    assert None not in train | test, "task_id must name the task after reset"
    assert test and len(train) > len(test)
    assert not train & test, sorted(train & test, key=str)[:5]


@pytest.mark.parametrize("name", ["synthetic-nav", *STUDY_ENVS])
def test_synthetic_splits_cover_every_instance_once(name):
    every = envs.make(name, split="all").pool
    train, test = envs.make(name, split="train").pool, envs.make(name, split="test").pool
    assert sorted(train + test) == sorted(every) and len(test) == round(0.2 * len(every))


def _play(name, act, n, **options):
    batch_envs = [envs.make(name, seed=i, **options) for i in range(n)]
    codec = batch_envs[0].codec
    out = collect(
        batch_envs,
        codec,
        ScriptedPolicy(codec, lambda i: act(batch_envs[i], i)),
        group_ids=list(range(n)),
        max_len=batch_envs[0].max_episode_tokens(codec),
        max_new_tokens=batch_envs[0].turn_budget,
    )
    return out, batch_envs


@pytest.mark.parametrize("name", ["synthetic-nav", "synthetic-nav-long", *STUDY_ENVS])
def test_study_tasks_optimal_random_and_the_longest_episode(name):
    # the scripted optimal policy solves the deterministic tasks always (noisy: slips may cost)
    out, batch_envs = _play(name, lambda env, i: env.optimal_turn(), 200)
    rate = np.mean([ep["success"] for ep in out.episodes])
    assert rate >= (0.95 if name.endswith("noisy") else 1.0), rate
    # a uniformly random policy over the vocabulary (a random-init model) gets signal
    rng = np.random.default_rng(0)
    vocab = batch_envs[0].codec.vocabulary[1:]

    def random_turn(env, i):
        return " ".join(rng.choice(vocab, size=env.turn_length))

    out, batch_envs = _play(name, random_turn, 400)
    rate = np.mean([ep["success"] for ep in out.episodes])
    assert 0.03 < rate < 0.8, rate
    # nothing is cut by length at the environment's own longest episode, which is reached
    assert not any(ep["length_cut"] for ep in out.episodes)
    longest = batch_envs[0].max_episode_tokens()
    lengths = [ep["tokens"] for ep in out.episodes]
    assert max(lengths) == longest, (max(lengths), longest)


def test_longturns_has_many_action_tokens_a_turn_and_six_turns():
    env = envs.make("synthetic-nav-longturns")
    assert env.turn_length == 24 and env.max_turns == 6
    env.reset()
    # only the last word acts: the same turn with other scratch words moves the same way
    a = env.optimal_turn().split()
    env2 = envs.make("synthetic-nav-longturns")
    env2.reset()
    env2.step(" ".join(["s3"] * 23 + [a[-1]]))
    env.step(" ".join(a))
    assert env.room == env2.room


def test_keydoor_only_the_first_turn_decides():
    env = envs.make("synthetic-keydoor", seed=3)
    env.reset()
    right, wrong = f"k{env.door}", f"k{(env.door + 1) % env.keys}"
    info = env.step(f"s0 {right} {wrong} s1").info  # the first key word is the pick
    assert info["action_quality"] == 1.0 and env.held == env.door
    for _ in range(env.max_turns - 2):
        obs, reward, terminated, truncated, info = env.step(wrong)  # later keys change nothing
        assert not terminated and reward == 0 and info["action_quality"] == 0.0
    obs, reward, terminated, truncated, info = env.step("s0")
    assert terminated and reward == 1.0 and info["success"]
    env.reset()
    assert env.step("s0 s1 s2 s3").info["action_quality"] == -1.0  # no key at all


def test_nav_action_quality_grades_the_move_against_the_shortest_path():
    env = envs.make("synthetic-nav", seed=5)
    env.reset()
    d = env.distance[env.room, env.goal]
    best = env.optimal_turn()
    assert env.step(best).info["action_quality"] == 1.0
    assert env.distance[env.room, env.goal] == d - 1
    assert env.step("s0 s0").info["action_quality"] == 0.0  # invalid: no move


def test_noisy_nav_slips_sometimes_and_deterministically_per_seed():
    def rooms(seed):
        env = envs.make("synthetic-nav-noisy", seed=seed)
        env.reset()
        return [env.step("s0 e0").observation.user for _ in range(6)]

    assert rooms(1) == rooms(1)
    clean = envs.make("synthetic-nav", seed=0)
    slips = 0
    for seed in range(60):
        env = envs.make("synthetic-nav-noisy", seed=seed)
        env.reset()
        expected = env.graph[env.room, 0]
        env.step("s0 e0")
        slips += env.room != expected
    assert 3 <= slips <= 30, slips  # slip 0.25 (a random exit may be the chosen one)
    assert clean.slip == 0.0


@pytest.mark.parametrize("name", STUDY_ENVS)
def test_study_tasks_survive_hostile_outputs(name):
    rng = np.random.default_rng(1)
    env = envs.make(name, seed=0)
    env.reset()
    for text in ["", " ", "k99", "e-1", "<bos> <eot>", "é\x00\uffff", "k" * 10_000,
                 "".join(map(chr, rng.integers(0, 0x2FFF, size=300)))]:  # fmt: skip
        obs, reward, terminated, truncated, info = env.step(text)
        assert isinstance(obs.user, str) and reward in (0.0, 1.0)
        assert len(obs.user.split()) == env.obs_len
        if terminated or truncated:
            env.reset()


@pytest.mark.parametrize("name", ["synthetic-nav", *STUDY_ENVS])
def test_check_environment_passes_the_synthetic_tasks(name):
    from envs.checks import check_environment

    noisy = name.endswith("noisy")
    report = check_environment(lambda s: envs.make(name, seed=s), min_success=0.8 if noisy else 1)
    assert report["scripted_success"] >= (0.8 if noisy else 1.0)


def test_check_environment_names_what_is_wrong():
    from envs.checks import check_environment
    from envs.synthetic import SyntheticNav

    class Fragile(SyntheticNav):
        def step(self, text):
            if not text:
                raise RuntimeError("empty turn")
            return super().step(text)

    with pytest.raises(AssertionError, match=r"hostile turn 0 \(''\) raised RuntimeError"):
        check_environment(lambda s: Fragile(seed=s))

    class Unsolvable(SyntheticNav):
        def optimal_turn(self):
            return "s0 s0"

    with pytest.raises(AssertionError, match="scripted policy: success 0.00 < 1"):
        check_environment(lambda s: Unsolvable(seed=s))


def test_play_episode_plays_to_the_end_and_says_when_it_cannot():
    from envs.checks import play_episode

    env = envs.make("synthetic-nav", seed=3)
    solved = play_episode(env, lambda e: e.optimal_turn())
    assert solved.terminated and solved.reward == 1.0
    # a list that runs out first returns its last result, the episode still open
    first = play_episode(env, ["stay"])
    assert not (first.terminated or first.truncated)
    # a scripted policy that never ends the episode within the limit is an error
    with pytest.raises(AssertionError, match="did not end within 2 turns"):
        play_episode(envs.make("synthetic-nav", seed=3, max_turns=50), lambda e: "stay", limit=2)
    with pytest.raises(ValueError, match="turns: no turn"):
        play_episode(env, [])


# -- the credit study's round-2 tasks: long turns in which several tokens decide ----------------

CALL_ENVS = ("synthetic-calls", "synthetic-calls-varlen")


@pytest.mark.parametrize("name", CALL_ENVS)
def test_call_tasks_scripted_random_demonstrations_and_the_longest_episode(name):
    out, batch_envs = _play(name, lambda env, i: env.optimal_turn(), 100)
    assert all(ep["success"] for ep in out.episodes)  # the scripted policy always succeeds
    rng = np.random.default_rng(0)
    vocab = batch_envs[0].codec.vocabulary[1:]
    out, _ = _play(name, lambda env, i: " ".join(rng.choice(vocab, size=env.turn_length)), 200)
    assert np.mean([ep["success"] for ep in out.episodes]) < 0.02  # random: about never
    # demonstrations with noise ε succeed (1 - ε)^calls of the time: a warm start's success
    demo_rng = np.random.default_rng(1)
    out, batch_envs = _play(name, lambda env, i: env.demo_turn(demo_rng, noise=0.3), 400)
    rate = np.mean([ep["success"] for ep in out.episodes])
    assert abs(rate - 0.7**4) < 0.06, rate
    # the longest episode is exact: reached by turns of the most words
    longest = batch_envs[0].max_episode_tokens()
    out, _ = _play(name, lambda env, i: " ".join(["s0"] * env.turn_length), 4)
    assert max(ep["tokens"] for ep in out.episodes) == longest
    assert not any(ep["length_cut"] for ep in out.episodes)


def test_a_call_is_read_anywhere_in_the_turn_and_graded():
    env = envs.make("synthetic-calls", seed=2)
    env.reset()
    right = env.call_text(env.room).split()
    turn = ["s1"] * 20 + right + ["call", "t0", "a0"] + ["s2"] * 6  # the first call counts
    assert env.step(" ".join(turn)).info["action_quality"] == 1.0
    assert env.step(" ".join(["s0"] * 32)).info["action_quality"] == -1.0  # no call
    bad = ["call", "a1", "t1"] + right  # a malformed first call fails the turn
    assert env.step(" ".join(bad + ["s0"] * 26)).info["action_quality"] == -1.0
    obs, reward, terminated, _, info = env.step(" ".join(right + ["s0"] * 29))
    assert terminated and reward == 0.0 and not info["success"]  # two of four were right
    varlen = envs.make("synthetic-calls-varlen", seed=2)
    varlen.reset()
    call = varlen.call_text(varlen.room)
    assert varlen.step(f"s0 <eot> {call}").info["action_quality"] == -1.0  # after the end
    assert varlen.codec.stop_ids == varlen.codec.end_of_turn == (varlen.codec.index["<eot>"],)
