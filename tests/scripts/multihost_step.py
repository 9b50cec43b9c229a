"""One process of a two-process run on loopback (see tests/test_sharding.py): jax.distributed
from the environment, 2 forced CPU devices per process, one trainer step on a (data 2, fsdp 2)
mesh spanning both processes (or ``MULTIHOST_MESH``'s). Writes what it saw to OUT/process<i>.npz."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
)

from train.core.distributed import initialize_from_env, to_host  # noqa: E402

assert initialize_from_env(), "the JAX_* variables were not set"

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mpo_jax import algorithms  # noqa: E402
from train.core import trainer as trainer_module  # noqa: E402
from train.core.config import parse_args  # noqa: E402

out_dir, flags = sys.argv[1], sys.argv[2:]
assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
mesh = os.environ.get("MULTIHOST_MESH", "2,2,1")  # 1,1,1,4: the context axis over both
cfg = parse_args(flags + ["--mesh", mesh, "--run-dir", os.path.join(out_dir, "run")])
trainer = trainer_module.Trainer(cfg)
kernel = trainer.state["actor"]["model"]["layers"][0]["layer"]["mlp"]["gate_proj"][
    "kernel"
].get_value()
assert not kernel.is_fully_addressable  # the parameters really span both processes

seen = {}
original = trainer_module.gather_rollouts


def spy(local):
    seen["local_tokens"] = np.array(local.batch.tokens)
    return original(local)


trainer_module.gather_rollouts = spy
rollouts = trainer.rollout(0)
# the environments' own figures and the turn grades travel with the gathered episodes
rows = len(rollouts.batch.tokens)
assert len(rollouts.episodes) == rows and all("tool_calls" in e for e in rollouts.episodes)
assert rollouts.turn_quality.shape[0] == rows
batch, _ = trainer.score(rollouts)
credit = algorithms.compute_advantages(trainer.algo, batch)
metrics = trainer.update(batch, credit)

flat = lambda state: {  # noqa: E731
    "/".join(map(str, path)): to_host(var.get_value()) for path, var in nnx.to_flat_state(state)
}
saved = {
    f"global/{f.name}": np.asarray(getattr(rollouts.batch, f.name))
    for f in dataclasses.fields(rollouts.batch)
    if getattr(rollouts.batch, f.name) is not None
}
saved["boundary_lengths"] = rollouts.boundary_lengths
saved["local_tokens"] = seen["local_tokens"]
saved.update({f"actor/{k}": v for k, v in flat(trainer.state["actor"]).items()})
saved.update({f"critic/{k}": v for k, v in flat(trainer.state["critic"]).items()})
saved["policy_loss"] = np.array(metrics["policy_loss"])
np.savez(os.path.join(out_dir, f"process{jax.process_index()}.npz"), **saved)
print("MULTIHOST_OK", jax.process_index())
