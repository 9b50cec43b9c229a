"""A tour of the advantage math on a generated multi-turn batch (the default `make run` job).

    python examples/advantage_demo.py [--seed 0]

Builds a small batch of agent trajectories (prompt, assistant turns, tool observations, padding),
with a critic whose values move mostly at turn boundaries, validates it, and prints:

1. one trajectory's tokens with the credit each estimator gives them;
2. per preset (docs/design.md §3): the mean advantage per turn of that trajectory;
3. the checks the library promises (MAE keeps each turn's mean; β = 0 is turn GAE; group
   advantages sum to zero) and the critic diagnostics the trainer logs.
"""

from __future__ import annotations

import argparse

import numpy as np

from mpo_jax import advantages as A
from mpo_jax import algorithms, diagnostics
from mpo_jax.batch import TurnBatch, num_turns, trajectory_sums, turn_mean, validate


def make_batch(seed: int, rows: int = 8, length: int = 64) -> TurnBatch:
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, length), bool)
    tid = np.full((rows, length), -1, np.int32)
    values = np.zeros((rows, length), np.float32)
    rewards = np.zeros((rows, length), np.float32)
    for b in range(rows):
        pos, k = 4, 0
        level = 0.0
        while pos < length - 8 and k < 5:
            n = int(rng.integers(2, 7))
            mask[b, pos : pos + n] = True
            tid[b, pos : pos + n] = k
            level += rng.normal(scale=0.3)  # the critic's value jumps at turn boundaries ...
            values[b, pos : pos + n] = level + rng.normal(scale=0.03, size=n)  # ... then barely
            pos += n + int(rng.integers(3, 9))
            k += 1
        last = np.nonzero(mask[b])[0][-1]
        rewards[b, last] = float(rng.random() < 0.5)
    groups = np.repeat(np.arange(rows // 4), 4).astype(np.int32)
    k = np.asarray(num_turns(mask, tid))
    m = int(k.max())
    bm = np.arange(m)[None] < k[:, None]
    logp = -rng.exponential(size=(rows, length)).astype(np.float32)
    keys = np.where(np.arange(m)[None] < k[:, None], rng.integers(0, 3, size=(rows, m)), -1)
    return TurnBatch(
        tokens=rng.integers(0, 1000, size=(rows, length)).astype(np.int32),
        loss_mask=mask,
        turn_ids=tid,
        rewards=rewards,
        group_ids=groups,
        truncated=np.zeros(rows, bool),
        values=values,
        logp=logp,
        old_logp=logp,
        ref_logp=logp,
        boundary_mask=bm,
        answer_logprobs=np.where(bm, -np.linspace(3, 0.5, m)[None], 0).astype(np.float32),
        step_keys=keys.astype(np.int32),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    batch = make_batch(args.seed)
    validate(batch)
    row = int(np.argmax(trajectory_sums(batch.rewards, batch.loss_mask)))  # a successful one
    m, tid, r, v = batch.loss_mask, batch.turn_ids, batch.rewards, batch.values

    tok, _ = A.token_gae(r, v, m, gamma=1.0, lam=0.95)
    turn, _ = A.turn_gae(r, v, m, tid, gamma=1.0, lam=0.95)
    mae = A.multiscale_advantages(
        r, v, m, tid, gamma_turn=1.0, lam_turn=0.95, gamma_token=1.0, lam_token=0.95, beta=0.5
    )
    print(f"1. Trajectory {row} (reward {float(r[row].sum()):.0f}): credit per action token")
    print("   pos turn   value  token_gae  turn_gae   MAE(β=.5)")
    for t in np.nonzero(m[row])[0]:
        print(
            f"   {t:3d} {tid[row, t]:4d} {v[row, t]:7.3f} {tok[row, t]:10.3f} "
            f"{turn[row, t]:9.3f} {mae[row, t]:11.3f}"
        )

    k = int(num_turns(m, tid)[row])
    print(f"\n2. Mean advantage per turn of trajectory {row}, per preset")
    print("   preset     " + "".join(f"  turn {i:<3d}" for i in range(k)))
    for name in sorted(algorithms.PRESETS):
        credit = algorithms.compute_advantages(algorithms.get(name), batch)
        means = turn_mean(credit.advantages, m, tid)[row]
        per_turn = [float(means[np.nonzero((tid[row] == i) & m[row])[0][0]]) for i in range(k)]
        print(f"   {name:10s} " + "".join(f"{x:10.3f}" for x in per_turn))

    print("\n3. Promises, checked on this batch")
    gap = np.abs(np.asarray(turn_mean(mae, m, tid)) - np.asarray(turn)).max()
    print(f"   MAE keeps every turn's mean advantage: max |turn mean - A_k| = {gap:.1e}")
    mae0 = A.multiscale_advantages(
        r, v, m, tid, gamma_turn=1.0, lam_turn=0.95, gamma_token=1.0, lam_token=0.95, beta=0.0
    )
    print(f"   β = 0 is turn GAE: max difference = {np.abs(mae0 - turn).max():.1e}")
    grpo = A.group_advantages(trajectory_sums(r, m), batch.group_ids)
    sums = [float(np.asarray(grpo)[batch.group_ids == g].sum()) for g in np.unique(batch.group_ids)]
    print(f"   GRPO advantages sum to zero per group: {np.round(sums, 7).tolist()}")
    _, returns = A.token_gae(r, v, m, gamma=1.0, lam=0.95)
    frac = float(diagnostics.median_turn_variance_fraction(v, m, tid))
    ev = float(diagnostics.explained_variance(v, returns, m))
    print(f"   critic: median turn-variance fraction {frac:.1%}, explained variance {ev:.3f}")


if __name__ == "__main__":
    main()
