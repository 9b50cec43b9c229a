"""Run in a fresh process with 8 forced host devices (see tests/test_sharding.py): one actor and
critic update sharded over a (data 2, fsdp 2, tensor 2) mesh must equal the same update on one
device, for full fine-tuning and for LoRA adapters on a frozen base. Prints MAX_DIFF and
LORA_MAX_DIFF <float> and exits 0 on success."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mpo_jax import algorithms  # noqa: E402
from mpo_jax.batch import TurnBatch  # noqa: E402
from tests.models import tiny_model_config  # noqa: E402
from train.core.learner import ActionRows, Models, UpdateFns, make_optimizer  # noqa: E402
from train.model.lora import Adapted, init_trainable  # noqa: E402
from train.model.qwen3 import Qwen3ForCausalLM, Qwen3ValueModel  # noqa: E402
from train.model.sharding import batch_sharding, make_mesh, shard_params  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
cfg = tiny_model_config(tie_word_embeddings=False)
actor = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
critic = Qwen3ValueModel.from_policy(actor, rngs=nnx.Rngs(1))
adef, aparams = nnx.split(actor)
cdef, cparams = nnx.split(critic)
algo = algorithms.get("mpo")
tx = make_optimizer(1e-2, warmup_steps=1, clip=1.0, weight_decay=0.0)
fns = UpdateFns(Models(adef, cdef), algo, tx, tx, temperature=1.0)

rng = np.random.default_rng(0)
b, t = 8, 16
mask = np.zeros((b, t), bool)
mask[:, 4:8] = True
mask[:, 10:14] = True
tid = np.where(mask, (np.arange(t) >= 10).astype(np.int32)[None].repeat(b, 0), -1).astype(np.int32)
batch = TurnBatch(
    tokens=rng.integers(0, 64, size=(b, t)).astype(np.int32),
    loss_mask=mask,
    turn_ids=tid,
    rewards=None,
    group_ids=None,
    truncated=None,
    old_logp=np.where(mask, -rng.uniform(3, 5, size=(b, t)), 0).astype(np.float32),
    advantages=np.where(mask, rng.normal(size=(b, t)), 0).astype(np.float32),
    values=np.where(mask, rng.normal(size=(b, t)), 0).astype(np.float32),
    returns=np.where(mask, rng.normal(size=(b, t)), 0).astype(np.float32),
)
batch = ActionRows.of(batch, ("old_logp", "advantages", "values", "returns"))
count = float(mask.sum())


def step(aparams, cparams, batch):
    # the update donates the parameters it is given: give it copies, the originals are reused
    (la, _), ga = fns.actor_grad(aparams, batch, count, count)
    a_copy = jax.tree.map(jnp.copy, aparams)
    a_new, _, ok_a, _ = fns.apply("actor", a_copy, fns.init("actor", aparams), ga, la)
    (lc, _), gc = fns.critic_grad(cparams, batch, count)
    c_copy = jax.tree.map(jnp.copy, cparams)
    c_new, _, ok_c, _ = fns.apply("critic", c_copy, fns.init("critic", cparams), gc, lc)
    assert bool(ok_a) and bool(ok_c)
    return a_new, c_new, la, lc


single = step(aparams, cparams, jax.tree.map(jnp.asarray, batch))
mesh = make_mesh(data=2, fsdp=2, tensor=2)
sharded_batch = jax.tree.map(lambda v: jax.device_put(v, batch_sharding(mesh)), batch)
sa, sc = shard_params(aparams, mesh), shard_params(cparams, mesh)
kernel = sa["model"]["layers"][0]["layer"]["mlp"]["gate_proj"]["kernel"].get_value()
assert len(kernel.sharding.device_set) == 8, kernel.sharding  # really spread over the mesh
sharded = step(sa, sc, sharded_batch)


def leaf_diffs(a, b) -> list[float]:
    """The largest absolute difference of each pair of leaves of two like trees."""
    return [
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]


diffs = leaf_diffs(single, sharded)
print("MAX_DIFF", max(diffs))
# Adam's first step moves a parameter by lr * g / (|g| + eps): float noise between the sharded
# and the one-device gradient shows up, for gradients near eps, as a small fraction of lr (1e-2
# here). A wrong update (wrong rows, a missing reduction) moves many parameters by about lr.
assert max(diffs) < 1e-4, max(diffs)
moved = leaf_diffs(aparams, single[0])
assert max(moved) > 1e-3, max(moved)  # the update really moved the parameters

# LoRA: the same update of adapters (actor; critic adapters and value head) on one frozen base,
# sharded by the adapters' logical names beside the sharded base, equals the one-device update.
lcfg = dataclasses.replace(cfg, lora_rank=4, lora_alpha=8)
lora_def = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(lcfg, rngs=nnx.Rngs(0))))
lora_cdef = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ValueModel(lcfg, rngs=nnx.Rngs(0))))
lora_fns = UpdateFns(Models(lora_def, lora_cdef), algo, tx, tx, temperature=1.0)


def drawn(adapters, seed):
    """B and a critic's value head drawn (fresh, both are zero, which leaves A, and a critic's
    adapters, without a gradient)."""
    flat = []
    for i, (path, var) in enumerate(nnx.to_flat_state(adapters)):
        if path[-1] == "lora_b" or "value_head" in path:
            key = jax.random.key(seed * 1000 + i)
            var = var.replace(0.1 * jax.random.normal(key, var.get_value().shape))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def lora_step(base, a_ad, c_ad, batch):
    actor = Adapted(base, a_ad)
    critic = Adapted(nnx.State({"model": base["model"]}), c_ad)
    (la, _), ga = lora_fns.actor_grad(actor, batch, count, count)
    a_new, _, ok_a, _ = lora_fns.apply(
        "actor", jax.tree.map(jnp.copy, a_ad), lora_fns.init("actor", a_ad), ga, la
    )
    (lc, _), gc = lora_fns.critic_grad(critic, batch, count)
    c_new, _, ok_c, _ = lora_fns.apply(
        "critic", jax.tree.map(jnp.copy, c_ad), lora_fns.init("critic", c_ad), gc, lc
    )
    assert bool(ok_a) and bool(ok_c)
    return a_new, c_new, la, lc


a_ad = drawn(init_trainable(Qwen3ForCausalLM, lcfg, 0), 0)
c_ad = drawn(init_trainable(Qwen3ValueModel, lcfg, 1), 1)
lora_single = lora_step(aparams, a_ad, c_ad, jax.tree.map(jnp.asarray, batch))
s_ad, s_cad = shard_params(a_ad, mesh), shard_params(c_ad, mesh)
lora_a = s_ad["model"]["layers"][0]["layer"]["mlp"]["gate_proj"]["lora"]["lora_a"].get_value()
assert len(lora_a.sharding.device_set) == 8, lora_a.sharding
lora_sharded = lora_step(sa, s_ad, s_cad, sharded_batch)
lora_diffs = leaf_diffs(lora_single, lora_sharded)
print("LORA_MAX_DIFF", max(lora_diffs))
assert max(lora_diffs) < 1e-4, max(lora_diffs)
lora_moved = leaf_diffs((a_ad, c_ad), lora_single[:2])
assert min(lora_moved) > 1e-3, lora_moved  # every adapter matrix and the value head moved
print("LORA_EQUAL")

# The trainer end to end on the same mesh: two steps of the default preset.
import tempfile  # noqa: E402

from train import run  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    code = run.main(
        [
            "--mesh",
            "2,2,2",
            "--steps",
            "2",
            "--layers",
            "1",
            "--width",
            "32",
            "--heads",
            "2",
            "--kv-heads",
            "2",
            "--prompts-per-step",
            "4",
            "--group-size",
            "2",
            "--max-len",
            "32",
            "--eval-every",
            "0",
            "--no-progress",
            "--run-dir",
            tmp,
        ]
    )
    assert code == 0
    print("TRAINER_OK")

# LoRA on the same mesh: adapters placed by their logical names beside the frozen, sharded base;
# two steps of mpo (actor and critic adapters, the value head), checkpointed and resumed.
with tempfile.TemporaryDirectory() as tmp:
    lora_flags = [
        "--mesh", "2,2,2", "--layers", "1", "--width", "32", "--heads", "2", "--kv-heads", "2",
        "--prompts-per-step", "4", "--group-size", "2", "--max-len", "32", "--eval-every", "0",
        "--no-progress", "--lora-rank", "4", "--run-dir", tmp, "--checkpoint-every", "1",
    ]  # fmt: skip
    assert run.main([*lora_flags, "--steps", "1"]) == 0
    assert run.main(["--resume", "--run-dir", tmp, "--steps", "2"]) == 0
    from train.core.metrics import read_metrics  # noqa: E402

    rows = read_metrics(tmp)
    assert [r["step"] for r in rows] == [1, 2] and abs(rows[0]["ref_kl"]) < 1e-6, rows[0]
    print("LORA_OK")
