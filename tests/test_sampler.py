"""The KV-cache sampler against transformers' greedy generation and full forward passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernels.logprobs import token_logprobs
from train.engine.sampler import Sampler, generate

PROMPTS = [[5, 17, 3, 44, 9, 1, 2], [7, 7], [60, 2, 31, 4]]


def full_logprobs(model, ids):
    """log softmax of a full forward pass: entry t is log p(ids[t + 1] | ids[:t + 1])."""
    logits = model(jnp.asarray([ids], jnp.int32))[0]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return np.asarray(logp[np.arange(len(ids) - 1), np.asarray(ids[1:])])


def test_greedy_matches_transformers_on_a_ragged_batch(tiny_qwen3):
    torch_model, model = tiny_qwen3
    gen = generate(model, PROMPTS, max_new_tokens=12, temperature=0.0)
    for prompt, tokens in zip(PROMPTS, gen.tokens, strict=True):
        with torch.no_grad():
            ref = torch_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert tokens == ref[0, len(prompt) :].tolist()


def test_logprobs_equal_a_full_forward_pass(tiny_qwen3):
    _, model = tiny_qwen3
    gen = generate(model, PROMPTS, max_new_tokens=10, temperature=0.0)
    for prompt, tokens, logprobs in zip(PROMPTS, gen.tokens, gen.logprobs, strict=True):
        full = full_logprobs(model, prompt + tokens)[len(prompt) - 1 :]
        np.testing.assert_allclose(logprobs, full, atol=1e-5)


def test_continuing_from_the_cache_equals_generating_from_the_full_prefix(tiny_qwen3):
    _, model = tiny_qwen3
    sampler = Sampler(model, batch_size=3, capacity=64)
    sampler.start(PROMPTS)
    turn1 = sampler.generate(max_new_tokens=5, temperature=0.0)
    observations = [[11, 12, 13], None, [14]]  # row 1 gets no observation
    sampler.extend(observations)
    turn2 = sampler.generate(max_new_tokens=6, temperature=0.0, active=[True, False, True])
    assert turn2.tokens[1] == []
    for i in (0, 2):
        prefix = PROMPTS[i] + turn1.tokens[i] + (observations[i] or [])
        fresh = generate(model, [prefix], max_new_tokens=6, temperature=0.0)
        assert turn2.tokens[i] == fresh.tokens[0]
        np.testing.assert_allclose(turn2.logprobs[i], fresh.logprobs[0], atol=1e-5)


def test_a_prefill_runs_only_the_rows_with_new_tokens_and_leaves_the_rest(tiny_qwen3):
    """Five rows, new ids for one or two: the call runs a power of two of rows (padded with
    rows that get none), and every row's logits and cache equal a prefill of all five."""
    _, model = tiny_qwen3
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    subset, whole = (Sampler(model, batch_size=5, capacity=64) for _ in range(2))
    whole._rows_to_extend = lambda n_new: None  # every row in every call
    for sampler in (subset, whole):
        sampler.start(prompts)
    for new in ([None, None, [21, 22, 23], None, None], [[24], None, None, [25, 26], None]):
        counts = np.array([len(r or ()) for r in new])
        chosen = subset._rows_to_extend(counts)
        assert len(chosen) == 1 << (int(np.count_nonzero(counts)) - 1).bit_length()
        assert set(np.flatnonzero(counts)) <= set(chosen) and len(set(chosen)) == len(chosen)
        subset.extend(new)
        whole.extend(new)
        np.testing.assert_array_equal(subset.lengths, whole.lengths)
        np.testing.assert_allclose(subset.next_logits, whole.next_logits, atol=1e-5)
        for got, want in zip(subset.cache, whole.cache, strict=True):
            for row, n in enumerate(subset.lengths):  # a row's first `length` slots are read
                np.testing.assert_allclose(got[:, row, :n], want[:, row, :n], atol=1e-5)
    assert subset._rows_to_extend(np.array([1, 2, 0, 3, 1])).tolist() == [0, 1, 3, 4]
    assert subset._rows_to_extend(np.array([1, 2, 0, 3, 0])).tolist() == [0, 1, 2, 3]
    assert subset._rows_to_extend(np.array([1, 2, 1, 3, 1])) is None  # every row: as they are
    a = subset.generate(max_new_tokens=6, temperature=0.0).tokens
    assert a == whole.generate(max_new_tokens=6, temperature=0.0).tokens


def test_sampled_logprobs_equal_the_learners_recomputation(tiny_qwen3):
    # The RL invariant: behaviour policy = old policy, at the sampling temperature.
    _, model = tiny_qwen3
    for temperature in (1.0, 0.7):
        gen = generate(model, PROMPTS, max_new_tokens=9, temperature=temperature, seed=1)
        weight, vocab_axis = model.lm_head()
        for prompt, tokens, logprobs in zip(PROMPTS, gen.tokens, gen.logprobs, strict=True):
            ids = jnp.asarray([prompt + tokens], jnp.int32)
            hidden = model.model(ids)[0, len(prompt) - 1 : -1]
            learner = token_logprobs(
                hidden, weight, jnp.asarray(tokens), vocab_axis=vocab_axis, temperature=temperature
            )
            np.testing.assert_allclose(logprobs, learner, atol=1e-5)


