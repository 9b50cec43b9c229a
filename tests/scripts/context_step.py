"""Run in a fresh process with 8 forced host devices (see tests/test_context.py): with each row's
tokens split over the mesh's ``context`` axis (2, 4 and 8 ways, alone and beside fsdp, tensor
and data), the actor's and critic's losses and gradients, the per-token log-probs and values,
packed rows and TRACE's answer scores equal the one-device ones; rows whose length does not
divide by the axis, turns crossing the shards' boundaries, grouped KV heads, a MoE model and
remat on. Then two steps of ``train.run`` (mpo, LoRA) on a context mesh. Prints CONTEXT_OK.

``--quick`` (the fast suite): the dense model on fsdp 2 x context 4, the MoE model on fsdp 2 x
tensor 2 x context 2, the trainer run. Without: every mesh for both models (the slow suite)."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mpo_jax import algorithms  # noqa: E402
from mpo_jax.batch import TurnBatch  # noqa: E402
from tests.models import tiny_model_config  # noqa: E402
from train.core.learner import (  # noqa: E402
    ActionRows,
    Models,
    UpdateFns,
    answer_logprobs,
    make_optimizer,
    token_logprobs,
    values_and_bootstrap,
)
from train.model.qwen3 import Qwen3ForCausalLM, Qwen3ValueModel  # noqa: E402
from train.model.sharding import MeshShape, shard_params  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
TOL = 2e-5  # float32: a sum in another order, nothing more

QUICK = "--quick" in sys.argv
MESHES = [  # data -1: what the others leave of the 8 devices
    MeshShape(context=2),
    MeshShape(context=4),
    MeshShape(context=8),
    MeshShape(fsdp=2, context=4),
    MeshShape(fsdp=2, tensor=2, context=2),
]
DENSE_MESHES = MESHES[3:4] if QUICK else MESHES
MOE_MESHES = MESHES[4:] if QUICK else MESHES


def batch_of(b: int, t: int, seed: int) -> tuple[ActionRows, float]:
    """Rows of ``t`` tokens (not a multiple of 2C for C >= 2), three turns of 6-7 action tokens
    each, the second starting mid-row: with C = 4 (chunks of 4 tokens) each turn crosses a
    shard boundary."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, t), bool)
    tid = np.full((b, t), -1, np.int32)
    for turn, (lo, hi) in enumerate([(3, 9), (13, 20), (23, t)]):
        mask[:, lo:hi] = True
        tid[:, lo:hi] = turn
    mask[-1, 13:] = False  # a row that ends early
    tid[-1, 13:] = -1
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
    rows = ActionRows.of(batch, ("old_logp", "advantages", "values", "returns"))
    return jax.tree.map(jnp.asarray, rows), float(mask.sum())


