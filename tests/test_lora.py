"""LoRA: adapters on one frozen base for actor, critic and reference; merged weights for
generation; checkpoints that name their base; PEFT's folder out and in; every refusal."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from tests.models import SMALL, randomise
from tests.test_train import TINY
from train import evaluate, export, run, sft
from train.core import trainer as trainer_module
from train.core.build import lora_config, trainable_like
from train.core.checkpoint import Checkpoints
from train.core.config import TrainConfig, parse_args
from train.core.metrics import read_metrics
from train.model import lora
from train.model.qwen3 import ModelConfig, Qwen3ForCausalLM
from train.model.weights import load_pretrained

IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=1e4)  # fmt: skip


def _adapted(cfg, rank=4, alpha=8.0, targets=lora.LORA_TARGETS, seed=1, b_scale=0.0):
    """(base model, adapted graph, adapters) with B set to ``b_scale`` x noise (0: fresh)."""
    base_model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    lcfg = dataclasses.replace(cfg, lora_rank=rank, lora_alpha=alpha, lora_targets=targets)
    graph = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(lcfg, rngs=nnx.Rngs(0))))
    adapters = lora.init_trainable(Qwen3ForCausalLM, lcfg, seed)
    if b_scale:
        keys = iter(jax.random.split(jax.random.key(seed), 100))
        adapters = jax.tree.map(
            lambda x: x + b_scale * jax.random.normal(next(keys), x.shape), adapters
        )
    return base_model, graph, adapters, lcfg


@pytest.mark.parametrize("stack", [True, False])
def test_fresh_adapters_give_the_base_logits_and_merging_equals_base_plus_adapters(stack):
    cfg = dataclasses.replace(CFG, stack_layers=stack)
    base_model, graph, fresh, lcfg = _adapted(cfg)
    base = nnx.state(base_model)
    ids = jnp.asarray(IDS, jnp.int32)
    expected = np.asarray(base_model(ids))
    adapted = np.asarray(lora.bind(graph, lora.Adapted(base, fresh))(ids))
    # B = 0 adds exactly 0; XLA fuses the adapter's add into the scanned layer's dot, which may
    # round the projection differently: equal to float32 rounding (a few ulp), not bit for bit
    ulp = float(np.spacing(np.abs(expected).max()))
    np.testing.assert_allclose(adapted, expected, rtol=0, atol=8 * ulp)
    # trained adapters (B != 0): the merged plain model equals base + adapters
    _, _, trained, _ = _adapted(cfg, b_scale=0.3)
    with_adapters = np.asarray(lora.bind(graph, lora.Adapted(base, trained))(ids))
    assert np.abs(with_adapters - expected).max() > 1e-2  # the adapters do something
    merged = lora.merge_weights(base, trained, lora.lora_scale(4, 8.0))
    np.testing.assert_allclose(
        np.asarray(nnx.merge(nnx.graphdef(base_model), merged)(ids)), with_adapters, atol=2e-5
    )
    # the base's own arrays are reused, not copied: only adapted kernels are new
    flat_base, flat_merged = dict(nnx.to_flat_state(base)), dict(nnx.to_flat_state(merged))
    for path, var in flat_merged.items():
        same = var.get_value() is flat_base[path].get_value()
        assert same == ("kernel" not in path or path[-2] not in lora.LORA_TARGETS), path


def test_targets_adapt_only_the_named_projections_and_moe_experts_never():
    _, _, adapters, _ = _adapted(CFG, targets=("q_proj", "down_proj"))
    names = {path[-3] for path, _ in nnx.to_flat_state(adapters)}
    assert names == {"q_proj", "down_proj"}
    moe = dataclasses.replace(CFG, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert lora.adapted_names(dataclasses.replace(moe, lora_targets=lora.LORA_TARGETS)) == list(
        lora.LORA_TARGETS[:4]
    )
    names = r"\['q_proj', 'k_proj', 'v_proj', 'o_proj'\]"
    with pytest.raises(ValueError, match=rf"\['gate_proj'\] names no module.*are {names}.*MoE"):
        lora.check_targets(("gate_proj",), moe)
    with pytest.raises(ValueError, match="lora_targets"):
        lora_config(TrainConfig(lora_rank=2, lora_targets="mlp"), moe)
    # the default, all, is every projection the model has: attention alone on an all-MoE model
    assert lora_config(TrainConfig(lora_rank=2), moe).lora_targets == lora.LORA_TARGETS[:4]
    assert lora_config(TrainConfig(lora_rank=2), CFG).lora_targets == lora.LORA_TARGETS


def _lora_flags(tmp_path, *extra):
    return [*TINY, "--run-dir", str(tmp_path), "--lora-rank", "4", "--lora-alpha", "8", *extra]


def test_an_update_moves_the_adapters_and_value_head_and_never_the_base(tmp_path):
    trainer = trainer_module.Trainer(parse_args(_lora_flags(tmp_path, "--preset", "mpo")))
    base = trainer.roles.frozen["actor"]
    before = [np.array(x) for x in jax.tree.leaves(base)]
    critic_trunk = jax.tree.leaves(trainer.roles.frozen["critic"])
    shared = zip(critic_trunk, jax.tree.leaves(base["model"]), strict=True)
    assert all(x is y for x, y in shared)  # the critic's trunk is the base's arrays, not a copy
    assert trainer.ref is base
    trained = {w: [p for p, _ in nnx.to_flat_state(trainer.state[w])] for w in ("actor", "critic")}
    assert all("lora" in p for p in trained["actor"])
    assert all("lora" in p or "value_head" in p for p in trained["critic"])
    old = jax.tree.map(np.array, {w: trainer.state[w] for w in ("actor", "critic")})
    metrics = trainer.step(0)
    assert metrics["ref_kl"] == pytest.approx(0.0, abs=1e-6)  # fresh adapters: the reference
    for x, y in zip(before, jax.tree.leaves(trainer.roles.frozen["actor"]), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))  # the base's bytes, unchanged
    for which in ("actor", "critic"):
        moved = [
            not np.array_equal(a, np.asarray(b))
            for a, b in zip(
                jax.tree.leaves(old[which]), jax.tree.leaves(trainer.state[which]), strict=True
            )
        ]
        assert any(moved), which
    head = dict(nnx.to_flat_state(trainer.state["critic"]))
    assert any(
        "value_head" in p and np.abs(np.asarray(v.get_value())).max() > 0 for p, v in head.items()
    )
    # optimizer state exists for what trains alone
    opt_bytes = sum(x.size for x in jax.tree.leaves(trainer.state["actor_opt"]) if x.ndim)
    actor_bytes = sum(x.size for x in jax.tree.leaves(trainer.state["actor"]))
    assert opt_bytes == 2 * actor_bytes  # Adam's two moments


def test_a_killed_lora_run_resumes_to_the_end_of_an_uninterrupted_one(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run.main(_lora_flags(a, "--steps", "3", "--checkpoint-every", "1")) == 0
    assert run.main(_lora_flags(b, "--steps", "2", "--checkpoint-every", "1")) == 0
    assert run.main(["--resume", "--run-dir", str(b), "--steps", "3"]) == 0
    like = trainer_module.Trainer(parse_args(_lora_flags(tmp_path / "c", "--steps", "3"))).state
    sa = Checkpoints(a / "checkpoints").restore(like)
    sb = Checkpoints(b / "checkpoints").restore(like)
    assert sa["step"] == sb["step"] == 3 and sa["base"] == sb["base"]
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        np.testing.assert_array_equal(x, y)
    assert [r["step"] for r in read_metrics(b)] == [1, 2, 3]
    # the checkpoint holds adapters alone: smaller than the base it names
    ckpt = sum(f.stat().st_size for f in (a / "checkpoints" / "3" / "actor").rglob("*"))
    assert 0 < ckpt


def test_resume_on_another_base_is_refused_naming_both(tmp_path, capsys):
    out = tmp_path / "run"
    assert run.main(_lora_flags(out, "--steps", "1")) == 0
    meta = out / "checkpoints" / "1" / "base" / "metadata"
    recorded = json.loads(meta.read_text())
    meta.write_text(json.dumps({**recorded, "fingerprint": "0123456789abcdef"}))
    assert run.main(["--resume", "--run-dir", str(out), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "0123456789abcdef" in err and recorded["fingerprint"] in err and "--resume" in err
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_a_lora_sft_run_trains_the_adapters_and_evaluates(tmp_path, capsys):
    argv = ["--env", "synthetic-calls", "--layers", "1", "--width", "32", "--heads", "2",
            "--kv-heads", "1", "--steps", "2", "--demos", "16", "--val-demos", "8",
            "--eval-episodes", "2", "--eval-every", "2", "--lora-rank", "2",
            "--lora-targets", "attention", "--run-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    assert sft.main(argv) == 0
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and "eval_heldout_success_rate" in rows[-1]
    assert rows[0]["grad_norm"] > 0
    # resumed on another base: refused at start-up, naming both fingerprints
    meta = tmp_path / "checkpoints" / "2" / "base" / "metadata"
    recorded = json.loads(meta.read_text())
    meta.write_text(json.dumps({**recorded, "fingerprint": "0123456789abcdef"}))
    assert sft.main(["--resume", "--run-dir", str(tmp_path), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "0123456789abcdef" in err and recorded["fingerprint"] in err
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


# -- PEFT's folder: our export loads in peft with our logits; it comes back in -----------------

LLAMA = dict(SMALL, num_hidden_layers=2, tie_word_embeddings=True)
QWEN3 = dict(SMALL, num_hidden_layers=2, head_dim=8, tie_word_embeddings=True)


@pytest.mark.parametrize(
    "config_cls, model_cls, kwargs",
    [
        (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN3),
        (transformers.LlamaConfig, transformers.LlamaForCausalLM, LLAMA),
    ],
    ids=["qwen3", "llama"],
)
def test_peft_loads_our_adapter_folder_with_our_logits(tmp_path, config_cls, model_cls, kwargs):
    import peft

    torch_model = randomise(model_cls(config_cls(**kwargs)))
    torch_model.save_pretrained(tmp_path / "base")
    ours = load_pretrained(tmp_path / "base")
    targets = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    cfg = dataclasses.replace(ours.cfg, lora_rank=4, lora_alpha=16.0, lora_targets=targets)
    graph, base = nnx.split(ours)
    adapters = lora.init_trainable(Qwen3ForCausalLM, cfg, 7)
    keys = iter(jax.random.split(jax.random.key(0), 100))
    adapters = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape), adapters)
    lora_graph = nnx.graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))))
    expected = np.asarray(lora.bind(lora_graph, lora.Adapted(base, adapters))(jnp.asarray(IDS)))
    folder = lora.save_peft(tmp_path / "adapters", adapters, cfg, base_path="base",
                            base_hash=lora.fingerprint(base))  # fmt: skip
    with torch.no_grad():
        plain = torch_model(torch.tensor(IDS)).logits.numpy()
        peft_model = peft.PeftModel.from_pretrained(torch_model, str(folder)).eval()
        theirs = peft_model(torch.tensor(IDS)).logits.numpy()
    assert np.abs(theirs - plain).max() > 1e-2  # peft applied the adapters
    np.testing.assert_allclose(theirs, expected, atol=2e-4)
    # and back in: the folder's adapters, in our layout, equal what was saved
    back = lora.load_peft(folder, trainable_like(Qwen3ForCausalLM, cfg), cfg,
                          base_hash=lora.fingerprint(base))  # fmt: skip
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(adapters), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
    # another base: refused, naming the folder and both fingerprints
    other = nnx.state(Qwen3ForCausalLM(ours.cfg, rngs=nnx.Rngs(5)))
    with pytest.raises(ValueError, match="made on the base base .*fingerprint"):
        lora.load_peft(folder, trainable_like(Qwen3ForCausalLM, cfg), cfg,
                       base_hash=lora.fingerprint(other))  # fmt: skip


def test_export_adapters_then_evaluate_and_init_from_the_peft_folder(tmp_path, capsys):
    from tests.models import save_tiny_qwen3

    base = tmp_path / "base"
    save_tiny_qwen3(base)  # a Hugging Face folder; the synthetic task's words fit its vocabulary
    small = [*TINY, "--steps", "1", "--preset", "grpo", "--model-path", str(base),
             "--lora-rank", "4", "--lora-targets", "attention"]  # fmt: skip
    run_dir = tmp_path / "run"
    assert run.main([*small, "--run-dir", str(run_dir), "--lr", "1e-2"]) == 0
    out = tmp_path / "adapters"
    assert export.main(["--run-dir", str(run_dir), "--out", str(out), "--adapters"]) == 0
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    size = (out / "adapter_model.safetensors").stat().st_size
    assert size < sum(f.stat().st_size for f in base.glob("*.safetensors")) / 4
    merged = tmp_path / "merged"
    assert export.main(["--run-dir", str(run_dir), "--out", str(merged)]) == 0
    # the base plus the folder evaluates like the merged export (same tasks, keys and weights)
    common = ["--env", "synthetic-nav", "--episodes", "2", "--k", "1", "--max-len", "32",
              "--no-progress"]  # fmt: skip
    assert evaluate.main(["--model-path", str(base), "--adapter", str(out), *common,
                          "--out", str(tmp_path / "e1")]) == 0  # fmt: skip
    assert evaluate.main(["--model-path", str(merged), *common, "--out", str(tmp_path / "e2")]) == 0
    m1, m2 = (json.loads((tmp_path / e / "metrics.json").read_text()) for e in ("e1", "e2"))
    assert m1 == m2
    # init from the folder: a new run starts from those adapters
    assert run.main([*small, "--run-dir", str(tmp_path / "again"), "--init-from", str(out)]) == 0
    # refusals: no --lora-rank; other targets; --adapters with --dtype
    capsys.readouterr()
    no_rank = small[: small.index("--lora-rank")]
    assert run.main([*no_rank, "--run-dir", str(tmp_path / "x"), "--init-from", str(out)]) == 2
    assert "--lora-rank 4" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    other_targets = [*small, "--lora-targets", "all", "--run-dir", str(tmp_path / "y")]
    assert run.main([*other_targets, "--init-from", str(out)]) == 2
    assert "--lora-targets" in capsys.readouterr().err and not (tmp_path / "y").exists()
    assert export.main(["--run-dir", str(tmp_path / "again"), "--out", str(tmp_path / "z"),
                        "--adapters", "--dtype", "bfloat16"]) == 2  # fmt: skip
    assert evaluate.main(["--run-dir", str(run_dir), "--adapter", str(out)]) == 2
    assert "--adapter: puts a PEFT folder on the --model-path base" in capsys.readouterr().err


# -- refusals at start-up, naming the flag and the rule, with nothing written --------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-rank", "-1"], "lora_rank: must be >= 1 for LoRA or 0"),
        (["--lora-alpha", "16"], "lora_alpha: a LoRA setting, but --lora-rank is 0"),
        (["--lora-targets", "attention"], "lora_targets: a LoRA setting, but --lora-rank is 0"),
        (["--lora-rank", "4", "--lora-targets", "q_proj,qkv"], r"lora_targets: \['qkv'\] not"),
        (["--lora-rank", "4", "--critic-from", "x"], "critic_from: with --lora-rank"),
    ],
)
def test_bad_lora_flags_are_refused_naming_the_flag(tmp_path, capsys, flags, message):
    assert run.main([*TINY, "--run-dir", str(tmp_path / "r"), *flags]) == 2
    text = capsys.readouterr().err
    assert text.startswith("refused (nothing was written): ")
    assert re.search(message, text), text
    assert not (tmp_path / "r").exists()
