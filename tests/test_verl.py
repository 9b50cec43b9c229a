"""MPO inside verl (mpo_jax/integrations/verl.py), against the real verl package: its own
compute_advantage on a real DataProto equals our estimators, its policy-loss registry gives our
turn-level loss (value and per-token gradient), and bad input names verl's key or field."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
    import torch
    import verl  # noqa: F401
except ImportError as e:  # fails loudly: make test installs the verl extra
    raise ImportError(
        f"tests/test_verl.py needs the verl extra, which make test installs: {e}"
    ) from e

from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

import mpo_jax.integrations.verl as mpo_verl  # noqa: E402
from mpo_jax import advantages as adv  # noqa: E402
from mpo_jax.losses import policy_loss  # noqa: E402

SETTINGS = {"beta": 0.3, "gamma_turn": 0.97, "lam_turn": 0.9, "gamma_token": 0.99, "lam_token": 0.8}


def _algorithm(estimator: str, **mpo) -> OmegaConf:
    return OmegaConf.create(
        {"adv_estimator": estimator, "gamma": 0.98, "lam": 0.85, "mpo": {**SETTINGS, **mpo}}
    )


def _response_mask(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Multi-turn response masks: sampled turns (1) between tool replies (0), then padding. Row
    0 is empty, row 1 one turn, row 2 turns of one token; the rest random."""
    mask = np.zeros((rows, cols), np.float32)
    for b in range(1, rows):
        length = int(rng.integers(1, cols + 1))
        if b == 1:
            mask[b, :length] = 1
        elif b == 2:
            mask[b, :length:2] = 1
        else:
            t = 0
            while t < length:
                turn, tool = int(rng.integers(1, 6)), int(rng.integers(0, 4))
                mask[b, t : min(t + turn, length)] = 1
                t += turn + tool
    return mask


def _batch(seed: int, rows: int = 9, cols: int = 37):
    rng = np.random.default_rng(seed)
    mask = _response_mask(rng, rows, cols)
    rewards = np.zeros_like(mask)
    for b in range(rows):
        sampled = np.flatnonzero(mask[b])
        if len(sampled):
            rewards[b, sampled[-1]] = float(rng.integers(0, 2))  # the outcome on the last token
            some = rng.choice(sampled, size=min(2, len(sampled)), replace=False)
            rewards[b, some] += rng.normal(size=len(some)).astype(np.float32)  # turn rewards
    values = rng.normal(size=mask.shape).astype(np.float32)
    return rewards, values, mask


def _turn_ids(mask: np.ndarray) -> np.ndarray:
    """The turns of a mask, written plainly (the reference for turn_ids_from_mask)."""
    ids = np.full(mask.shape, -1, np.int32)
    for b in range(mask.shape[0]):
        k, before = -1, False
        for t in range(mask.shape[1]):
            if mask[b, t] and not before:
                k += 1
            if mask[b, t]:
                ids[b, t] = k
            before = bool(mask[b, t])
    return ids


