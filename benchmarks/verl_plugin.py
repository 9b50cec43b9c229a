"""The verl plugin's overhead against verl's own GAE, on the same batch.

    python benchmarks/verl_plugin.py [--reps 5] [--size 256x8192] [--device cpu|cuda]

verl's ``compute_advantage`` (the function its trainers call) on one real ``DataProto`` of the
``agentic`` layout of ``benchmarks/advantages.py`` (assistant turns of 20-400 tokens between
observations of 10-300; float32 torch tensors, the outcome on each row's last sampled token):

* ``verl gae``: verl's own estimator (``compute_gae_advantage_return``, a reverse loop over the
  columns in torch, plus its whitening);
* ``mpo`` and ``turn_gae``: ours through the plugin (``mpo_jax.integrations.verl``), the DLPack
  crossings, the padding to the shape bucket and the critic's returns included;
* ``crossings``: the DLPack round trip of the four [B, R] tensors alone (torch -> JAX -> torch).

Times are the median of ``--reps`` warm calls (a trainer calls it every step with the same
bucket); the first call, compilation included, is printed beside it. ``x gae`` = verl's time over
ours (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from advantages import make_batch  # noqa: E402  (the layouts of benchmarks/advantages.py)
from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import ray_trainer  # noqa: E402

import mpo_jax.integrations.verl as mpo_verl  # noqa: E402

CONFIG = OmegaConf.create({"gamma": 1.0, "lam": 0.95, "use_pf_ppo": False, "mpo": {"beta": 0.5}})


def _data(rewards, values, mask, device) -> DataProto:
    tensors = {
        "token_level_rewards": torch.tensor(rewards, device=device),
        "values": torch.tensor(values, device=device),
        "response_mask": torch.tensor(mask, dtype=torch.float32, device=device),
    }
    return DataProto.from_dict(tensors=tensors)


def _time(fn, reps: int) -> tuple[float, float]:
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size", default="256x8192")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    b, t = (int(x) for x in args.size.split("x"))
    rewards, values, mask, _ = make_batch(b, t, "agentic")
    rewards, values = np.asarray(rewards, np.float32), np.asarray(values, np.float32)
    data = _data(rewards, values, mask, args.device)

    def estimator(name):
        return lambda: ray_trainer.compute_advantage(
            data, adv_estimator=name, gamma=1.0, lam=0.95, config=CONFIG
        ).batch["advantages"].sum().item()  # fmt: skip

    def crossings():
        for key in ("token_level_rewards", "values", "response_mask", "token_level_rewards"):
            tensor = data.batch[key]
            mpo_verl._to_torch(mpo_verl._to_jax(tensor), tensor)

    rows = [("verl gae", estimator("gae")), ("mpo", estimator("mpo")),
            ("turn_gae", estimator("turn_gae")), ("crossings", crossings)]  # fmt: skip
    results = {name: _time(fn, args.reps) for name, fn in rows}
    base = results["verl gae"][0]
    print(f"verl compute_advantage on [{b}, {t}] ({args.device}, float32, agentic layout, "
          f"{mask.mean():.0%} sampled tokens), median of {args.reps}")  # fmt: skip
    print(f"| {'estimator':<10} | {'ms':>9} | {'first call ms':>13} | {'x gae':>6} |")
    print(f"|{'-' * 12}|{'-' * 11}|{'-' * 15}|{'-' * 8}|")
    for name, (median, first) in results.items():
        print(f"| {name:<10} | {median * 1e3:9.1f} | {first * 1e3:13.1f} | {base / median:6.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
