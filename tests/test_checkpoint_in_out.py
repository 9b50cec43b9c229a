"""A user's checkpoint in and out: an official-shaped Qwen3 folder trains on the tool environments,
is exported to a Hugging Face folder that transformers loads, and is evaluated without training."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from tests.models import save_official_qwen3
from train import evaluate, export, run
from train.core.build import model_config, restore_model, run_codec, run_config
from train.core.metrics import read_metrics

IDS = np.random.default_rng(1).integers(0, 151_643, size=(2, 11))

# Small by flags, not by skipping an environment: one task, two rollouts, two turns of 8 tokens.
SMALL_RUN = [
    "--steps", "2", "--prompts-per-step", "1", "--group-size", "2", "--minibatches", "1",
    "--max-new-tokens", "8", "--env-set", "max_turns=2", "--max-len", "6144",
    "--eval-every", "0", "--checkpoint-every", "2", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, PyTorch model): the real vocabulary, two layers, tied with lm_head.weight present,
    bfloat16 in two shards, the bundled tokenizer and template beside it."""
    path = tmp_path_factory.mktemp("qwen3-official-shape")
    return path, save_official_qwen3(path)


def _our_logits(run_dir, ids):
    cfg = run_config(run_dir)
    import envs

    codec = run_codec(cfg, envs.make(cfg.env, seed=0))
    model = restore_model(run_dir, model_config(cfg, codec))
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


@pytest.mark.parametrize(
    "env, preset",
    # mpo (critic, reference) where prompts are short; critic-free grpo on the 3k-5k-token prompts
    [("search", "mpo"), ("bfcl", "grpo"), ("tau2-retail", "grpo")],
)
def test_a_checkpoint_trains_exports_and_evaluates(checkpoint, tmp_path, env, preset, capsys):
    path, _ = checkpoint
    run_dir, out = tmp_path / "run", tmp_path / "export"
    extra = [] if preset == "mpo" else ["--no-log-ref-kl"]
    args = ["--model-path", str(path), "--env", env, "--preset", preset, *SMALL_RUN, *extra]
    assert run.main([*args, "--run-dir", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert "defaults for a pretrained model: --critic-lr 1e-05 --entropy-coef 0.0 --lr 1e-06" in err
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["policy_loss"]) and 0 <= r["turn_cut_frac"] <= 1 for r in rows)
    stored = json.loads((run_dir / "config.json").read_text())
    assert (stored["lr"], stored["entropy_coef"]) == (1e-6, 0.0)

    critic = ["--critic"] if preset == "mpo" else []
    assert export.main(["--run-dir", str(run_dir), "--out", str(out), *critic]) == 0
    for name in ("config.json", "generation_config.json", "tokenizer.json", "mpo_jax_export.json"):
        assert (out / name).exists(), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        expected = theirs(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(_our_logits(run_dir, IDS), expected, atol=2e-4)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [
        151645,
        151643,
    ]
    if critic:
        assert (out / "critic" / "model.safetensors").exists()

    report = tmp_path / "eval"
    assert (
        evaluate.main(
            [
                "--model-path",
                str(out),
                "--env",
                env,
                "--episodes",
                "1",
                "--k",
                "2",
                "--max-new-tokens",
                "8",
                "--env-set",
                "max_turns=2",
                "--max-len",
                "6144",
                "--out",
                str(report),
            ]
        )  # fmt: skip
        == 0
    )
    metrics = json.loads((report / "metrics.json").read_text())
    assert {"eval_heldout_success_rate", "eval_heldout_pass@1", "eval_heldout_pass@2"} <= set(
        metrics
    )
    lines = (report / "transcripts.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(x)["text"].startswith("<|im_start|>") for x in lines)


def test_a_textarena_game_trains_two_steps_on_the_engine_with_fewer_slots(checkpoint, tmp_path):
    # TextArena's family through the trainer, on the engine's non-default path: fewer slots than
    # episodes, short chunks ended early once half their slots' turns ended, and environments
    # stepped by threads.
    path, _ = checkpoint
    run_dir = tmp_path / "run"
    args = [
        "--model-path", str(path), "--env", "guess-the-number", "--preset", "grpo",
        "--no-log-ref-kl", *SMALL_RUN, "--group-size", "4", "--slots", "2", "--decode-chunk",
        "4", "--decode-refill", "0.5", "--env-workers", "2", "--run-dir", str(run_dir),
    ]  # fmt: skip
    assert run.main(args) == 0
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert np.isfinite(r["policy_loss"]) and 0 < r["engine_utilisation"] <= 1
        assert r["engine_chunks"] >= 2 and "env_format_error_rate" in r