def _data(rewards, values, mask, **extra) -> DataProto:
    tensors = {
        "token_level_rewards": torch.tensor(rewards),
        "values": torch.tensor(values),
        "response_mask": torch.tensor(mask),
        **extra,
    }
    uid = np.array([f"task{b // 3}" for b in range(len(mask))], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


def test_the_estimators_and_losses_are_in_verls_registries():
    for name in mpo_verl.ESTIMATORS:
        assert core_algos.get_adv_estimator_fn(name) is not None
    for name in mpo_verl.LOSSES:
        assert core_algos.get_policy_loss_fn(name) is not None


@pytest.mark.parametrize("seed", range(4))
def test_verls_compute_advantage_with_mpo_equals_multiscale_advantages(seed):
    rewards, values, mask = _batch(seed)
    data = ray_trainer.compute_advantage(
        _data(rewards, values, mask), adv_estimator="mpo", gamma=0.98, lam=0.85,
        config=_algorithm("mpo"),
    )  # fmt: skip
    tid = _turn_ids(mask)
    expected = adv.multiscale_advantages(rewards, values, mask > 0, tid, **SETTINGS)
    _, returns = adv.token_gae(rewards, values, mask > 0, gamma=0.98, lam=0.85)
    np.testing.assert_allclose(data.batch["advantages"].numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(data.batch["returns"].numpy(), returns, rtol=1e-5, atol=1e-5)
    assert not data.batch["advantages"][0].any()  # the empty row


def test_an_explicit_turn_id_field_wins_over_the_mask_runs():
    rewards, values, mask = _batch(7)
    tid = _turn_ids(mask)
    merged = np.where(tid >= 0, tid // 2, -1).astype(np.int32)  # two mask runs a turn
    data = _data(rewards, values, mask, turn_ids=torch.tensor(merged))
    data = ray_trainer.compute_advantage(data, adv_estimator="mpo", config=_algorithm("mpo"))
    expected = adv.multiscale_advantages(rewards, values, mask > 0, merged, **SETTINGS)
    np.testing.assert_allclose(data.batch["advantages"].numpy(), expected, rtol=1e-5, atol=1e-5)


def test_turn_gae_with_one_token_turns_equals_verls_gae():
    """Where every turn is one token, turn GAE is token GAE: verl's own gae (which whitens)
    equals ours whitened, and the returns are equal."""
    rng = np.random.default_rng(3)
    mask = np.zeros((6, 20), np.float32)
    mask[:, 0:16:3] = 1  # one-token turns between two-token tool replies
    rewards = np.where(mask > 0, rng.normal(size=mask.shape), 0).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    ours = ray_trainer.compute_advantage(
        _data(rewards, values, mask), adv_estimator="turn_gae", config=_algorithm("turn_gae"),
        gamma=0.98, lam=0.85,
    )  # fmt: skip
    theirs = ray_trainer.compute_advantage(
        _data(rewards, values, mask), adv_estimator="gae", gamma=0.97, lam=0.9,
        config=OmegaConf.create({"use_pf_ppo": False}),
    )  # fmt: skip
    whitened = core_algos.verl_F.masked_whiten(ours.batch["advantages"], torch.tensor(mask))
    m = mask > 0
    np.testing.assert_allclose(
        whitened.numpy()[m], theirs.batch["advantages"].numpy()[m], atol=1e-5
    )
    # the critic targets: ours with verl's gamma/lam; verl's gae ran with the turn (γ, λ) here
    retheirs = ray_trainer.compute_advantage(
        _data(rewards, values, mask), adv_estimator="gae", gamma=0.98, lam=0.85,
        config=OmegaConf.create({"use_pf_ppo": False}),
    )  # fmt: skip
    np.testing.assert_allclose(
        ours.batch["returns"].numpy()[m], retheirs.batch["returns"].numpy()[m], atol=1e-5
    )


def test_mpo_at_beta_zero_is_turn_gae_and_keeps_each_turns_mean():
    rewards, values, mask = _batch(11)
    tid = _turn_ids(mask)
    at_zero = ray_trainer.compute_advantage(
        _data(rewards, values, mask), adv_estimator="mpo", config=_algorithm("mpo", beta=0.0)
    ).batch["advantages"]
    turn = ray_trainer.compute_advantage(
        _data(rewards, values, mask), adv_estimator="turn_gae", config=_algorithm("turn_gae")
    ).batch["advantages"]
    np.testing.assert_allclose(at_zero.numpy(), turn.numpy(), atol=1e-6)
    full = (
        ray_trainer.compute_advantage(
            _data(rewards, values, mask), adv_estimator="mpo", config=_algorithm("mpo", beta=2.0)
        )
        .batch["advantages"]
        .numpy()
    )
    for b, k in {(b, k) for b, k in zip(*np.nonzero(tid >= 0), strict=True)}:
        k = tid[b, k]
        turn_tokens = tid[b] == k
        assert full[b, turn_tokens].mean() == pytest.approx(
            turn.numpy()[b, turn_tokens].mean(), abs=1e-5
        )


def test_a_reward_on_a_tool_token_moves_to_the_last_sampled_token_before_it():
    mask = np.array([[1, 1, 0, 0, 1, 0, 0]], np.float32)
    rewards = np.zeros_like(mask)
    rewards[0, 6] = 1.0  # the row ended on a tool reply
    values = np.zeros_like(mask)
    moved = rewards.copy()
    moved[0, 6], moved[0, 4] = 0.0, 1.0
    data = ray_trainer.compute_advantage(
        _data(rewards, values, mask), adv_estimator="mpo", config=_algorithm("mpo")
    )
    expected = adv.multiscale_advantages(moved, values, mask > 0, _turn_ids(mask), **SETTINGS)
    np.testing.assert_allclose(data.batch["advantages"].numpy(), expected, atol=1e-6)
    assert data.batch["advantages"][0, 4] != 0


def test_gigpo_groups_turns_of_equal_states():
    rewards, values, mask = _batch(5, rows=6, cols=24)
    tid = _turn_ids(mask)
    k = int(tid.max()) + 1
    rng = np.random.default_rng(0)
    keys = np.where(np.arange(k)[None] <= tid.max(axis=1)[:, None], rng.integers(0, 3, (6, k)), -1)
    data = _data(rewards, values, mask, step_keys=torch.tensor(keys))
    out = ray_trainer.compute_advantage(data, adv_estimator="gigpo", config=_algorithm("gigpo"))
    step_rewards = np.zeros((6, k), np.float32)
    for b, t in zip(*np.nonzero(tid >= 0), strict=True):
        step_rewards[b, tid[b, t]] += rewards[b, t]
    groups = np.array([b // 3 for b in range(6)])
    per_turn = adv.gigpo_advantages(step_rewards, keys, keys >= 0, groups, gamma=0.95, omega=1.0)
    expected = np.where(
        tid >= 0, np.take_along_axis(np.asarray(per_turn), np.maximum(tid, 0), 1), 0
    )
    np.testing.assert_allclose(out.batch["advantages"].numpy(), expected, atol=1e-5)


# -- the policy losses ---------------------------------------------------------------------------

MODES = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
}


def _actor(**kw) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        clip_ratio_low=0.15, clip_ratio_high=0.25, **kw,
    )  # fmt: skip


def _loss_inputs(seed: int):
    rewards, _, mask = _batch(seed)
    rng = np.random.default_rng(seed + 100)
    old = rng.normal(-1.0, 0.3, mask.shape).astype(np.float32)
    logp = (old + rng.normal(0, 0.15, mask.shape)).astype(np.float32)
    advantages = rng.normal(size=mask.shape).astype(np.float32) * mask
    return logp, old, advantages, mask


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("seed", range(2))
def test_the_mpo_loss_equals_policy_loss_at_turn_level_value_and_gradient(mode, seed):
    logp, old, advantages, mask = _loss_inputs(seed)
    log_prob = torch.tensor(logp, requires_grad=True)
    fn = core_algos.get_policy_loss_fn("mpo")
    loss, metrics = fn(torch.tensor(old), log_prob, torch.tensor(advantages), torch.tensor(mask),
                       loss_agg_mode=mode, config=_actor())  # fmt: skip
    loss.backward()

    def ours(lp):
        value, _ = policy_loss(lp, old, advantages, mask > 0, _turn_ids(mask), ratio_level="turn",
                               clip_low=0.15, clip_high=0.25, dual_clip=3.0,
                               aggregation=MODES[mode])  # fmt: skip
        return value

    value, grad = jax.value_and_grad(ours)(jnp.asarray(logp))
    assert float(loss) == pytest.approx(float(value), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(log_prob.grad.numpy(), np.asarray(grad), rtol=1e-4, atol=1e-6)
    assert set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_turn_clipfrac"}


def test_the_turn_mean_loss_weighs_every_turn_alike():
    logp, old, advantages, mask = _loss_inputs(9)
    log_prob = torch.tensor(logp, requires_grad=True)
    fn = core_algos.get_policy_loss_fn("mpo_turn_mean")
    loss, _ = fn(torch.tensor(old), log_prob, torch.tensor(advantages), torch.tensor(mask),
                 loss_agg_mode="token-mean", config=_actor())  # fmt: skip
    loss.backward()
    rows = float((mask.sum(axis=1) > 0).sum())

    def ours(lp):
        value, _ = policy_loss(lp, old, advantages, mask > 0, _turn_ids(mask), ratio_level="turn",
                               clip_low=0.15, clip_high=0.25, dual_clip=3.0,
                               aggregation="turn_mean_token_mean", normalizer=rows)  # fmt: skip
        return value

    value, grad = jax.value_and_grad(ours)(jnp.asarray(logp))
    assert float(loss) == pytest.approx(float(value), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(log_prob.grad.numpy(), np.asarray(grad), rtol=1e-4, atol=1e-6)


# -- bad input -------------------------------------------------------------------------------------


def test_bad_input_names_verls_key_or_field():
    rewards, values, mask = _batch(1)
    data = _data(rewards, values, mask)
    data.batch.pop("values")
    with pytest.raises(ValueError, match=r"adv_estimator=mpo needs the critic's values.*critic"):
        ray_trainer.compute_advantage(data, adv_estimator="mpo", config=_algorithm("mpo"))
    nan = rewards.copy()
    nan[4, 2] = np.nan
    with pytest.raises(ValueError, match=r"token_level_rewards holds NaN or inf in row\(s\) \[4\]"):
        ray_trainer.compute_advantage(
            _data(nan, values, mask), adv_estimator="mpo", config=_algorithm("mpo")
        )
    with pytest.raises(ValueError, match=r"values has shape \(9, 36\), response_mask \(9, 37\)"):
        mpo_verl.mpo_advantage(
            torch.tensor(rewards), torch.tensor(mask), _algorithm("mpo"),
            values=torch.tensor(values[:, :-1]),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"algorithm.mpo: unknown key\(s\) \['bta'\]"):
        ray_trainer.compute_advantage(
            _data(rewards, values, mask), adv_estimator="mpo",
            config=OmegaConf.create({"mpo": {"bta": 0.1}}),
        )  # fmt: skip
    early = np.zeros((1, 4), np.float32)
    early[0, 0] = 1.0
    with pytest.raises(ValueError, match="a reward before the first sampled token"):
        mpo_verl.mpo_advantage(
            torch.tensor(early), torch.tensor([[0, 1, 1, 0]], dtype=torch.float32), None,
            values=torch.zeros(1, 4),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"gigpo needs data.batch\['step_keys'\]"):
        ray_trainer.compute_advantage(
            _data(rewards, values, mask), adv_estimator="gigpo", config=_algorithm("gigpo")
        )
    logp, old, advantages, mask = _loss_inputs(0)
    with pytest.raises(ValueError, match=r"loss_mode=mpo: advantages has shape"):
        core_algos.get_policy_loss_fn("mpo")(
            torch.tensor(old), torch.tensor(logp), torch.tensor(advantages[:, 1:]),
            torch.tensor(mask), config=_actor(),
        )  # fmt: skip


def test_other_estimators_still_go_to_verls_own_function():
    rewards, values, mask = _batch(2)
    ours = ray_trainer.compute_advantage(
        _data(rewards, values, mask), adv_estimator="gae", gamma=0.9, lam=0.8,
        config=OmegaConf.create({"use_pf_ppo": False}),
    )  # fmt: skip
    theirs = mpo_verl._VERL_COMPUTE_ADVANTAGE(
        _data(rewards, values, mask), adv_estimator="gae", gamma=0.9, lam=0.8,
        config=OmegaConf.create({"use_pf_ppo": False}),
    )  # fmt: skip
    assert torch.equal(ours.batch["advantages"], theirs.batch["advantages"])


def test_import_mpo_jax_imports_neither_torch_nor_verl_and_verl_loads_the_plugin():
    code = (
        "import sys, mpo_jax, mpo_jax.advantages, mpo_jax.losses; "
        "print('torch' in sys.modules, 'verl' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    code = (
        "import verl; from verl.trainer.ppo import core_algos; "
        "print('mpo' in core_algos.ADV_ESTIMATOR_REGISTRY, "
        "'mpo' in core_algos.POLICY_LOSS_REGISTRY)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["True", "True"], out.stderr[-2000:]
