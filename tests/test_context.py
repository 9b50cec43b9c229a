"""Context parallelism (`train.model.context`): the zigzag layout, the balance it buys, the
``--mesh`` refusals, and (8 forced host devices, in a subprocess) a training step and scoring
with each row split over the ``context`` axis equal to the one-device ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.core.config import parse_args
from train.model.context import from_zigzag, padded_length, to_zigzag, visible_blocks
from train.model.sharding import MeshShape, make_mesh

ROOT = Path(__file__).parent.parent


def _context_script(*args: str) -> str:
    script = ROOT / "tests" / "scripts" / "context_step.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    assert "CONTEXT_OK" in out.stdout
    return out.stdout


def test_a_step_split_over_the_context_axis_equals_the_one_device_step():
    stdout = _context_script("--quick")
    assert stdout.count("max |difference|") == 3  # the kernel, one dense mesh, one MoE mesh


@pytest.mark.slow
@pytest.mark.timeout(1300)  # its script may take the 1200 s _context_script allows
def test_every_context_mesh_equals_the_one_device_step_dense_and_moe():
    stdout = _context_script()
    assert stdout.count("max |difference|") == 11


@pytest.mark.slow  # a search compiles a dozen plans on 4 fake devices (about three minutes)
@pytest.mark.timeout(1300)
def test_the_proposer_splits_a_row_over_context_when_one_row_does_not_fit_a_device():
    script = ROOT / "tests" / "scripts" / "context_plan.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    assert "PLAN_OK" in out.stdout


def test_more_context_takes_devices_from_data_then_fsdp():
    import dataclasses

    from train.plan import more_context

    default = parse_args([])

    def mesh(flag: str, devices: int = 8):
        cfg = dataclasses.replace(default, mesh=flag)
        return (more_context(cfg, devices) or {}).get("mesh")

    assert mesh("") == "4,1,1,2"  # no mesh: data over all of them
    assert mesh("-1,2,1") == "2,2,1,2"
    assert mesh("1,8,1") == "1,4,1,2"
    assert mesh("1,2,1,4") == "1,1,1,8"
    assert mesh("1,1,1,8") is None  # nothing left to give
    assert mesh("1,1,3,2", devices=6) is None  # tensor is never taken


@pytest.mark.parametrize("ways", [1, 2, 3, 4, 8])
def test_zigzag_gives_each_device_one_early_and_one_late_chunk_and_inverts(ways):
    t = padded_length(37, ways)
    assert t % (2 * ways) == 0 and t - 37 < 2 * ways
    cols = jnp.arange(t)[None]
    laid = np.asarray(to_zigzag(cols, ways))[0]
    n = t // (2 * ways)
    for d, part in enumerate(laid.reshape(ways, 2 * n)):
        assert part[:n].tolist() == list(range(d * n, (d + 1) * n))
        late = 2 * ways - 1 - d
        assert part[n:].tolist() == list(range(late * n, (late + 1) * n))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, t, 5)))
    np.testing.assert_array_equal(from_zigzag(to_zigzag(x, ways), ways), x)


def test_zigzag_balances_causal_attention_and_contiguous_does_not():
    contiguous = visible_blocks(32768, 8, 512, zigzag=False)
    zigzag = visible_blocks(32768, 8, 512, zigzag=True)
    assert contiguous.sum() == zigzag.sum()  # the same work in all, spread differently
    assert contiguous.max() / contiguous.mean() > 1.7  # the last device does 2C/(C+1) x
    assert zigzag.max() / zigzag.mean() < 1.05


def test_mesh_takes_three_or_four_sizes_and_refuses_others():
    assert parse_args(["--mesh", "2,2,1"]).mesh_shape() == MeshShape(2, 2, 1, 1)
    assert parse_args(["--mesh=-1,1,1,4"]).mesh_shape() == MeshShape(-1, 1, 1, 4)
    for bad in ("2,2", "1,1,1,2,1", "1,0,1,2", "1,1,1,-1", "a,b,c"):
        with pytest.raises(ValueError, match=r"mesh: expected 'data,fsdp,tensor' or "):
            parse_args([f"--mesh={bad}"])


def test_a_context_size_that_does_not_divide_the_devices_is_refused(tmp_path, capsys):
    n = len(jax.devices())
    with pytest.raises(ValueError, match="not divisible by fsdp x context x tensor x expert"):
        make_mesh(context=n + 1)
    from train import run

    code = run.main(["--mesh", f"1,1,1,{n + 1}", "--run-dir", str(tmp_path / "r")])
    assert code == 2 and not (tmp_path / "r").exists()
    assert "mesh: shape" in capsys.readouterr().err


@pytest.mark.slow  # a proposer's search over Qwen3-8B's programs at 32k (4-9 minutes)
@pytest.mark.timeout(1900)
def test_qwen3_8b_at_32k_fits_eight_95_gb_devices_with_the_row_over_four():
    flags = ["--model-path", str(ROOT / "benchmarks" / "configs" / "qwen3-8b"), "--env", "search",
             "--max-len", "32768", "--devices", "8", "--device-memory", "95e9",
             "--platform", "gpu", "--mesh", "1,2,1,4"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "train.plan", *flags],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    verdict = out.stdout.strip().splitlines()[-1]
    assert verdict.startswith("peak per device") and ": fits" in verdict, verdict