def figures(fns, aparams, cparams, rows, count):
    """Everything a training step computes from the models, as a flat list of arrays."""
    (la, _), ga = fns.actor_grad(aparams, rows, count, count)
    (lc, _), gc = fns.critic_grad(cparams, rows, count)
    adef, cdef = fns.models.actor, fns.models.critic
    logp, entropy = jax.jit(token_logprobs, static_argnums=0)(
        adef, aparams, rows.tokens, rows.positions
    )
    lengths = jnp.sum(rows.tokens >= 0, axis=1).astype(jnp.int32) - 2
    values, boot = jax.jit(values_and_bootstrap, static_argnums=0)(
        cdef, cparams, rows.tokens, rows.positions, lengths
    )
    n = rows.tokens.shape[0]
    answer = jnp.tile(jnp.arange(1, 4, dtype=jnp.int32), (n, 1))
    scores = jax.jit(answer_logprobs, static_argnums=0)(
        adef, aparams, rows.tokens, jnp.array([5, 11, 17, 23][:n] * (n // 4 or 1))[:n],
        answer, jnp.full((n,), 3, jnp.int32),
    )  # fmt: skip
    starts = jnp.where(jnp.arange(rows.tokens.shape[1]) >= 12, 12, 0)[None].repeat(n, 0)
    packed = jax.jit(lambda p, x, s: nnx.merge(adef, p).model(x, segment_starts=s))(
        aparams, rows.tokens, starts
    )
    named = {"actor_loss": la, "critic_loss": lc, "logp": logp, "entropy": entropy}
    named |= {"values": values, "bootstrap": boot, "answer_scores": scores, "packed": packed}
    named |= {f"actor_grad{i}": g for i, g in enumerate(jax.tree.leaves(ga))}
    named |= {f"critic_grad{i}": g for i, g in enumerate(jax.tree.leaves(gc))}
    return {k: np.asarray(v) for k, v in named.items()}


def check(name: str, cfg, meshes, b: int = 4, t: int = 29) -> None:
    actor = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    critic = Qwen3ValueModel.from_policy(actor, rngs=nnx.Rngs(1))
    adef, aparams = nnx.split(actor)
    cdef, cparams = nnx.split(critic)
    tx = make_optimizer(1e-2, warmup_steps=1, clip=1.0, weight_decay=0.0)
    fns = UpdateFns(Models(adef, cdef), algorithms.get("mpo"), tx, tx, temperature=1.0)
    rows, count = batch_of(b, t, seed=len(name))
    single = figures(fns, aparams, cparams, rows, count)
    for shape in meshes:
        mesh = shape.make()
        with jax.set_mesh(mesh):
            sa, sc = shard_params(aparams, mesh), shard_params(cparams, mesh)
            split = figures(fns, sa, sc, rows, count)
            # the row really is split: each layer gathers its keys and values over the axis
            hlo = (
                jax.jit(token_logprobs, static_argnums=0)
                .lower(adef, sa, rows.tokens, rows.positions)
                .compile()
                .as_text()
            )
            assert "all-gather" in hlo, "no all-gather: the tokens were not split"
        worst = max((float(np.max(np.abs(single[k] - split[k]), initial=0)), k) for k in single)
        print(f"{name} {dict(shape._asdict())}: max |difference| {worst[0]:.2e} ({worst[1]})")
        assert worst[0] < TOL, (name, shape, worst)
    moved = max(float(np.abs(single[k]).max()) for k in single if "grad" in k)
    assert moved > 1e-4, moved  # the gradients are not all zero (a comparison of something)


def check_kernel(ways: int = 4, t: int = 64, block: int = 8) -> None:
    """The chunked kernel (several blocks of queries and keys, invisible ones skipped) on zigzag
    rows split over ``ways`` devices: outputs and the gradients of q, k, v equal the one-device
    kernel's, with padding keys and packed sequences."""
    from kernels.attention import attention
    from train.model.context import context_attention, from_zigzag, to_zigzag

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, t, h, 8)), jnp.float32) for h in (4, 2, 2))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    valid = pos < jnp.array([[t], [t - 11]])
    lower = jnp.where(pos >= 21, 21, 0).astype(jnp.int32)
    blocks = dict(block_q=block, block_k=block)

    def one(q, k, v):
        return attention(q, k, v, pos, pos, valid, lower, implementation="chunked", **blocks)

    def split(q, k, v):
        z = [to_zigzag(x, ways) for x in (q, k, v, pos, pos, valid, lower)]
        out = context_attention(*z, implementation="chunked", **blocks)
        return from_zigzag(out, ways)

    weights = jnp.asarray(rng.normal(size=(2, t, 4, 8)), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * weights)  # noqa: E731
    expected = (one(q, k, v), *jax.grad(loss(one), argnums=(0, 1, 2))(q, k, v))
    with jax.set_mesh(MeshShape(context=ways).make()):
        got = jax.jit(lambda *a: (split(*a), *jax.grad(loss(split), argnums=(0, 1, 2))(*a)))(
            q, k, v
        )
    worst = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(expected, got, strict=True))
    print(f"chunked kernel over context {ways}: max |difference| {worst:.2e}")
    assert worst < TOL, worst


check_kernel()
dense = tiny_model_config(remat="full", attention="chunked")
check("dense, grouped KV heads, chunked kernel, remat full", dense, DENSE_MESHES)
moe = tiny_model_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
check("MoE, remat none", moe, MOE_MESHES)

# The trainer end to end on a context mesh: two steps of mpo (actor and critic) with LoRA.
import tempfile  # noqa: E402

from train import run  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    flags = [
        "--mesh", "1,2,1,4", "--steps", "2", "--layers", "1", "--width", "32", "--heads", "4",
        "--kv-heads", "2", "--prompts-per-step", "4", "--group-size", "2", "--max-len", "48",
        "--eval-every", "0", "--no-progress", "--run-dir", tmp, "--remat", "full",
        "--lora-rank", "4",
    ]  # fmt: skip
    code = run.main(flags)
    assert code == 0, code
print("CONTEXT_OK")
sys.stdout.flush()
