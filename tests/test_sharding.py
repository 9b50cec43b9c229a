"""Sharding: the rules table, and a sharded update equal to the single-device one (8 forced host
devices, in a subprocess because the device count is fixed when JAX starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from train.qwen3 import ModelConfig, Qwen3ForCausalLM
from train.sharding import make_mesh, param_shardings


def test_sharded_update_equals_single_device_update():
    script = Path(__file__).parent / "scripts" / "sharded_step.py"
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "MAX_DIFF" in out.stdout and "TRAINER_OK" in out.stdout


def test_rules_map_logical_names_to_mesh_axes():
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
    )
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    mesh = make_mesh(data=1, devices=jax.devices()[:1])
    specs = param_shardings(nnx.state(model), mesh)
    # one device: everything replicated whatever the rules say
    assert all(
        s.spec == PartitionSpec(None, None) or s.spec == PartitionSpec(None) for s in specs.values()
    )
    with pytest.raises(ValueError, match="needs 8 devices"):
        make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:1])
