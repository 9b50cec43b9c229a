"""Start-up checks for a user's checkpoint (refused, naming the file or flag, with nothing
written), tasks dropped to fit, and the small runs' way out: export, evaluation, --init-from."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from envs.chat import tokenizer_dir
from train import evaluate, export, run
from train.core import trainer as trainer_module
from train.core.build import model_config, restore_model, run_codec, run_config
from train.core.metrics import read_metrics

IDS = np.random.default_rng(1).integers(0, 20, size=(2, 11))


def _our_logits(run_dir, ids):
    import envs

    cfg = run_config(run_dir)
    codec = run_codec(cfg, envs.make(cfg.env, seed=0))
    model = restore_model(run_dir, model_config(cfg, codec))
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


# -- bad input: refused at start-up, naming the file or flag, with nothing written ---------------


def _config_only(tmp_path, **edits):
    """A checkpoint folder holding only config.json (start-up checks read nothing else first)."""
    hf = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151_936,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
        **edits,
    }
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    return str(folder)


def _bad_template(tmp_path):
    from envs.chat import load_tokenizer

    tok = load_tokenizer.__wrapped__()
    tok.chat_template = tok.chat_template.replace("<|im_end|>", "<|END|>")
    tok.save_pretrained(tmp_path / "tok")
    return str(tmp_path / "tok")


BAD_STARTS = {
    "no config.json": (lambda t: ["--model-path", str(t)], "has no config.json"),
    "architecture": (
        lambda t: ["--model-path", _config_only(t, architectures=["GPT2LMHeadModel"])],
        r"architectures=\['GPT2LMHeadModel'\] is not supported",
    ),
    "rope scaling": (
        lambda t: ["--model-path", _config_only(t, rope_scaling={"rope_type": "yarn"})],
        "rope_type 'yarn' is not supported",
    ),
    "no tokenizer": (
        lambda t: ["--model-path", _config_only(t)],
        r"ckpt: no tokenizer.json or tokenizer_config.json \(pass --tokenizer-path",
    ),
    "vocabulary": (
        lambda t: [
            "--model-path",
            _config_only(t, vocab_size=1000),
            "--tokenizer-path",
            str(tokenizer_dir()),
        ],  # fmt: skip
        r"the tokenizer has 151669 ids but .*ckpt has 1000 embedding rows",
    ),
    "stop token": (
        lambda t: ["--tokenizer-path", _bad_template(t)],
        r"tok: the chat template ends an assistant turn with '<\|END\|>'",
    ),
    "trace without gold": (
        lambda t: ["--preset", "trace", "--env", "bfcl"],
        "preset: trace scores the reference model's belief .* bfcl has none",
    ),
    "a task that cannot fit": (
        lambda t: ["--env", "tau2-retail", "--max-len", "2048", "--max-new-tokens", "64"],
        r"max_len: \d+ of the \d+ train tasks of tau2-retail do not fit: .* --max-len 2048",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_STARTS))
def test_bad_input_is_refused_at_start_naming_the_file_or_flag(tmp_path, capsys, case):
    make_args, message = BAD_STARTS[case]
    args = ["--env", "search", *make_args(tmp_path)]
    run_dir = tmp_path / "run"
    assert run.main([*args, "--run-dir", str(run_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "nothing was written" in err
    assert re.search(message, err), err
    assert not run_dir.exists()


def test_tasks_that_cannot_fit_are_dropped_and_counted_on_request(tmp_path, capsys):
    from train.core.config import parse_args

    # search prompts are 346-368 tokens: a budget of 368 + 1 keeps those up to 359
    args = ["--env", "search", "--preset", "grpo", "--max-len", "369", "--max-new-tokens", "9"]
    trainer = trainer_module.Trainer(
        parse_args([*args, "--drop-long-tasks", "--run-dir", str(tmp_path)])
    )
    err = capsys.readouterr().err
    assert "--drop-long-tasks:" in err and "train tasks of search do not fit" in err
    dropped = set(trainer.env_options["exclude_tasks"])
    kept = list(envs_make("search", trainer.env_options).task_prompts())
    assert dropped and kept and not dropped & {task for task, _, _ in kept}
    for _, messages, tools in kept:
        assert len(trainer.codec.prompt(messages, tools)) + 9 + 1 <= 369


def envs_make(name, options):
    import envs

    return envs.make(name, seed=0, **options)


# -- tiny runs: export, evaluate, init-from -------------------------------------------------------

TINY = [
    "--layers", "1", "--width", "32", "--heads", "2", "--kv-heads", "1", "--prompts-per-step",
    "4", "--group-size", "2", "--no-progress", "--minibatches", "2", "--eval-episodes", "4",
    "--eval-k", "2",
]  # fmt: skip


def test_evaluating_a_runs_checkpoint_reproduces_the_runs_own_evaluation(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "--steps", "2", "--eval-every", "2", "--checkpoint-every", "2"]
    assert run.main([*args, "--run-dir", str(run_dir)]) == 0
    logged = read_metrics(run_dir)[-1]
    out = tmp_path / "eval"
    assert evaluate.main(["--run-dir", str(run_dir), "--episodes", "4", "--k", "2",
                          "--out", str(out)]) == 0  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    for key, value in metrics.items():
        assert logged[key] == pytest.approx(value, abs=1e-9), key


def test_a_new_run_starts_from_an_export_or_a_run_directory(tmp_path):
    from train.core.config import parse_args

    run_dir, out = tmp_path / "run", tmp_path / "export"
    assert run.main([*TINY, "--steps", "2", "--eval-every", "0", "--run-dir", str(run_dir)]) == 0
    assert export.main(["--run-dir", str(run_dir), "--out", str(out)]) == 0
    assert export.main(["--run-dir", str(run_dir), "--out", str(out)]) == 2  # not empty: refused
    trained = _our_logits(run_dir, IDS)
    for source in (out, run_dir):
        trainer = trainer_module.Trainer(
            parse_args([*TINY, "--init-from", str(source), "--run-dir", str(tmp_path / "x")])
        )
        from flax import nnx

        model = nnx.merge(trainer.models.actor, trainer.state["actor"])
        np.testing.assert_allclose(model(jnp.asarray(IDS, jnp.int32)), trained, atol=1e-5)
        # the reference model is where the run starts: the export
        ref = nnx.merge(trainer.models.actor, trainer.ref)
        np.testing.assert_allclose(ref(jnp.asarray(IDS, jnp.int32)), trained, atol=1e-5)
        assert trainer.cfg.lr == 1e-6  # a pretrained start takes the pretrained defaults
