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

from tests.models import tiny_model_config
from train.model.qwen3 import Qwen3ForCausalLM
from train.model.sharding import make_mesh, param_shardings


def test_sharded_update_equals_single_device_update_full_and_lora():
    script = Path(__file__).parent / "scripts" / "sharded_step.py"
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "MAX_DIFF" in out.stdout and "TRAINER_OK" in out.stdout and "LORA_OK" in out.stdout
    assert "LORA_EQUAL" in out.stdout


def test_rules_map_logical_names_to_mesh_axes():
    cfg = tiny_model_config(num_layers=1)
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    mesh = make_mesh(data=1, devices=jax.devices()[:1])
    specs = param_shardings(nnx.state(model), mesh)
    # one device: everything replicated whatever the rules say
    assert all(all(axis is None for axis in s.spec) for s in specs.values())
    with pytest.raises(ValueError, match="needs 8 devices"):
        make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:1])


MULTIHOST_FLAGS = [
    "--steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--layers", "1",
    "--width", "32", "--heads", "4", "--kv-heads", "2", "--eval-every", "0",
    "--minibatches", "1", "--micro-batches", "1", "--no-progress",
    "--warmup-steps", "0",  # the full learning rate from the first update
    "--entropy-coef", "0.01",  # a gradient for the actor even if no episode succeeds
    # each host's engine: 4 episodes on 3 slots, tools on 2 threads, chunks of 4 steps
    "--slots", "3", "--env-workers", "2", "--decode-chunk", "4",
]  # fmt: skip


@pytest.mark.parametrize(
    "mesh",
    [
        "2,2,1",
        # each row's tokens over 4 devices, 2 in each process (a slow-suite variant)
        pytest.param("1,1,1,4", marks=pytest.mark.slow),
    ],
)
def test_two_processes_on_loopback_run_a_sharded_step(tmp_path, mesh):
    """jax.distributed over two local processes: each rolls out its share of the tasks, both
    assemble the same global batch, and the sharded update equals the one-process update of
    that batch (data x fsdp across the processes, or the context axis across them)."""
    import dataclasses
    import socket

    import numpy as np

    from envs.rollout import Rollouts
    from mpo_jax import algorithms
    from mpo_jax.batch import TurnBatch
    from train.core.config import parse_args
    from train.core.trainer import Trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).parent / "scripts" / "multihost_step.py"
    root = Path(__file__).parent.parent
    procs = []
    for pid in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
            "MULTIHOST_MESH": mesh,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path), *MULTIHOST_FLAGS],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    p0, p1 = (dict(np.load(tmp_path / f"process{i}.npz")) for i in range(2))
    # both processes hold the same global batch: process 0's rows, then process 1's
    assert (p0["global/tokens"] == p1["global/tokens"]).all()
    assert (p0["global/tokens"] == np.concatenate([p0["local_tokens"], p1["local_tokens"]])).all()
    assert not (p0["local_tokens"] == p1["local_tokens"]).all()  # different tasks per host
    assert sorted(set(p0["global/group_ids"].tolist())) == [0, 1, 2, 3]
    # ... and the same parameters after the update
    params = [k for k in p0 if k.startswith(("actor/", "critic/"))]
    assert all((p0[k] == p1[k]).all() for k in params)
    # The one-process update of the same global batch, from the same initial parameters.
    trainer = Trainer(parse_args(MULTIHOST_FLAGS + ["--run-dir", str(tmp_path / "single")]))
    names = {f.name for f in dataclasses.fields(TurnBatch)}
    fields = {k.split("/", 1)[1]: v for k, v in p0.items() if k.startswith("global/")}
    batch = TurnBatch(**{k: v for k, v in fields.items() if k in names})
    rows = len(batch.tokens)
    rollouts = Rollouts(batch, p0["boundary_lengths"], [[] for _ in range(rows)], [], 0.0)
    from flax import nnx

    initial = {
        f"{which}/" + "/".join(map(str, path)): np.asarray(var.get_value())
        for which in ("actor", "critic")
        for path, var in nnx.to_flat_state(trainer.state[which])
    }
    # the step did update the actor (the entropy bonus), and the critic when a reward came in
    updated = ["actor/"] + (["critic/"] if p0["global/rewards"].any() else [])
    for which in updated:
        assert any(
            not np.array_equal(v, p0[k]) for k, v in initial.items() if k.startswith(which)
        ), which
    scored, _ = trainer.score(rollouts)
    update = trainer.update(scored, algorithms.compute_advantages(trainer.algo, scored))

    single = {
        f"{which}/" + "/".join(map(str, path)): np.asarray(var.get_value())
        for which in ("actor", "critic")
        for path, var in nnx.to_flat_state(trainer.state[which])
    }
    assert set(single) == set(params)
    worst = max(float(np.max(np.abs(single[k] - p0[k]))) for k in params)
    # Adam's first step turns gradient noise near eps into a small fraction of lr (1e-3)
    assert worst < 1e-4, worst
    assert abs(update["policy_loss"] - float(p0["policy_loss"])) < 1e-5


def test_distributed_set_up_reads_the_environment(monkeypatch):
    from train.core import distributed

    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                "MPO_JAX_DISTRIBUTED", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                "TPU_WORKER_HOSTNAMES"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize_from_env() is False  # nothing set: one process
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.initialize_from_env() is False  # a one-task SLURM job is one process
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID must be set"):
        distributed.initialize_from_env()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID: must be in \[0, 2\), got 2"):
        distributed.initialize_from_env()


def test_one_process_owns_everything():
    import numpy as np

    from train.core import distributed

    assert distributed.host_share(6) == slice(0, 6)
    x = np.arange(6).reshape(3, 2)
    assert (distributed.gather_array(x) == x).all()
    assert (distributed.to_host(jax.numpy.asarray(x)) == x).all()
