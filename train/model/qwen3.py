"""Qwen3 (dense and MoE) in flax.nnx, with the close relatives that cost a flag: Llama, Qwen2.

The whole architecture in one file: RMSNorm, grouped-query attention with an explicit ``head_dim``
and per-head q/k RMSNorm before RoPE (θ from the checkpoint's config), a SwiGLU MLP or a sparse
MoE block (softmax router, top-k, ``norm_topk_prob`` as configured, experts through
``jax.lax.ragged_dot`` on expert-sorted tokens: no Python loop over experts), tied or untied LM
head, and a scalar value head for the critic.

Every parameter carries logical axis names (``vocab``, ``embed``, ``heads``, ``kv_heads``,
``mlp``, ``expert``) as nnx sharding metadata, so sharding is a table of rules, not code
(``nnx.get_partition_spec`` under ``flax.core.spmd`` logical axis rules).

    model = Qwen3ForCausalLM(config, rngs=nnx.Rngs(0))
    logits = model(input_ids)                                  # [B, T, vocab]
    logits, hidden = model(input_ids, return_hidden=True)      # hidden: final normed [B, T, D]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.attention import attention
from train.model.context import (
    constrain_tokens,
    context_attention,
    context_ways,
    from_zigzag,
    padded_length,
    to_zigzag,
)
from train.model.lora import LORA_TARGETS, AdaptedLinear, lora_scale
from train.model.sharding import BATCH_AXES, DECODE_AXES, row_axes

__all__ = [
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "Qwen3Model",
    "Qwen3ForCausalLM",
    "Qwen3ValueModel",
    "KVCache",
    "REMAT_POLICIES",
    "DecoderStack",
    "MOE_MATMULS",
    "grouped_matmul",
]

# architecture name -> (model_type, qk_norm, qkv_bias)
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": ("qwen3", True, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", True, False),
    "Qwen2ForCausalLM": ("qwen2", False, True),
    "LlamaForCausalLM": ("llama", False, False),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture, read from a Hugging Face ``config.json`` (`from_hf`).

    ``dtype`` is the activations' dtype, ``param_dtype`` the parameters'.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    architecture: str = "Qwen3ForCausalLM"
    qk_norm: bool = True  # Qwen3: RMSNorm on each head's q and k before RoPE
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    attention_bias: bool = False  # Qwen3/Llama `attention_bias`: biases on q/k/v/o
    # Mixture of experts (Qwen3-MoE); num_experts = 0 is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: Any = jnp.float32  # compute: activations, matmul inputs, the KV cache
    param_dtype: Any = jnp.float32
    remat: str = "none"  # what each decoder layer keeps for the backward pass (REMAT_POLICIES)
    attention: str | None = None  # kernels.attention implementation (None: by platform)
    # How MoE experts multiply their tokens (MOE_MATMULS): "ragged" always, except in train.plan
    # on a CPU, which uses the "balanced" stand-in (see grouped_matmul).
    moe_matmul: str = "ragged"
    # False: one DecoderStack a layer instead of one a run of layers (see unstacked)
    stack_layers: bool = True
    # LoRA (train/model/lora.py): rank 0 is no adapter; alpha 0 means alpha = rank (scale 1)
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def layer_segments(self) -> list[tuple[int, int]]:
        """(first layer, count) of each run of consecutive layers of one kind (dense or MoE):
        the model's `DecoderStack` s (one a layer without ``stack_layers``)."""
        if not self.stack_layers:
            return [(layer, 1) for layer in range(self.num_layers)]
        out: list[tuple[int, int]] = []
        for layer in range(self.num_layers):
            if out and self.is_moe_layer(layer) == self.is_moe_layer(out[-1][0]):
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((layer, 1))
        return out

    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> ModelConfig:
        """Reads every hyperparameter from the checkpoint's own ``config.json`` dict."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json: architectures={archs!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        _, qk_norm, qkv_bias = SUPPORTED_ARCHITECTURES[arch]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"config.json: rope_type {rope_type!r} is not supported (only 'default' RoPE)"
            )
        theta = rope.get("rope_theta", hf.get("rope_theta"))
        if theta is None:
            raise ValueError("config.json: no rope_theta (in rope_parameters or at the top level)")
        heads = hf["num_attention_heads"]
        num_experts = hf.get("num_experts", hf.get("num_local_experts", 0)) or 0
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            architecture=arch,
            qk_norm=qk_norm,
            qkv_bias=qkv_bias,
            attention_bias=bool(hf.get("attention_bias", False)),
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        if fields["num_heads"] % fields["num_kv_heads"]:
            raise ValueError(
                f"config.json: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={fields['num_kv_heads']}"
            )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict:
        """A ``config.json`` dict that transformers reads back into the same architecture."""
        model_type = SUPPORTED_ARCHITECTURES[self.architecture][0]
        out = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": jnp.dtype(self.param_dtype).name,
        }
        if self.num_experts:
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return out


_LECUN = nnx.initializers.lecun_normal()


def _init(names: tuple[str | None, ...], base=_LECUN):
    """``base`` carrying logical axis names (metadata only: placement is the trainer's job)."""
    return nnx.with_partitioning(base, names, eager_sharding=False)


def _linear(cfg: ModelConfig, d_in, d_out, names, *, bias=False, rngs, name=None) -> nnx.Linear:
    """A projection; the one named ``name`` carries a LoRA adapter when ``cfg`` targets it."""
    kwargs = dict(
        use_bias=bias,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=_init(names),
        bias_init=_init((names[-1],), nnx.initializers.zeros_init()),
        rngs=rngs,
    )
    if cfg.lora_rank and name in cfg.lora_targets:
        scale = lora_scale(cfg.lora_rank, cfg.lora_alpha)
        return AdaptedLinear(d_in, d_out, rank=cfg.lora_rank, scale=scale, names=names, **kwargs)
    return nnx.Linear(d_in, d_out, **kwargs)


class RMSNorm(nnx.Module):
    """``y = w · x / sqrt(mean(x²) + ε)``, normalised in float32, as Hugging Face does."""

    def __init__(self, dim: int, cfg: ModelConfig, names=("embed",)):
        self.eps = cfg.rms_norm_eps
        self.weight = nnx.Param(
            jnp.ones((dim,), cfg.param_dtype), out_sharding=names, eager_sharding=False
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split layout (Hugging Face's ``rotate_half``). x: [B, T, H, D]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


class KVCache(NamedTuple):
    """Keys and values of every layer: [layers, B, capacity, kv_heads, head_dim] each, in the
    compute dtype.

    Row b holds its tokens at slots 0 .. length_b - 1 (positions equal slots)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, capacity: int) -> KVCache:
        shape = (cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))

    @staticmethod
    def nbytes(cfg: ModelConfig, batch: int, capacity: int) -> int:
        """Bytes of one cache of this shape (keys and values)."""
        per = cfg.num_layers * batch * capacity * cfg.num_kv_heads * cfg.head_dim
        return 2 * per * jnp.dtype(cfg.dtype).itemsize


def constrain_rows(x: jax.Array, axes: tuple[str, ...] = BATCH_AXES) -> jax.Array:
    """``x`` with its rows (leading axis) split over the mesh ``axes`` (default: the
    data-parallel ones) as `train.model.sharding.row_axes` chooses, when a mesh is set
    (``jax.set_mesh``); unchanged otherwise. Placed on the residual stream, it makes XLA gather
    an fsdp-sharded weight for a matmul rather than gather the batch (and compute every row on
    every device)."""
    mesh = jax.sharding.get_abstract_mesh()
    split = None if mesh.empty else row_axes(mesh, x.shape[0], axes)
    return x if split is None else jax.lax.with_sharding_constraint(x, jax.P(split))


def constrain_stream(x: jax.Array) -> jax.Array:
    """The residual stream's sharding in a full-sequence forward: rows and tokens
    (`train.model.context.constrain_tokens`) where the mesh splits a row over ``context`` and
    its length divides, else rows alone (`constrain_rows`)."""
    ways = context_ways()
    if ways > 1 and x.shape[1] % ways == 0:
        return constrain_tokens(x)
    return constrain_rows(x)


def _write_rows(
    cache: jax.Array, new: jax.Array, offsets: jax.Array, layer, rows: jax.Array | None = None
) -> jax.Array:
    """Writes new [B, L, ...] into entry ``layer`` of cache [layers, R, S, ...] at slots
    offsets[b] + 0..L-1 of cache row ``rows[b]`` (default: row b); slots past the end are dropped
    (so a cache needs no room for a padded write past its end). Only those slots are written (a
    scatter into the stack), never a whole layer's cache sliced out and back."""
    b, length = new.shape[:2]
    rows = (jnp.arange(b) if rows is None else rows)[:, None]
    slots = offsets[:, None] + jnp.arange(length)[None]
    return cache.at[layer, rows, slots].set(new.astype(cache.dtype), mode="drop")


class Attention(nnx.Module):
    """Grouped-query attention; optional q/k RMSNorm before RoPE; `kernels.attention`
    (blockwise online softmax, float32 scores: no [T, T] matrix per head is kept)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        qkv_bias = cfg.qkv_bias or cfg.attention_bias
        kv, heads = cfg.num_kv_heads * hd, cfg.num_heads * hd
        self.q_proj = _linear(
            cfg, d, heads, ("embed", "heads"), bias=qkv_bias, rngs=rngs, name="q_proj"
        )
        self.k_proj = _linear(
            cfg, d, kv, ("embed", "kv_heads"), bias=qkv_bias, rngs=rngs, name="k_proj"
        )
        self.v_proj = _linear(
            cfg, d, kv, ("embed", "kv_heads"), bias=qkv_bias, rngs=rngs, name="v_proj"
        )
        o_bias = cfg.attention_bias
        self.o_proj = _linear(
            cfg, heads, d, ("heads", "embed"), bias=o_bias, rngs=rngs, name="o_proj"
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg, names=(None,))
            self.k_norm = RMSNorm(hd, cfg, names=(None,))

    def project_kv(self, x, positions):
        """Keys (after norm and RoPE) and values of x: each [B, T, kv_heads, head_dim]."""
        cfg = self.cfg
        b, t, _ = x.shape
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            k = self.k_norm(k)
        return rope(k, positions, cfg.rope_theta), v

    def __call__(self, x, positions, *, causal=None, kv=None):
        """x: [B, T, D] at ``positions`` [B, T]. ``causal`` = (q_positions, k_positions,
        k_valid) for the kernel, or None for a full causal sequence (0..T-1, every key valid).
        ``kv`` replaces this call's own keys and values (a KV cache that already holds them)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = self.q_norm(q)
        q = rope(q, positions, cfg.rope_theta)
        k, v = self.project_kv(x, positions) if kv is None else kv
        if kv is None and context_ways() > 1:  # a row split over the context axis
            out = context_attention(q, k, v, *causal, implementation=cfg.attention)
        else:
            out = attention(q, k, v, *(causal or ()), implementation=cfg.attention)
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, d, f, ("embed", "mlp"), rngs=rngs, name="gate_proj")
        self.up_proj = _linear(cfg, d, f, ("embed", "mlp"), rngs=rngs, name="up_proj")
        self.down_proj = _linear(cfg, f, d, ("mlp", "embed"), rngs=rngs, name="down_proj")

    def __call__(self, x):
        # On rows flattened to [B·T, D]: for [B, T, D] inputs XLA's CPU backend wrote the gate's
        # gradient out transposed for the weight gradients (two [F, B·T] copies a layer), for
        # 2-D rows it does not: SmolLM2-135M's forward+backward at 2 x 512 tokens 8.5 -> 6.9 s.
        rows = x.reshape(-1, x.shape[-1])
        out = self.down_proj(jax.nn.silu(self.gate_proj(rows)) * self.up_proj(rows))
        return out.reshape(x.shape)


MOE_MATMULS = ("ragged", "balanced")


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, how: str = "ragged") -> jax.Array:
    """Expert-sorted tokens x [N, D] times their expert's weights w [E, D, F] -> [N, F].

    ``"ragged"``: ``jax.lax.ragged_dot`` (rows ``sizes[0]`` first to expert 0, the next
    ``sizes[1]`` to expert 1, ...): exact. ``"balanced"``: a memory-plan stand-in, never for
    training. It assumes every expert receives N/E rows (padded to ceil(N/E)) and multiplies
    [E, ceil(N/E), D] by [E, D, F] as one batched matmul: the FLOPs and bytes of a grouped matmul
    under balanced routing, right only when ``sizes`` are all equal. It exists because XLA's CPU
    compiler lowers ``ragged_dot`` densely (every token through every expert: E times the
    temporaries), which TPU compilers and cuDNN's grouped matmul on NVIDIA GPUs do not, so a plan
    compiled on the CPU would size a 128-expert model as if it ran all 128 experts.
    """
    if how == "ragged":
        return jax.lax.ragged_dot(x, w, sizes)
    if how != "balanced":
        raise ValueError(f"moe_matmul must be one of {MOE_MATMULS}, got {how!r}")
    n, e = x.shape[0], w.shape[0]
    per_expert = -(-n // e)
    xg = jnp.pad(x, ((0, e * per_expert - n), (0, 0))).reshape(e, per_expert, x.shape[1])
    out = jnp.einsum("ecd,edf->ecf", xg, w)
    return out.reshape(e * per_expert, w.shape[2])[:n]


class MoE(nnx.Module):
    """Qwen3-MoE sparse block: softmax router (float32), top-k experts, SwiGLU experts.

    Tokens are sorted by expert and multiplied with ``jax.lax.ragged_dot`` (one grouped matmul per
    projection), so compute scales with k, not with the number of experts.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1)
        self.router = _linear(cfg, d, e, ("embed", "expert"), rngs=rngs)
        self.gate_proj = nnx.Param(
            _init(("expert", "embed", "mlp"), init)(rngs.params(), (e, d, f), cfg.param_dtype)
        )
        self.up_proj = nnx.Param(
            _init(("expert", "embed", "mlp"), init)(rngs.params(), (e, d, f), cfg.param_dtype)
        )
        self.down_proj = nnx.Param(
            _init(("expert", "mlp", "embed"), init)(rngs.params(), (e, f, d), cfg.param_dtype)
        )

    def route(self, x):
        """(weights [N, k], expert ids [N, k]) for tokens x [N, D]."""
        logits = self.router(x).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, self.cfg.num_experts_per_tok)
        if self.cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts

    def __call__(self, x):
        cfg = self.cfg
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, k = x.shape[0], cfg.num_experts_per_tok
        weights, experts = self.route(x)
        flat_experts = experts.reshape(-1)
        order = jnp.argsort(flat_experts, stable=True)
        token = order // k
        xs = x[token]
        sizes = jnp.bincount(flat_experts, length=cfg.num_experts).astype(jnp.int32)
        dt, how = cfg.dtype, cfg.moe_matmul
        gate = grouped_matmul(xs.astype(dt), self.gate_proj[...].astype(dt), sizes, how)
        up = grouped_matmul(xs.astype(dt), self.up_proj[...].astype(dt), sizes, how)
        out = grouped_matmul(jax.nn.silu(gate) * up, self.down_proj[...].astype(dt), sizes, how)
        out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
        combined = jax.ops.segment_sum(out, token, num_segments=n)
        return combined.reshape(shape).astype(dt)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = MoE(cfg, rngs=rngs) if cfg.is_moe_layer(layer) else MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, causal=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, causal=causal)
        x = constrain_stream(x)
        return constrain_stream(x + self.mlp(self.post_attention_layernorm(x)))

    def extend(self, x, positions, causal, cache_k, cache_v, offsets, layer, rows=None):
        """Like __call__ for new tokens x [B, L, D]: their keys/values are written into entry
        ``layer`` of the model's stacked cache [layers, R, S, Hkv, D] at each row's offset (only
        the new slots are written: the stack is updated in place), and they attend over that
        layer's whole cache; row b of x lives in cache row ``rows[b]`` (default: b)."""
        h = self.input_layernorm(x)
        k_new, v_new = self.self_attn.project_kv(h, positions)
        cache_k = _write_rows(cache_k, k_new, offsets, layer, rows)
        cache_v = _write_rows(cache_v, v_new, offsets, layer, rows)
        kv = (cache_k[layer], cache_v[layer])
        if rows is not None:
            kv = (kv[0][rows], kv[1][rows])
        x = constrain_rows(x + self.self_attn(h, positions, causal=causal, kv=kv), DECODE_AXES)
        x = constrain_rows(x + self.mlp(self.post_attention_layernorm(x)), DECODE_AXES)
        return x, cache_k, cache_v


# --remat: what a decoder layer keeps for the backward pass (everything else is recomputed).
REMAT_POLICIES = {
    "none": None,  # keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # keep the layer's input only
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}


class DecoderStack(nnx.Module):
    """Consecutive decoder layers of one kind (dense or MoE), their parameters stacked on a
    leading ``layers`` axis (one `DecoderLayer` holding ``count`` layers' weights) and run
    by ``jax.lax.scan``: one layer's program whatever the depth (compile time independent of
    it), and a per-layer ``jax.checkpoint`` that every backend honours (the scan keeps the
    recomputation in the backward loop, where no compiler can merge it with the forward).

    Layer ``first + j`` of the model is entry ``j`` of every parameter here."""

    def __init__(self, cfg: ModelConfig, first: int, count: int, *, rngs: nnx.Rngs):
        self.cfg, self.first, self.count = cfg, first, count
        layers = [DecoderLayer(cfg, first + j, rngs=rngs) for j in range(count)]
        graphdef, _ = nnx.split(layers[0])
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(x) for x in layers))
        flat = [
            (path, var.replace(var.get_value(), out_sharding=("layers", *_names(var))))
            for path, var in nnx.to_flat_state(stacked)
        ]
        self.layer = nnx.merge(graphdef, nnx.from_flat_state(flat))

    def __call__(self, x, positions, causal=None):
        graphdef, state = nnx.split(self.layer)

        def step(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions, causal), None

        policy = REMAT_POLICIES[self.cfg.remat]
        if self.cfg.remat != "none":
            step = jax.checkpoint(step, policy=policy)
        x, _ = jax.lax.scan(step, x, state)
        return x

    def extend(
        self, x, positions, causal, cache: KVCache, offsets, rows=None
    ) -> tuple[jax.Array, KVCache]:
        """`DecoderLayer.extend` through the stack; ``cache`` is the model's whole cache,
        updated in place (the scan carries it) at this stack's layers."""
        graphdef, state = nnx.split(self.layer)

        def step(carry, xs):
            x, k, v = carry
            layer_state, index = xs
            layer = nnx.merge(graphdef, layer_state)
            x, k, v = layer.extend(x, positions, causal, k, v, offsets, index, rows)
            return (x, k, v), None

        layers = jnp.arange(self.first, self.first + self.count)
        (x, k, v), _ = jax.lax.scan(step, (x, cache.k, cache.v), (state, layers))
        return x, KVCache(k, v)


