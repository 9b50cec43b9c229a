"""Qwen3 in flax.nnx against transformers' PyTorch models, weights in and out, bad checkpoints."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests.models import SMALL, TINY_QWEN3, randomise
from train.model.qwen3 import ModelConfig, Qwen3ForCausalLM, Qwen3ValueModel
from train.model.weights import CheckpointError, load_pretrained, save_pretrained

IDS = np.random.default_rng(0).integers(0, 96, size=(2, 13))


CHECKPOINTS = {
    "qwen3_dense_tied": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        TINY_QWEN3,
    ),
    "qwen3_dense_untied_odd_head_dim": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(
            SMALL,
            num_hidden_layers=2,
            head_dim=12,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6},
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            SMALL,
            num_hidden_layers=3,
            head_dim=8,
            moe_intermediate_size=16,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe_norm_topk": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            SMALL,
            num_hidden_layers=2,
            head_dim=8,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
    ),
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(SMALL, num_hidden_layers=2, tie_word_embeddings=True),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(SMALL, num_hidden_layers=2, tie_word_embeddings=False),
    ),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    config_cls, model_cls, kwargs = CHECKPOINTS[request.param]
    torch_model = randomise(model_cls(config_cls(**kwargs)))
    path = tmp_path_factory.mktemp(request.param)
    torch_model.save_pretrained(path)
    with torch.no_grad():
        logits = torch_model(torch.tensor(IDS)).logits.numpy()
    return request.param, path, logits


def test_logits_match_transformers(checkpoint):
    _, path, expected = checkpoint
    model = load_pretrained(path)
    logits = jax.jit(lambda m, ids: m(ids))(model, jnp.asarray(IDS, jnp.int32))
    assert logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, atol=2e-4)


def test_round_trip_through_transformers(checkpoint, tmp_path):
    name, path, expected = checkpoint
    save_pretrained(load_pretrained(path), tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        logits = back(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=2e-4)
    ours = load_pretrained(tmp_path)
    np.testing.assert_allclose(ours(jnp.asarray(IDS, jnp.int32)), expected, atol=2e-4)


def test_bfloat16_parameters_stay_close(checkpoint):
    _, path, expected = checkpoint
    model = load_pretrained(path, param_dtype=jnp.bfloat16, dtype=jnp.float32)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    logits = model(jnp.asarray(IDS, jnp.int32))
    scale = np.abs(expected).max()
    assert np.abs(np.asarray(logits) - expected).max() < 0.05 * scale


def test_bfloat16_checkpoints_load(tmp_path):
    config_cls, model_cls, kwargs = CHECKPOINTS["qwen3_dense_tied"]
    torch_model = randomise(model_cls(config_cls(**kwargs))).to(torch.bfloat16)
    torch_model.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    emb = np.asarray(model.model.embed_tokens.embedding[...])
    ref = torch_model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(emb, ref)


def test_value_model_starts_from_the_policy(checkpoint):
    _, path, _ = checkpoint
    policy = load_pretrained(path)
    critic = Qwen3ValueModel.from_policy(policy, rngs=nnx.Rngs(1))
    ids = jnp.asarray(IDS, jnp.int32)
    np.testing.assert_allclose(critic.model(ids), policy.model(ids), atol=1e-6)
    values = critic(ids)
    assert values.shape == IDS.shape
    np.testing.assert_allclose(values, 0.0)  # a zero-initialised head
    _, hidden = policy(ids, return_hidden=True)
    assert hidden.shape == (*IDS.shape, policy.cfg.hidden_size)
    # The copy is a copy: training the critic leaves the policy alone.
    critic.model.norm.weight[...] = critic.model.norm.weight[...] * 2
    assert not np.allclose(critic.model.norm.weight[...], policy.model.norm.weight[...])


def _two_layer_model():
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": 50,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "rope_theta": 1e4,
        }
    )
    return Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))


def test_padding_and_positions():
    # A left-padded row with shifted positions equals the unpadded row.
    model = _two_layer_model()
    ids = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    plain = model(ids)
    padded_ids = jnp.asarray([[0, 0, 5, 6, 7, 8]], jnp.int32)
    positions = jnp.asarray([[0, 0, 0, 1, 2, 3]], jnp.int32)
    valid = jnp.asarray([[False, False, True, True, True, True]])
    padded = model(padded_ids, positions, valid)
    np.testing.assert_allclose(padded[:, 2:], plain, atol=1e-5)


def test_packed_rows_equal_the_sequences_apart():
    # Two sequences packed in one row (segment starts): each one's logits equal its own row's.
    model = _two_layer_model()
    a, b = [5, 6, 7], [9, 8, 7, 6]
    packed = model.model(
        jnp.asarray([a + b], jnp.int32), segment_starts=jnp.asarray([[0, 0, 0, 3, 3, 3, 3]])
    )
    np.testing.assert_allclose(packed[:, :3], model.model(jnp.asarray([a])), atol=1e-5)
    np.testing.assert_allclose(packed[:, 3:], model.model(jnp.asarray([b])), atol=1e-5)


def test_every_parameter_has_logical_axis_names():
    cfg = ModelConfig.from_hf(
        json.loads(
            json.dumps(
                {
                    "architectures": ["Qwen3MoeForCausalLM"],
                    "vocab_size": 50,
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "moe_intermediate_size": 8,
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 8,
                    "rope_theta": 1e4,
                    "mlp_only_layers": [1],
                }
            )
        )
    )
    model = nnx.eval_shape(lambda: Qwen3ValueModel(cfg, rngs=nnx.Rngs(0)))
    names = set()
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        sharding = var.get_metadata().get("out_sharding")
        assert sharding is not None and len(sharding) == len(var.get_value().shape), path
        names.update(n for n in sharding if n)
    assert {"vocab", "embed", "heads", "kv_heads", "mlp", "expert"} <= names


# ------------------------------------------------------------------------------------------------
# Bad checkpoints
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def dense(tmp_path):
    config_cls, model_cls, kwargs = CHECKPOINTS["qwen3_dense_untied_odd_head_dim"]
    randomise(model_cls(config_cls(**kwargs))).save_pretrained(tmp_path)
    return tmp_path


def rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_is_named(dense):
    rewrite(dense, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"model.layers.1.self_attn.k_norm.weight: missing"):
        load_pretrained(dense)


def test_wrong_shape_is_named(dense):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    rewrite(dense, edit)
    with pytest.raises(
        CheckpointError,
        match=r"model.layers.0.mlp.up_proj.weight: shape \[63, 32\]"
        r" disagrees with config.json \(expected \[64, 32\]\)",
    ):
        load_pretrained(dense)


def test_unexpected_tensor_is_named(dense):
    rewrite(dense, lambda t: t.update({"model.layers.5.mlp.up_proj.weight": np.zeros((2, 2))}))
    with pytest.raises(CheckpointError, match=r"model.layers.5.mlp.up_proj.weight: unexpected"):
        load_pretrained(dense)

    def swap(t):
        t.pop("model.layers.5.mlp.up_proj.weight")
        t["model.visual.patch.weight"] = np.zeros((2, 2))

    rewrite(dense, swap)
    with pytest.raises(CheckpointError, match=r"model.visual.patch.weight: unexpected"):
        load_pretrained(dense)


def test_unknown_architecture_and_rope_are_named(dense):
    cfg = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\] is not supported"):
        load_pretrained(dense)
    yarn = {**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}
    (dense / "config.json").write_text(json.dumps(yarn))
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        load_pretrained(dense)


def test_gradients_flow_through_dense_and_moe_blocks(checkpoint):
    name, path, _ = checkpoint
    model = load_pretrained(path)
    ids = jnp.asarray(IDS, jnp.int32)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        logp = jax.nn.log_softmax(m(ids)[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grads = jax.jit(jax.grad(loss))(params)
    flat = nnx.to_flat_state(grads)
    for path_, g in flat:
        value = np.asarray(g.get_value())
        assert np.all(np.isfinite(value)), path_
    # every projection, experts included, receives gradient
    touched = [p for p, g in flat if np.abs(np.asarray(g.get_value())).max() > 0]
    assert len(touched) == len(flat), sorted(set(map(str, flat)) - set(map(str, touched)))[:3]


def test_the_balanced_expert_matmul_equals_ragged_dot_when_experts_share_tokens_evenly():
    # train.plan's stand-in for ragged_dot: exact (values and gradients) under balanced routing,
    # wrong under skewed routing (it is a plan's shape, never a trainer's), unknown names refused.
    from train.model.qwen3 import grouped_matmul

    e, d, f = 8, 16, 12
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(e * 5, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(e, d, f)), jnp.float32)
    even = jnp.full((e,), 5, jnp.int32)

    def loss(x, w, sizes, how):
        return jnp.sum(jnp.tanh(grouped_matmul(x, w, sizes, how)))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=3)
    (v_r, g_r), (v_b, g_b) = grad(x, w, even, "ragged"), grad(x, w, even, "balanced")
    np.testing.assert_allclose(v_b, v_r, rtol=1e-5)
    for a, b in zip(g_b, g_r, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    skewed = even.at[0].add(3).at[1].add(-3)
    assert not np.allclose(
        grouped_matmul(x, w, skewed, "balanced"), grouped_matmul(x, w, skewed, "ragged")
    )
    with pytest.raises(ValueError, match="moe_matmul must be one of"):
        grouped_matmul(x, w, even, "dense")


def test_the_cpu_compiler_expands_ragged_dot_through_every_expert():
    # Why train.plan uses the stand-in on a CPU: XLA's CPU lowering of ragged_dot holds a
    # temporary per expert, the grouped matmul does not. Fails (and the stand-in can go) the day
    # the CPU compiler lowers ragged_dot as a grouped matmul.
    from train.model.qwen3 import grouped_matmul

    e, n, d, f = 64, 1024, 64, 64
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)
    x, w = jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((e, d, f), jnp.float32)

    def temp(how):
        fn = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, how))
        return fn.lower(x, w, sizes).compile().memory_analysis().temp_size_in_bytes

    output = n * f * 4
    assert temp("balanced") <= 2 * output
    assert temp("ragged") >= 8 * output, (temp("ragged"), output)


# ------------------------------------------------------------------------------------------------
# The file shapes of official releases
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True], ids=["dense-tied-with-head", "moe-untied"])
def test_official_checkpoint_file_shapes_load(tmp_path, moe):
    # bfloat16 on disk, two shards and an index, and (tied) lm_head.weight beside the embedding.
    from tests.models import save_official_qwen3

    torch_model = save_official_qwen3(tmp_path, moe=moe, vocab_size=96)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    if not moe:
        assert "lm_head.weight" in index["weight_map"]
    notes = []
    model = load_pretrained(tmp_path, log=notes.append)
    with torch.no_grad():
        expected = torch_model(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(model(jnp.asarray(IDS, jnp.int32)), expected, atol=2e-4)
    if not moe:
        assert notes == [
            "lm_head.weight equals model.embed_tokens.weight within bfloat16 rounding "
            "(tie_word_embeddings: true): the embedding is used"
        ]


def test_a_tied_head_that_is_not_the_embedding_is_refused(tmp_path):
    from safetensors.torch import load_file
    from safetensors.torch import save_file as save_torch

    from tests.models import save_official_qwen3

    save_official_qwen3(tmp_path, vocab_size=96)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = tmp_path / index["weight_map"]["lm_head.weight"]
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 1.05  # beyond bfloat16 rounding
    save_torch(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lm_head.weight: differs from model.embed_tokens"):
        load_pretrained(tmp_path)
    # an index that names a shard that is not there is named too
    (tmp_path / index["weight_map"]["lm_head.weight"]).unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: names model-"):
        load_pretrained(tmp_path)


def test_exported_bfloat16_and_sharded_weights_load_back(checkpoint, tmp_path):
    # save_pretrained's own writer: bfloat16, and shards with an index past shard_bytes
    _, path, expected = checkpoint
    model = load_pretrained(path)
    save_pretrained(model, tmp_path / "bf16", dtype=jnp.bfloat16, shard_bytes=20_000)
    assert (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    assert back.dtype == torch.bfloat16
    ours = load_pretrained(tmp_path / "bf16")
    with torch.no_grad():
        theirs = back.float()(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(ours(jnp.asarray(IDS, jnp.int32)), theirs, atol=2e-4)
    scale = np.abs(expected).max()
    assert np.abs(theirs - expected).max() < 0.05 * scale  # bfloat16 rounding only
