"""Memory and speed at real sizes, checked small: precision, shapes that follow the data, remat,
chunked prefill, what is built only when read."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mpo_jax import algorithms
from mpo_jax.batch import TurnBatch
from tests.models import tiny_model_config
from train.core.learner import ActionRows, Models, UpdateFns, make_optimizer
from train.engine.sampler import Sampler
from train.model.qwen3 import Qwen3ForCausalLM

# The tolerances the README states for bfloat16 compute (float32 parameters), measured here on a
# tiny random model: logits within 3% of their scale, log-probs within 0.06 nats, gradients
# pointing the same way (cosine > 0.995; measured: 1.6-2.0%, 0.02-0.03 nats, 0.9997).
BF16_LOGITS, BF16_LOGP, BF16_COSINE = 0.03, 0.06, 0.995


def _batch(rng, b=4, t=24, vocab=64):
    mask = np.zeros((b, t), bool)
    for i in range(b):
        n = rng.integers(8, t - 2)
        mask[i, 3 : n // 2] = True
        mask[i, n // 2 + 2 : n] = True
    turn = np.cumsum(np.diff(np.pad(mask, ((0, 0), (1, 0))).astype(int), axis=1) == 1, 1) - 1
    return TurnBatch(
        tokens=np.where(mask | (np.arange(t) < 3), rng.integers(1, vocab, (b, t)), 0).astype(
            np.int32
        ),
        loss_mask=mask,
        turn_ids=np.where(mask, turn, -1).astype(np.int32),
        rewards=None,
        group_ids=None,
        truncated=None,
        old_logp=np.where(mask, -rng.uniform(3, 5, (b, t)), 0).astype(np.float32),
        advantages=np.where(mask, rng.normal(size=(b, t)), 0).astype(np.float32),
    )


def _fns(cfg):
    actor = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(actor)
    tx = make_optimizer(1e-3, warmup_steps=0, clip=1.0, weight_decay=0.0)
    return UpdateFns(Models(graphdef, None), algorithms.get("mpo"), tx, tx, temperature=1.0), params


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)])


def test_padding_to_the_longest_row_changes_no_loss_or_gradient():
    # the same rows padded to a long budget and narrowed to their longest row (ActionRows.of)
    rng = np.random.default_rng(0)
    batch = _batch(rng)
    long = batch.narrow(64)  # as if padded to a --max-len of 64
    fns, params = _fns(tiny_model_config())
    names = ("old_logp", "advantages")
    short_rows = ActionRows.of(batch, names)
    long_rows = ActionRows.of(long, names, width=64)
    assert short_rows.tokens.shape[1] < long_rows.tokens.shape[1] == 64
    count = float(batch.loss_mask.sum())
    (a, _), ga = fns.actor_grad(params, short_rows, count, count)
    (b, _), gb = fns.actor_grad(params, long_rows, count, count)
    assert float(a) == pytest.approx(float(b), abs=1e-6)
    np.testing.assert_allclose(_flat(ga), _flat(gb), rtol=1e-4, atol=1e-5)  # summation order


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_recomputes_the_same_gradients(remat):
    rng = np.random.default_rng(1)
    rows = ActionRows.of(_batch(rng), ("old_logp", "advantages"))
    fns, params = _fns(tiny_model_config())
    fns_r, _ = _fns(tiny_model_config(remat=remat))
    count = float(rows.loss_mask.sum())
    (a, _), ga = fns.actor_grad(params, rows, count, count)
    (b, _), gb = fns_r.actor_grad(params, rows, count, count)
    assert float(a) == pytest.approx(float(b), abs=1e-6)
    np.testing.assert_allclose(_flat(ga), _flat(gb), rtol=1e-4, atol=1e-5)  # summation order


def test_bfloat16_compute_stays_within_the_stated_tolerances():
    rng = np.random.default_rng(2)
    batch = _batch(rng)
    rows = ActionRows.of(batch, ("old_logp", "advantages"))
    f32 = tiny_model_config()
    bf16 = dataclasses.replace(f32, dtype=jnp.bfloat16)
    fns, params = _fns(f32)
    fns_b, _ = _fns(bf16)
    ids = jnp.asarray(batch.tokens)
    exact = nnx.merge(fns.models.actor, params)(ids)
    half = nnx.merge(fns_b.models.actor, params)(ids)
    assert half.dtype == jnp.float32  # logits accumulate in float32 whatever the compute dtype
    scale = float(jnp.abs(exact).max())
    assert float(jnp.abs(half - exact).max()) < BF16_LOGITS * scale
    from train.core.learner import token_logprobs

    lp, _ = token_logprobs(fns.models.actor, params, rows.tokens, rows.positions)
    lp_b, _ = token_logprobs(fns_b.models.actor, params, rows.tokens, rows.positions)
    assert lp_b.dtype == jnp.float32
    assert float(jnp.abs(jnp.where(rows.loss_mask, lp - lp_b, 0)).max()) < BF16_LOGP
    count = float(rows.loss_mask.sum())
    (_, _), g = fns.actor_grad(params, rows, count, count)
    (_, _), g_b = fns_b.actor_grad(params, rows, count, count)
    a, b = _flat(g), _flat(g_b)
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > BF16_COSINE
    # the KV cache is held in the compute dtype
    sampler = Sampler(nnx.merge(fns_b.models.actor, params), capacity=32)
    sampler.start([[1, 2, 3]])
    assert sampler.cache.k.dtype == jnp.bfloat16


def test_bfloat16_parameters_with_float32_moments():
    # --param-dtype bfloat16 --opt-dtype float32: moments in float32, the update added in float32
    rng = np.random.default_rng(3)
    rows = ActionRows.of(_batch(rng), ("old_logp", "advantages"))
    cfg = tiny_model_config(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    actor = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(actor)
    tx = make_optimizer(1e-2, warmup_steps=0, clip=1.0, weight_decay=0.0)
    fns = UpdateFns(Models(graphdef, None), algorithms.get("mpo"), tx, tx, temperature=1.0,
                    opt_dtype=jnp.float32)  # fmt: skip
    opt = fns.init("actor", params)
    moments = [x for x in jax.tree.leaves(opt) if getattr(x, "ndim", 0) >= 1]
    assert moments and all(x.dtype == jnp.float32 for x in moments)
    count = float(rows.loss_mask.sum())
    (loss, _), grads = fns.actor_grad(params, rows, count, count)
    before = jax.tree.map(jnp.copy, params)
    new, _, ok, _ = fns.apply("actor", params, opt, grads, loss)
    assert bool(ok)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(new))
    assert np.abs(_flat(new) - _flat(before)).max() > 0  # it moved


def test_chunked_prefill_equals_one_chunk(tiny_qwen3):
    _, model = tiny_qwen3
    prompts = [[5, 17, 3, 44, 9, 1, 2, 8, 8, 30, 31], [7, 7], [60, 2, 31, 4, 5]]
    outs = []
    for chunk in (4, 512):
        sampler = Sampler(model, capacity=40, prefill_chunk=chunk)
        sampler.start(prompts)
        outs.append(sampler.generate(max_new_tokens=6, temperature=0.0))
        sampler.close()
        assert sampler.cache is None  # released
    assert outs[0].tokens == outs[1].tokens
    np.testing.assert_allclose(outs[0].logprobs[0], outs[1].logprobs[0], atol=1e-5)


def test_the_reference_and_the_critic_exist_only_where_something_reads_them(tmp_path):
    from train import run
    from train.core import trainer as trainer_module
    from train.core.checkpoint import Checkpoints
    from train.core.config import parse_args

    tiny = ["--layers", "1", "--width", "32", "--heads", "2", "--kv-heads", "1",
            "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "0", "--no-progress",
            "--steps", "1"]  # fmt: skip
    grpo = trainer_module.Trainer(parse_args([*tiny, "--preset", "grpo", "--no-log-ref-kl"]))
    assert grpo.ref is None and "critic" not in grpo.state  # nothing reads either
    assert (
        trainer_module.Trainer(parse_args([*tiny, "--preset", "grpo"])).ref is not None
    )  # ref_kl reads it
    assert (
        trainer_module.Trainer(parse_args([*tiny, "--preset", "trace", "--no-log-ref-kl"])).ref
        is not None
    )
    mpo = trainer_module.Trainer(parse_args([*tiny, "--preset", "mpo", "--no-log-ref-kl"]))
    assert mpo.ref is None and "critic" in mpo.state
    assert run.main([*tiny, "--preset", "mpo", "--run-dir", str(tmp_path)]) == 0
    ckpt = Checkpoints(tmp_path / "checkpoints")
    saved = {p.name for p in (tmp_path / "checkpoints" / str(ckpt.latest())).iterdir()}
    assert {"actor", "critic", "actor_opt", "critic_opt"} <= saved and "ref" not in saved