def test_stop_ids_end_a_row_and_are_kept(tiny_qwen3):
    _, model = tiny_qwen3
    free = generate(model, PROMPTS, max_new_tokens=8, temperature=0.0)
    stop = free.tokens[0][3]
    gen = generate(model, PROMPTS, max_new_tokens=8, temperature=0.0, stop_ids=(stop,))
    first = free.tokens[0].index(stop)
    assert gen.tokens[0] == free.tokens[0][: first + 1]
    assert gen.stopped[0]


def test_top_k_one_and_a_tiny_nucleus_are_greedy(tiny_qwen3):
    _, model = tiny_qwen3
    greedy = generate(model, PROMPTS, max_new_tokens=6, temperature=0.0).tokens
    assert generate(model, PROMPTS, max_new_tokens=6, top_k=1, seed=5).tokens == greedy
    assert generate(model, PROMPTS, max_new_tokens=6, top_p=1e-6, seed=6).tokens == greedy
    sampled = generate(model, PROMPTS, max_new_tokens=6, temperature=1.5, seed=7).tokens
    assert sampled != greedy  # sampling does sample


def test_capacity_and_bad_arguments_are_named(tiny_qwen3):
    _, model = tiny_qwen3
    sampler = Sampler(model, batch_size=2, capacity=10)
    with pytest.raises(ValueError, match=r"rows\[0\]: 0 \+ 11 tokens exceed the capacity 10"):
        sampler.start([[1] * 11, [2]])
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty prompt"):
        sampler.start([[1], []])
    sampler.start([[1] * 8, [2]])
    gen = sampler.generate(max_new_tokens=5, temperature=0.0)
    assert len(gen.tokens[0]) == 2 and len(gen.tokens[1]) == 5  # row 0 hits capacity
    with pytest.raises(ValueError, match="top_p"):
        sampler.generate(max_new_tokens=1, top_p=0.0)


@pytest.mark.parametrize("block", [1, 4, 64])
def test_two_level_categorical_samples_the_softmax(block):
    from train.engine.sampler import categorical

    logits = jnp.asarray([[0.0, 1.0, -jnp.inf, 2.0, -1.0, 0.5, -jnp.inf, 3.0, 0.0, -2.0]] * 2)
    n = 40_000
    keys = jax.random.split(jax.random.key(0), n // 2)
    draws = np.asarray(jax.vmap(lambda k: categorical(k, logits, block=block))(keys)).ravel()
    freq = np.bincount(draws, minlength=10) / draws.size
    probs = np.asarray(jax.nn.softmax(logits[0]))
    assert freq[2] == 0 and freq[6] == 0  # masked entries are never drawn
    tolerance = 4 * np.sqrt(probs * (1 - probs) / n) + 1e-4  # four standard errors
    assert np.all(np.abs(freq - probs) <= tolerance), (freq, probs)


def test_weights_held_one_array_a_layer_sample_what_the_stacked_ones_do():
    # a dense layer then two MoE layers: stacks of one and of two layers, both split per layer
    from flax import nnx

    from tests.models import tiny_model_config
    from train.model.qwen3 import Qwen3ForCausalLM

    cfg = tiny_model_config(num_layers=3, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, mlp_only_layers=(0,))  # fmt: skip
    assert cfg.layer_segments() == [(0, 1), (1, 2)]
    model, other = (Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed)) for seed in (0, 1))

    def sample(sampler):
        sampler.start(PROMPTS)
        return sampler.generate(max_new_tokens=8, temperature=1.0, seed=3, streams=[0, 1, 2])

    # by default: on the CPU from SPLIT_LAYERS_FROM bytes of weights, never on accelerators
    from train.engine.sampler import SPLIT_LAYERS_FROM, splits_layers

    def weights(n_bytes):  # two arrays of n_bytes in all, as a sampler's state would hold them
        half = jax.ShapeDtypeStruct((n_bytes // 2,), jnp.int8)
        return {"a": half, "b": jax.ShapeDtypeStruct((n_bytes - n_bytes // 2,), jnp.int8)}

    assert splits_layers(weights(SPLIT_LAYERS_FROM), "cpu")
    assert not splits_layers(weights(SPLIT_LAYERS_FROM), "gpu")
    assert not splits_layers(weights(SPLIT_LAYERS_FROM - 1), "cpu")
    assert Sampler(model, capacity=32).graphdef == nnx.split(model)[0]  # these weights: a stack

    stacked = Sampler(model, capacity=32, split_layers=False)
    split = Sampler(model, capacity=32, split_layers=True)
    assert len(nnx.merge(split.graphdef, split.state).model.layers) == 3
    a, b = sample(stacked), sample(split)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # new weights set as the learner sets them (stacked) are laid out again
    stacked.state = split.state = nnx.state(other)
    a, b = sample(stacked), sample(split)
    assert a.tokens == b.tokens and a.tokens != sample(Sampler(model, capacity=32)).tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    split.state = split.state  # a state laid out already is taken as it is
    assert sample(split).tokens == b.tokens
