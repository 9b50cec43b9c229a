"""Supervised warm start: the loss goes down, the held-out loss is reported, a resumed run ends
where an uninterrupted one does, chat conversations train on assistant tokens only (padded or
packed), and RL starts from the result."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from envs.chat import format_tool_call
from train import run, sft
from train.core import trainer as trainer_module
from train.core.checkpoint import Checkpoints
from train.core.config import parse_args
from train.core.metrics import read_metrics

TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--kv-heads", "1", "--no-progress",
        "--env", "synthetic-calls", "--demos", "64", "--val-demos", "16", "--batch-size", "8",
        "--eval-episodes", "0"]  # fmt: skip


def test_the_loss_goes_down_and_the_held_out_loss_is_reported(tmp_path):
    args = [*TINY, "--steps", "30", "--eval-every", "15", "--lr", "3e-3", "--run-dir",
            str(tmp_path)]  # fmt: skip
    assert sft.main(args) == 0
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
    assert last < 0.7 * first, (first, last)
    held = [r["held_out_loss"] for r in rows if "held_out_loss" in r]
    assert len(held) == 2 and held[1] < held[0]
    assert rows[0]["demo_success_rate"] == 1.0  # noise 0: the scripted policy always succeeds
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["sft"]["demos"] == 64 and stored["env"] == "synthetic-calls"


def test_a_resumed_run_ends_where_an_uninterrupted_run_ends(tmp_path):
    args = [*TINY, "--eval-every", "0", "--checkpoint-every", "2"]
    assert sft.main([*args, "--steps", "4", "--run-dir", str(tmp_path / "whole")]) == 0
    assert sft.main([*args, "--steps", "2", "--run-dir", str(tmp_path / "cut")]) == 0
    assert sft.main(["--resume", "--run-dir", str(tmp_path / "cut"), "--steps", "4"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "cut")] == [1, 2, 3, 4]
    like = {"actor": _actor_like(tmp_path / "whole")}
    a = Checkpoints(tmp_path / "whole" / "checkpoints").restore(like)["actor"]
    b = Checkpoints(tmp_path / "cut" / "checkpoints").restore(like)["actor"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_resume_keeps_the_warm_starts_data_and_may_change_what_it_keeps_in_memory(tmp_path):
    assert sft.main([*TINY, "--eval-every", "0", "--steps", "1", "--run-dir", str(tmp_path)]) == 0
    before = json.loads((tmp_path / "config.json").read_text())
    for bad, field in ((["--demos", "8"], "--demos=8"), (["--lr", "0.5"], "--lr=0.5")):
        with pytest.raises(SystemExit, match=rf"--resume: {field} \(the run has"):
            sft.parse(["--resume", "--run-dir", str(tmp_path), *bad])
    # --remat changes memory, not a gradient: a warm start that ran out of memory resumes with it
    resumed = ["--resume", "--run-dir", str(tmp_path), "--steps", "2", "--remat", "full"]
    assert sft.main(resumed) == 0
    assert json.loads((tmp_path / "config.json").read_text()) == {
        **before, "steps": 2, "remat": "full"}  # fmt: skip
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def _actor_like(run_dir):
    from flax import nnx

    import envs
    from train.core.build import abstract_actor, model_config, run_codec, run_config

    cfg = run_config(run_dir)
    codec = run_codec(cfg, envs.make(cfg.env, seed=0))
    _, state = nnx.split(abstract_actor(model_config(cfg, codec)))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def test_rl_starts_from_the_warm_start_and_uses_it_as_reference(tmp_path):
    assert sft.main([*TINY, "--steps", "3", "--eval-every", "0", "--run-dir",
                     str(tmp_path / "sft")]) == 0  # fmt: skip
    flags = ["--init-from", str(tmp_path / "sft"), "--env", "synthetic-calls", "--preset",
             "trace", "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "0",
             "--no-progress", "--steps", "1", "--run-dir", str(tmp_path / "rl")]  # fmt: skip
    trainer = trainer_module.Trainer(parse_args(flags))
    warm = sft_actor = Checkpoints(tmp_path / "sft" / "checkpoints").restore(
        {"actor": trainer.state["actor"]}
    )["actor"]
    for x, y in zip(jax.tree.leaves(sft_actor), jax.tree.leaves(trainer.ref), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert warm is not None and run.main(flags) == 0


def _chat_file(path):
    lines = [
        {
            "messages": [
                {"role": "system", "content": "Answer with the tools."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "search", "arguments": {"query": "France capital"}}}
                ]},
                {"role": "tool", "content": "doc: Paris is the capital of France"},
                {"role": "assistant", "content": "<answer>Paris</answer>"},
            ]
        }
    ] * 5  # fmt: skip
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_chat_conversations_train_on_assistant_tokens_only(tmp_path):
    import envs

    codec = envs.make("search", seed=0).codec
    rows, dropped = sft.conversations(str(_chat_file(tmp_path / "c.jsonl")), codec, max_len=4096)
    assert dropped == 0 and len(rows) == 5
    ids, mask = rows[0]
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    call = format_tool_call("search", {"query": "France capital"})
    expected = codec.encode(call) + [codec.im_end] + codec.encode("<answer>Paris</answer>")
    assert trained == expected + [codec.im_end]
    assert codec.decode(ids).count("<|im_end|>") == 5  # system, user, turn, tools, turn
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no assistant message to train on"):
        sft.conversations(str(bad), codec, max_len=4096)


def test_packed_rows_keep_each_conversation_to_itself():
    examples = sft.Examples(
        tokens=np.array([[5, 6, 7, 0], [8, 9, 0, 0], [3, 0, 0, 0]], np.int32),
        mask=np.array([[0, 1, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0]], bool),
    )
    packed = sft.pack(examples, 6)
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 3]]
    assert packed.starts.tolist() == [[0, 0, 0, 3, 3, 5]]
    assert packed.mask.sum() == examples.mask.sum()
