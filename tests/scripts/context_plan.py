"""Run in a fresh process with 4 forced host devices (see tests/test_context.py): the memory plan
with each row split over ``context``, and the proposer turning to it when one row of --max-len
does not fit a device at every other knob's floor. Prints PLAN_OK."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import dataclasses  # noqa: E402

from train.core.config import parse_args  # noqa: E402
from train.plan import floor_settings, make_plan, propose  # noqa: E402

FLAGS = ["--layers", "2", "--width", "64", "--heads", "4", "--kv-heads", "2",
         "--prompts-per-step", "4", "--group-size", "2", "--minibatches", "1",
         "--eval-every", "0", "--no-progress", "--max-len", "4096", "--max-new-tokens", "64",
         "--preset", "grpo", "--no-log-ref-kl", "--run-dir", os.devnull]  # fmt: skip


def plan(mesh: str, **settings):
    cfg = parse_args([*FLAGS, "--mesh", mesh])
    floor = dataclasses.replace(cfg, **floor_settings(4096), **settings)
    return cfg, make_plan(floor)


def training(p) -> int:
    return next(x.peak for x in p.programs if x.name.startswith("training micro-step"))


_, fsdp = plan("1,4,1")
_, split = plan("1,1,1,4")
print("floor peaks, fsdp 4:", fsdp.peak, "context 4:", split.peak)
print("training micro-step, fsdp 4:", training(fsdp), "context 4:", training(split))
assert training(split) < 0.6 * training(fsdp), (training(split), training(fsdp))
limit = (fsdp.peak + split.peak) // 2
assert not fsdp.fits_on(limit) if hasattr(fsdp, "fits_on") else fsdp.peak > limit

# the user's own --mesh 1,4,1: kept, and the verdict names the mesh that fits
cfg = parse_args([*FLAGS, "--mesh", "1,4,1"])
held = propose(cfg, limit=limit, given=cfg.given_fields)
print(held.verdict())
assert not held.plan.fits and held.blocked.get("mesh", "").endswith(",4") or \
    held.blocked.get("mesh", "").endswith(",2"), held.blocked  # fmt: skip
assert "--mesh 1," in held.verdict() and "instead it fits" in held.verdict()
# no --mesh given: the proposer chooses the context axis itself
cfg = parse_args(FLAGS)
chosen = propose(cfg, limit=limit, given=cfg.given_fields)
print(chosen.verdict())
assert chosen.plan.fits and chosen.changes["mesh"].split(",")[3] != "1", chosen.changes
print("PLAN_OK")
