"""The memory plan on a tiny model: its state against the arrays a real trainer holds, its programs
against the trainer's own compiled programs, the CLI on fake devices, a refused start."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import run
from train.core import trainer as trainer_module
from train.core.config import parse_args
from train.plan import make_plan

TINY = ["--layers", "2", "--width", "32", "--heads", "2", "--kv-heads", "1", "--prompts-per-step",
        "4", "--group-size", "2", "--minibatches", "2", "--micro-batches", "2", "--eval-every",
        "0", "--no-progress"]  # fmt: skip


def _bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """(plan, trainer) of the tiny configuration: one plan and one trainer for the module."""
    cfg = parse_args([*TINY, "--run-dir", str(tmp_path_factory.mktemp("plan"))])
    return make_plan(cfg), trainer_module.Trainer(cfg)


def test_the_plans_state_is_what_a_trainer_holds(planned):
    plan, trainer = planned
    measured = {
        "actor parameters": _bytes(trainer.state["actor"]),
        "actor optimizer state": _bytes(trainer.state["actor_opt"]),
        "critic parameters": _bytes(trainer.state["critic"]),
        "critic optimizer state": _bytes(trainer.state["critic_opt"]),
        "reference parameters": _bytes(trainer.ref),
    }
    for name, value in measured.items():
        assert plan.state[name] == value, name
    # the sampler's cache for the step's rollout rows, at the trainer's capacity
    trainer.sampler.start([[1, 2]] * trainer.batch_size)
    assert plan.state["sampler KV cache (rollouts only)"] == _bytes(trainer.sampler.cache)


def test_a_plan_compiles_each_distinct_program_once_in_a_process(tmp_path, monkeypatch):
    # The search re-plans after every change: the programs it did not touch come from the memo
    # (keyed by their lowered text), the ones it did are compiled anew and differ.
    from train import plan as plan_module

    monkeypatch.setattr(plan_module, "_COMPILED", plan_module.collections.OrderedDict())
    cfg = parse_args([*TINY, "--run-dir", str(tmp_path), "--engine", "continuous"])
    first = make_plan(cfg)
    compiled = len(plan_module._COMPILED)
    assert compiled == len(first.programs) + 2  # and the two optimizer initialisations
    again = make_plan(cfg)
    assert len(plan_module._COMPILED) == compiled and again.programs == first.programs
    fewer = make_plan(dataclasses.replace(cfg, slots=2))  # 8 episodes on 2 decode rows
    assert len(plan_module._COMPILED) == compiled + 2  # the sampler's prefill and decode
    for before, after in zip(first.programs, fewer.programs, strict=True):
        if before.name.startswith("sampler"):
            assert after.own < before.own, before.name
        else:
            assert after == before, before.name


def test_the_plans_programs_are_the_trainers_compiled_programs(planned):
    # The actor's training micro-step as the trainer compiles it for a worst-case micro-batch
    # (--max-len tokens, every one an action token): the plan reports its own analysis.
    from train.core.learner import ActionRows

    plan, trainer = planned
    rows, t = trainer.cfg.micro_rows, trainer.cfg.max_len
    batch = ActionRows(
        tokens=jnp.zeros((rows, t), jnp.int32),
        positions=jnp.zeros((rows, t), jnp.int32),
        loss_mask=jnp.ones((rows, t), bool),
        turn_ids=jnp.zeros((rows, t), jnp.int32),
        **{n: jnp.zeros((rows, t)) for n in ("old_logp", "advantages", "values", "returns")},
    )
    compiled = trainer.fns.actor_grad.lower(trainer.state["actor"], batch, 1.0, 1.0).compile()
    m = compiled.memory_analysis()
    own = (
        m.argument_size_in_bytes
        - _bytes(trainer.state["actor"])
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    (planned,) = [p for p in plan.programs if p.name == "training micro-step (actor)"]
    assert planned.own == pytest.approx(own, rel=0.01)
    assert (
        planned.resident
        == sum(v for k, v in plan.state.items() if "only)" not in k)
        + plan.state["gradient accumulator (updates only)"]
    )


def test_the_plan_cli_on_fake_devices_ends_with_its_verdict():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "train.plan", "--devices", "2", "--mesh", "1,2,1",
           "--device-memory", "1e9", "--preset", "grpo", "--no-log-ref-kl", *TINY]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("run: 8 episodes a step on 8 decode slots, --max-len 23")
    assert lines[2] == "per device (2 device(s)), GiB"
    assert lines[-1].startswith("peak per device: ") and lines[-1].endswith(" of 0.93 GiB: fits")


def test_an_moe_plan_on_a_cpu_plans_its_experts_as_a_grouped_matmul_and_says_so(tmp_path):
    # 30B-A3B's layout in miniature (untied, experts in every layer, real vocabulary): from
    # config.json alone; the note names the assumption the figures rest on.
    import json

    config = json.loads(
        (
            Path(__file__).resolve().parents[1] / "benchmarks/configs/qwen3-30b-a3b/config.json"
        ).read_text()
    )
    config.update(hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, num_experts=16, moe_intermediate_size=16)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    flags = TINY[TINY.index("--prompts-per-step") :]  # the batch flags; the model is the folder's
    cfg = parse_args([*flags, "--model-path", str(tmp_path), "--max-len", "256",
                      "--preset", "grpo", "--no-log-ref-kl", "--run-dir", os.devnull])  # fmt: skip
    plan = make_plan(cfg)
    assert (
        plan.notes
        and "grouped matmul under balanced routing (16 experts, 8 a token)" in (plan.notes[0])
    )
    assert plan.table().endswith(f"note: {plan.notes[0]}")
    assert {p.name for p in plan.programs} >= {"sampler decode", "training micro-step (actor)"}


def test_a_plan_that_does_not_fit_is_refused_at_start_naming_the_flags(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = run.main([*TINY, "--device-memory", "300000", "--run-dir", str(run_dir)])
    assert code == 2
    err = capsys.readouterr().err
    assert "refused (nothing was written): the memory plan does not fit:" in err
    assert "nothing on 1 device(s) fits" in err and "try 8 devices with fsdp (--mesh 1,8,1" in err
    assert "a minibatch's 4 rows must split over them" in err  # and what that takes
    assert not run_dir.exists()


def test_each_knob_lowers_to_the_share_that_fits_and_stops_at_its_floor():
    from train.plan import _lowered

    cfg = parse_args([*TINY, "--run-dir", os.devnull])  # 8 episodes, micro-batches of 2 rows
    assert _lowered(cfg, "remat", 23) == {"remat": "full"}
    assert _lowered(dataclasses.replace(cfg, remat="full"), "remat", 23) is None
    # slots: at least halved; cut at once to the power of two below the share that fits
    assert _lowered(cfg, "slots", 23, 0.9) == {"engine": "continuous", "slots": 4}
    assert _lowered(cfg, "slots", 23, 0.3) == {"engine": "continuous", "slots": 2}
    assert _lowered(cfg, "slots", 23, -1.0)["slots"] == 1  # nothing beside it fits: the floor
    assert _lowered(dataclasses.replace(cfg, slots=1), "slots", 23) is None
    # micro-batches of 2 rows of 24 padded tokens (48 tokens): halved is one row, the floor
    assert _lowered(cfg, "micro_batch_tokens", 23) == {"micro_batch_tokens": 24, "micro_batches": 1}
    budget = dataclasses.replace(cfg, micro_batches=1, micro_batch_tokens=4096)
    assert _lowered(budget, "micro_batch_tokens", 23, 0.1)["micro_batch_tokens"] == 256
    one_row = dataclasses.replace(cfg, micro_batches=1, micro_batch_tokens=24)
    assert _lowered(one_row, "micro_batch_tokens", 23) is None
    # rows split over 4 devices: one row a device (4 x 24 tokens) is the floor
    four = dataclasses.replace(cfg, micro_batches=1, micro_batch_tokens=96)
    assert _lowered(four, "micro_batch_tokens", 23, ways=4) is None
    assert _lowered(four, "micro_batch_tokens", 23, ways=2)["micro_batch_tokens"] == 48


@pytest.mark.slow  # a search compiles a dozen plans (about two minutes here)
def test_the_plan_proposes_settings_that_fit_and_keeps_the_users_own_flags(tmp_path):
    from train.plan import propose

    at = TINY.index("--micro-batches")
    base = [*TINY[:at], *TINY[at + 2 :], "--run-dir", str(tmp_path)]
    cfg = parse_args(base)  # TINY without its --micro-batches: left to the search
    default = make_plan(cfg)
    floor = make_plan(parse_args([*base, "--slots", "1", "--remat", "full",
                                  "--micro-batch-tokens", "1"]))  # fmt: skip
    assert floor.peak < default.peak
    limit = (default.peak + floor.peak) // 2
    proposal = propose(cfg, limit=limit, given=cfg.given_fields)
    assert proposal.plan.fits and proposal.changes and not proposal.blocked
    assert "with the settings chosen: --" in proposal.verdict()
    # the line it prints, pasted back as flags, is a plan that fits
    pasted = parse_args([*base, *proposal.flags().split()])
    assert make_plan(pasted, limit=limit).fits
    # the user's own flags are never changed; the verdict names the change that would fit
    mine = parse_args([*base, "--micro-batches", "2", "--remat", "none", "--slots", "8"])
    tight = (make_plan(mine).peak + floor.peak) // 2
    held = propose(mine, limit=tight, given=mine.given_fields)
    assert not held.plan.fits and held.blocked and held.cfg.remat == "none"
    assert "instead it fits" in held.verdict()
    assert make_plan(dataclasses.replace(mine, **held.blocked), limit=tight).fits


def test_where_full_fine_tuning_cannot_fit_the_proposer_turns_lora_on_unless_told_not_to():
    from train.plan import PROPOSED_LORA_RANK, propose

    wide = list(TINY)
    wide[wide.index("--width") + 1] = "256"  # adapters small beside the weights they sit on
    cfg = parse_args([*wide, "--run-dir", os.devnull])
    full = make_plan(cfg)
    assert "reference parameters" in full.state
    limit = full.resident_state // 2  # the weights, moments and reference alone do not fit
    proposal = propose(cfg, limit=limit, given=cfg.given_fields)
    assert proposal.plan.fits and proposal.changes["lora_rank"] == PROPOSED_LORA_RANK
    state = proposal.plan.state
    assert "reference parameters" not in state and "actor parameters" not in state
    base = next(v for k, v in state.items() if k.startswith("base parameters"))
    assert state["actor optimizer state"] < base  # moments for the adapters alone
    assert f"--lora-rank {PROPOSED_LORA_RANK}" in proposal.verdict()
    # full fine-tuning asked for explicitly: kept, and the refusal names LoRA as a way out
    explicit = parse_args([*wide, "--run-dir", os.devnull, "--lora-rank", "0"])
    kept = propose(explicit, limit=limit, given=explicit.given_fields)
    assert not kept.plan.fits and "lora_rank" not in kept.changes
    assert f"or LoRA (--lora-rank {PROPOSED_LORA_RANK}" in kept.verdict()


def test_the_device_count_named_is_the_fewest_on_which_every_program_would_fit():
    from train.plan import Plan, Program, devices_needed, way_out

    gib = 2**30
    # an update of 40 GiB of state, a micro-step whose one row of activations (6 GiB) stays
    # whole and whose gradients (8 GiB) divide, plus the 2 GiB of weights fsdp gathers for it
    update = Program("optimizer update (actor)", 24 * gib, 16 * gib, "", shardable=24 * gib)
    step = Program("training micro-step (actor)", 14 * gib, 40 * gib, "", 8 * gib, 2 * gib)
    plan = Plan(1, {"actor parameters": 16 * gib}, [update, step], 20 * gib)
    assert step.peak_on(1) == step.peak == 54 * gib  # one device: as planned, nothing gathered
    assert step.peak_on(4) == 12 * gib + 6 * gib + 2 * gib
    assert devices_needed(plan, 20 * gib) == 4  # 2 devices: 24 + 8 = 32 GiB; 4: 20 GiB
    assert devices_needed(plan, 19 * gib) == 8
    # the undivided part (6 + 2 GiB) alone does not fit: no device count does
    assert devices_needed(plan, 8 * gib) is None
    # on 8 devices already, the count named is a multiple of them
    assert devices_needed(dataclasses.replace(plan, devices=8), 20 * gib) == 32
    # what the refusal says: the count and its estimate; the split rule; or no count at all
    said = way_out(plan, plan, 20 * gib, minibatch_rows=64)
    assert "try 4 devices with fsdp (--mesh 1,4,1: about 20.00 GiB a device" in said
    assert "must split" not in said and "a minibatch's 6 rows must split over them" in (
        way_out(plan, plan, 20 * gib, minibatch_rows=6)
    )
    said = way_out(plan, plan, 8 * gib, minibatch_rows=64)
    assert "nor on any number of devices with fsdp: training micro-step (actor) keeps" in said
    assert "try a shorter --max-len" in said


@pytest.mark.slow  # three plans at 1 device and a search at 16 (about a minute here)
@pytest.mark.timeout(1300)
def test_a_refusal_names_a_device_count_that_applied_fits(tmp_path):
    import re

    from train.plan import propose

    at = TINY.index("--micro-batches")
    flags = [*TINY[:at], *TINY[at + 2 :]]
    flags[flags.index("--prompts-per-step") + 1] = "16"  # a minibatch's rows split over 16
    flags += ["--lora-rank", "0"]  # full fine-tuning asked for: the proposer keeps it
    cfg = parse_args([*flags, "--run-dir", os.devnull])
    limit = make_plan(cfg).resident_state // 2  # the weights and moments alone do not fit
    proposal = propose(cfg, limit=limit, given=cfg.given_fields)
    assert not proposal.plan.fits
    named = re.search(r"try (\d+) devices with fsdp \(--mesh 1,(\d+),1", proposal.verdict())
    assert named and named[1] == named[2], proposal.verdict()
    n = named[1]
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "train.plan", "--devices", n, "--mesh", f"1,{n},1",
           "--device-memory", str(limit), *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("peak per device: ")
    assert ": fits" in out.stdout.strip().splitlines()[-1]