def unstacked(model: nnx.Module) -> tuple[nnx.GraphDef, Callable[[nnx.State], nnx.State]]:
    """The graph of ``model`` with one `DecoderStack` a layer, and the function that
    lays a state of ``model`` out for it (layer ``first + j`` of a stack: its own arrays, a
    copy of entry j; a state laid out already is returned as it is).

    Why: XLA's CPU compiler runs a scan over stacked weights by copying each layer's weights
    out of the stack at every iteration (a dynamic slice feeding each matmul); in a decode
    loop that is a copy of every weight every token. One array a layer is read in place:
    SmolLM2-135M decoded 19-33% more tokens/s at 32 rows (``benchmarks/vs_vllm.py``). The cost
    is the copy itself: a second set of weights while a sampler holds it."""
    cfg = model.cfg
    segments = cfg.layer_segments()
    split_cfg = dataclasses.replace(cfg, stack_layers=False)
    abstract = nnx.eval_shape(lambda: type(model)(split_cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)

    def lay_out(state: nnx.State) -> nnx.State:
        flat_in = list(nnx.to_flat_state(state))
        stacks = {path[path.index("layers") + 1] for path, _ in flat_in if "layers" in path}
        if stacks and max(stacks) >= len(segments):
            return state  # laid out already (a state read back from a split model)
        flat = []
        for path, var in flat_in:
            if "layers" not in path:
                flat.append((path, var))
                continue
            at = path.index("layers")
            first, count = segments[path[at + 1]]
            value = var.get_value()
            for j in range(count):
                where = (*path[: at + 1], first + j, *path[at + 2 :])
                flat.append((where, var.replace(value[j : j + 1])))
        return nnx.from_flat_state(flat)

    return graphdef, lay_out


def _names(var) -> tuple:
    names = var.get_metadata().get("out_sharding")
    return tuple(names) if names else (None,) * len(var.get_value().shape)


class Qwen3Model(nnx.Module):
    """The backbone: embedding, decoder layers, final norm -> hidden states [B, T, D].

    The layers are `DecoderStack` s, one per run of layers of one kind
    (`ModelConfig.layer_segments`: a single stack for Qwen3 dense and Qwen3-30B-A3B)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            embedding_init=_init(("vocab", "embed"), nnx.initializers.normal(0.02)),
            rngs=rngs,
        )
        self.layers = nnx.List(
            [DecoderStack(cfg, first, count, rngs=rngs) for first, count in cfg.layer_segments()]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg)

    def __call__(self, input_ids, positions=None, attention_mask=None, segment_starts=None):
        """input_ids: int [B, T]; positions default to 0..T-1; attention_mask: bool [B, T] of
        valid (non-padding) keys. Causal by position. ``segment_starts``: int [B, T], the column
        where each token's own sequence starts, for several sequences packed in a row: a token
        attends within its own sequence only, and positions (default) restart at each start.
        Each layer is rematerialised as ``cfg.remat`` says (`REMAT_POLICIES`)."""
        ways = context_ways()
        if ways > 1:
            return self._split(input_ids, positions, attention_mask, segment_starts, ways)
        b, t = input_ids.shape
        cols = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        causal = None  # a full causal sequence: the kernel may use cuDNN
        if segment_starts is not None:
            causal = (cols, cols, attention_mask, segment_starts)
            if positions is None:
                positions = cols - segment_starts
        elif positions is not None or attention_mask is not None:
            if positions is None:
                positions = cols
            causal = (positions, positions, attention_mask)
        rope_positions = cols if positions is None else positions
        x = constrain_rows(self.embed_tokens(input_ids))
        for stack in self.layers:
            x = stack(x, rope_positions, causal)
        return self.norm(x)

    def _split(self, input_ids, positions, attention_mask, segment_starts, ways):
        """`__call__` with each row's tokens split over the mesh's ``context`` axis
        (`train.model.context`): rows padded to a multiple of 2C (padding never a visible key),
        laid out zigzag, run, and the final hidden states put back in order."""
        b, t = input_ids.shape
        width = padded_length(t, ways)
        cols = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))

        def pad(x, fill):
            return jnp.pad(x, ((0, 0), (0, width - t)), constant_values=fill)

        valid = pad(jnp.ones((b, t), bool) if attention_mask is None else attention_mask, False)
        if segment_starts is not None:
            lower = pad(segment_starts.astype(jnp.int32), 0)
            key_positions = cols
            positions = cols - lower if positions is None else pad(positions, 0)
        else:
            lower = jnp.full((b, width), jnp.iinfo(jnp.int32).min, jnp.int32)
            key_positions = cols if positions is None else pad(positions, 0)
            key_positions = jnp.where(cols < t, key_positions, cols)
            positions = key_positions
        split = [to_zigzag(x, ways) for x in (pad(input_ids, 0), positions, key_positions)]
        ids, positions, key_positions = split
        causal = (key_positions, key_positions, to_zigzag(valid, ways), to_zigzag(lower, ways))
        x = constrain_stream(self.embed_tokens(ids))
        for stack in self.layers:
            x = stack(x, positions, causal)
        hidden = from_zigzag(self.norm(x), ways)[:, :t]
        return constrain_stream(hidden)

    def extend(self, input_ids, offsets, n_new, cache: KVCache, rows=None):
        """Appends tokens to a live cache and returns their hidden states.

        Args:
          input_ids: int [B, L], row b's new tokens in its first ``n_new[b]`` columns (the rest is
            padding and is never attended to).
          offsets: int [B], how many tokens each row already has in the cache (the new tokens take
            positions and slots offsets[b], offsets[b] + 1, ...).
          n_new: int [B], how many of the L columns are real for each row (0 leaves a row as is).
          cache: the `KVCache`; slots past its capacity are dropped.
          rows: int [B], the cache row each of the B rows lives in (distinct; default: row b in
            cache row b): a few rows of a larger cache are extended without the others.

        Returns:
          (hidden [B, L, D] after the final norm, the updated cache).
        """
        b, t = input_ids.shape
        capacity = cache.k.shape[2]
        positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        slots = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (b, capacity))
        valid = slots < (offsets + n_new)[:, None]
        causal = (positions, slots, valid)
        x = constrain_rows(self.embed_tokens(input_ids), DECODE_AXES)
        for stack in self.layers:
            x, cache = stack.extend(x, positions, causal, cache, offsets, rows)
        return self.norm(x), cache


class Qwen3ForCausalLM(nnx.Module):
    """The policy: backbone plus LM head (tied to the embedding when the config says so)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = Qwen3Model(cfg, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head_kernel = _linear(
                cfg, cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), rngs=rngs
            )

    def lm_head(self) -> tuple[jax.Array, int]:
        """(weight, vocab_axis): the LM head as used by ``kernels.logprobs`` — the [vocab, D]
        embedding table (axis 0) when tied, else the [D, vocab] kernel (axis -1)."""
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.embedding[...], 0
        return self.lm_head_kernel.kernel[...], -1

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, T, vocab] float32 logits (inputs in the compute dtype, accumulated in float32)."""
        weight, vocab_axis = self.lm_head()
        eq = "btd,vd->btv" if vocab_axis == 0 else "btd,dv->btv"
        dt = self.cfg.dtype
        return jnp.einsum(
            eq, hidden.astype(dt), weight.astype(dt), preferred_element_type=jnp.float32
        )

    def __call__(self, input_ids, positions=None, attention_mask=None, *, return_hidden=False):
        hidden = self.model(input_ids, positions, attention_mask)
        logits = self.logits(hidden)
        return (logits, hidden) if return_hidden else logits

    def extend(self, input_ids, offsets, n_new, cache: KVCache, rows=None):
        """`Qwen3Model.extend`, returning the next-token logits [B, vocab] after each row's
        last new token (computed for that one position only) and the updated cache."""
        hidden, cache = self.model.extend(input_ids, offsets, n_new, cache, rows)
        last = jnp.take_along_axis(hidden, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)
        return self.logits(last)[:, 0], cache


class Qwen3ValueModel(nnx.Module):
    """The critic: the same backbone with a scalar head on the final hidden states."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = Qwen3Model(cfg, rngs=rngs)
        self.value_head = nnx.Linear(
            cfg.hidden_size,
            1,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            kernel_init=_init(("embed", None), nnx.initializers.zeros_init()),
            bias_init=_init((None,), nnx.initializers.zeros_init()),
            rngs=rngs,
        )

    @classmethod
    def from_policy(cls, policy: Qwen3ForCausalLM, *, rngs: nnx.Rngs) -> Qwen3ValueModel:
        """A critic whose backbone starts as a copy of the policy's (value head at zero)."""
        critic = cls(policy.cfg, rngs=rngs)
        nnx.update(critic.model, jax.tree.map(jnp.copy, nnx.state(policy.model)))
        return critic

    def __call__(self, input_ids, positions=None, attention_mask=None):
        hidden = self.model(input_ids, positions, attention_mask)
        return self.value_head(hidden.astype(jnp.float32))[..., 0]
