"""Throughput of the advantage estimators against the per-timestep loop and a copy floor.

    python benchmarks/advantages.py [--reps 5] [--sizes 16x4096,256x32768]

For each B x T, a batch with realistic multi-turn structure (a prompt, assistant turns of 50-400
tokens, tool observations of 100-800 tokens, padding) is timed for:

* ``token_gae`` and ``multiscale_advantages`` (jitted, both scan strategies);
* the per-timestep loop that verl / TRL / OpenRLHF use, vectorised over the batch in NumPy, with
  the same semantics (observation tokens skipped; for MAE a reverse and a forward pass);
* a copy floor: one jitted pass that reads the inputs and writes one output.

Every number is the median of ``--reps`` runs in this process; the table prints Mtok/s (B*T
tokens per second) and the ratios that matter: speed-up over the loop and share of the floor.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mpo_jax import advantages as A

GAMMA, LAM = 1.0, 0.95
MAE = dict(gamma_turn=1.0, lam_turn=0.95, gamma_token=1.0, lam_token=0.95, beta=0.5)


def make_batch(b: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, t), bool)
    tid = np.full((b, t), -1, np.int32)
    for i in range(b):
        pos = int(rng.integers(128, 512))
        end = int(t * rng.uniform(0.7, 1.0))  # padding at the end
        k = 0
        while pos < end:
            n = int(rng.integers(50, 400))
            mask[i, pos : min(pos + n, end)] = True
            tid[i, pos : min(pos + n, end)] = k
            k += 1
            pos += n + int(rng.integers(100, 800))
    rewards = np.zeros((b, t), np.float32)
    last = t - 1 - np.argmax(mask[:, ::-1], axis=1)
    rewards[np.arange(b), last] = rng.integers(0, 2, size=b)
    values = rng.normal(size=(b, t)).astype(np.float32)
    return rewards, values, mask, tid


def loop_token_gae(r, v, m, gamma, lam):
    """verl-style reverse loop over timesteps, vectorised over the batch, skipping observations."""
    b, t = r.shape
    adv = np.zeros_like(r)
    last = np.zeros(b, r.dtype)
    next_v = np.zeros(b, r.dtype)
    for j in range(t - 1, -1, -1):
        mj = m[:, j]
        delta = r[:, j] + gamma * next_v - v[:, j]
        new = delta + gamma * lam * last
        last = np.where(mj, new, last)
        next_v = np.where(mj, v[:, j], next_v)
        adv[:, j] = np.where(mj, new, 0)
    return adv, np.where(m, adv + v, 0)


def loop_multiscale(r, v, m, tid, gamma_turn, lam_turn, gamma_token, lam_token, beta):
    """The same MAE semantics as one reverse per-timestep loop (trace, turn sums, A_k when a turn
    closes), then a vectorised gather that broadcasts A_k and the trace mean over each turn."""
    b, t = r.shape
    n_turns = int(tid.max()) + 2
    rows = np.arange(b)
    turn_adv = np.zeros((b, n_turns), r.dtype)
    trace_mean = np.zeros((b, n_turns), r.dtype)
    trace = np.zeros_like(r)
    zeros = np.zeros(b, r.dtype)
    cur = np.full(b, -1)  # turn id of the action token visited last (to the right)
    next_v = zeros.copy()  # V of that token (0 after the last: the episode ended)
    v_next_turn, a_next_turn = zeros.copy(), zeros.copy()  # V_{s_{k+1}}, A_{k+1}
    a_trace, r_sum, tr_sum, count = zeros.copy(), zeros.copy(), zeros.copy(), zeros.copy()

    def close(sel):  # turn `cur` is complete: its first token was the last one visited
        nonlocal v_next_turn, a_next_turn
        a_k = r_sum + gamma_turn * v_next_turn - next_v + gamma_turn * lam_turn * a_next_turn
        turn_adv[rows[sel], cur[sel]] = a_k[sel]
        trace_mean[rows[sel], cur[sel]] = (tr_sum / np.maximum(count, 1))[sel]
        a_next_turn = np.where(sel, a_k, a_next_turn)
        v_next_turn = np.where(sel, next_v, v_next_turn)

    for j in range(t - 1, -1, -1):
        mj = m[:, j]
        is_end = mj & (tid[:, j] != cur)
        close(is_end & (cur >= 0))
        r_sum, tr_sum, count = (np.where(is_end, 0, x) for x in (r_sum, tr_sum, count))
        nv = np.where(is_end, v_next_turn, next_v)
        g = np.where(is_end, gamma_turn, gamma_token)
        carry = np.where(is_end, 0, gamma_token * lam_token) * a_trace
        a_new = r[:, j] + g * nv - v[:, j] + carry
        a_trace = np.where(mj, a_new, a_trace)
        trace[:, j] = np.where(mj, a_new, 0)
        r_sum = np.where(mj, r_sum + r[:, j], r_sum)
        tr_sum = np.where(mj, tr_sum + a_new, tr_sum)
        count = np.where(mj, count + 1, count)
        cur = np.where(mj, tid[:, j], cur)
        next_v = np.where(mj, v[:, j], next_v)
    close(cur >= 0)
    idx = np.maximum(tid, 0)
    per_turn = np.take_along_axis(turn_adv, idx, 1) - beta * np.take_along_axis(trace_mean, idx, 1)
    return np.where(m, per_turn + beta * trace, 0)


def check_loops_agree(r, v, m, tid):
    """The baselines must compute what we compute, or the comparison means nothing."""
    ours = A.token_gae(r, v, m, gamma=GAMMA, lam=LAM)
    for x, y in zip(ours, loop_token_gae(r, v, m, GAMMA, LAM), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-3)
    ours = A.multiscale_advantages(r, v, m, tid, **MAE)
    np.testing.assert_allclose(ours, loop_multiscale(r, v, m, tid, **MAE), atol=1e-3)


def timed(fn, reps):
    jax.block_until_ready(fn())  # compile / warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_size(b: int, t: int, reps: int, loop_reps: int) -> str:
    r, v, m, tid = make_batch(b, t)
    n = min(t, 4096)
    check_loops_agree(r[:4, :n], v[:4, :n], m[:4, :n], tid[:4, :n])
    rj, vj, mj, tj = (jnp.asarray(x) for x in (r, v, m, tid))
    floor = jax.jit(lambda r, v, m, tid: jnp.where(m & (tid >= 0), r + v, 0))
    row = {"floor": timed(lambda: floor(rj, vj, mj, tj), reps)}
    for method in ("sequential", "associative"):
        gae = jax.jit(functools.partial(A.token_gae, gamma=GAMMA, lam=LAM, method=method))
        mae = jax.jit(functools.partial(A.multiscale_advantages, method=method, **MAE))
        row[f"gae_{method}"] = timed(lambda gae=gae: gae(rj, vj, mj), reps)
        row[f"mae_{method}"] = timed(lambda mae=mae: mae(rj, vj, mj, tj), reps)
    row["gae_loop"] = timed(lambda: loop_token_gae(r, v, m, GAMMA, LAM), loop_reps)
    row["mae_loop"] = timed(lambda: loop_multiscale(r, v, m, tid, **MAE), loop_reps)
    mtok = {k: f"{b * t / 1e6 / x:.0f}" for k, x in row.items()}
    cells = [f"{b} x {t}", mtok["floor"]]
    for est in ("gae", "mae"):
        cells += [mtok[f"{est}_sequential"], mtok[f"{est}_associative"], mtok[f"{est}_loop"]]
        cells.append(f"{row[f'{est}_loop'] / row[f'{est}_sequential']:.1f}x")
        cells.append(f"{100 * row['floor'] / row[f'{est}_sequential']:.0f}%")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--loop-reps", type=int, default=1)
    parser.add_argument("--sizes", default="16x4096,16x32768,256x4096,256x32768")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, float32, median of {args.reps}")
    header = (
        "| B x T | floor | token_gae seq | assoc | loop | x loop | % floor "
        "| MAE seq | assoc | loop | x loop | % floor |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for size in args.sizes.split(","):
        b, t = (int(x) for x in size.split("x"))
        print(bench_size(b, t, args.reps, args.loop_reps), flush=True)
    print("Mtok/s unless marked; 'x loop' = loop time / our time; '% floor' = floor time / ours.")


if __name__ == "__main__":
    main()
