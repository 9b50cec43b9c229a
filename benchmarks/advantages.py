"""Speed of the advantage estimators against the per-timestep loop the peers run.

    python benchmarks/advantages.py [--reps 5] [--sizes 16x4096,256x4096,256x32768]

The baseline is verl's GAE loop (``compute_gae_advantage_return`` with a response mask): a reverse
loop over timesteps, vectorised over the batch in NumPy, carrying the next action token's value
and the running advantage and blending them with the mask on observation tokens. It is checked
equal to :func:`mpo_jax.advantages.token_gae` before timing, and it is the baseline for both
estimators (the peers have no MAE; MAE must still beat the loop they would write for GAE).

Two layouts, every row filled with turns the way an agent's conversation is:

* ``agentic``: a 10-token prompt, assistant turns of 20-400 tokens, observations of 10-300
  tokens, repeated until the row is full (no padding; about 57% action tokens);
* ``long-context``: a 128-512-token prompt, turns of 50-400, observations of 100-800, and 0-30%
  padding at the end (about 29% action tokens).

Every time is the median of ``--reps`` warm calls in this process (a trainer calls the estimator
every step with the same shapes, so compilation is paid once); the first call, compilation
included, is printed beside it. Times in milliseconds; ``x loop`` = loop time / ours.
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
LAYOUTS = {
    # prompt length, turn length, observation length (ranges inclusive), padded share of the row
    "agentic": ((10, 10), (20, 400), (10, 300), (0.0, 0.0)),
    "long-context": ((128, 511), (50, 399), (100, 799), (0.0, 0.3)),
}


def make_batch(b: int, t: int, layout: str = "agentic", seed: int = 0):
    """(rewards, values, loss_mask, turn_ids) with the layout's structure; outcome on the last
    action token, random values."""
    (p_lo, p_hi), (n_lo, n_hi), (o_lo, o_hi), (pad_lo, pad_hi) = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, t), bool)
    tid = np.full((b, t), -1, np.int32)
    for i in range(b):
        pos = int(rng.integers(p_lo, p_hi + 1))
        end = t - int(t * rng.uniform(pad_lo, pad_hi))
        k = 0
        while pos < end:
            n = int(rng.integers(n_lo, n_hi + 1))
            mask[i, pos : min(pos + n, end)] = True
            tid[i, pos : min(pos + n, end)] = k
            k += 1
            pos += n + int(rng.integers(o_lo, o_hi + 1))
    rewards = np.zeros((b, t), np.float32)
    last = t - 1 - np.argmax(mask[:, ::-1], axis=1)
    rewards[np.arange(b), last] = rng.integers(0, 2, size=b)
    values = rng.normal(size=(b, t)).astype(np.float32)
    return rewards, values, mask, tid


def peer_gae_loop(r, v, m, gamma, lam):
    """verl's masked GAE loop, in NumPy over [B, T] arrays (their torch code, line for line)."""
    b, t = r.shape
    mf = m.astype(r.dtype)
    next_v = np.zeros(b, r.dtype)
    last = np.zeros(b, r.dtype)
    reversed_adv = []
    for j in reversed(range(t)):
        delta = r[:, j] + gamma * next_v - v[:, j]
        new = delta + gamma * lam * last
        next_v = v[:, j] * mf[:, j] + (1 - mf[:, j]) * next_v
        last = new * mf[:, j] + (1 - mf[:, j]) * last
        reversed_adv.append(last)
    adv = np.stack(reversed_adv[::-1], axis=1)
    return adv * mf, (adv + v) * mf


def loop_multiscale(r, v, m, tid, gamma_turn, lam_turn, gamma_token, lam_token, beta):
    """MAE as one reverse per-timestep loop (trace, turn sums, A_k when a turn closes), then a
    vectorised gather that broadcasts A_k and the trace mean over each turn: an independent
    transcription that the check below holds ours to (not timed: the peers have no MAE)."""
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
    for x, y in zip(ours, peer_gae_loop(r, v, m, GAMMA, LAM), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-3)
    ours = A.multiscale_advantages(r, v, m, tid, **MAE)
    np.testing.assert_allclose(ours, loop_multiscale(r, v, m, tid, **MAE), atol=1e-3)


def timed(fn, reps):
    """(first call, compilation included; median of ``reps`` warm calls), seconds."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def bench(layout: str, b: int, t: int, reps: int, loop_reps: int) -> str:
    r, v, m, tid = make_batch(b, t, layout)
    n = min(t, 4096)
    check_loops_agree(r[:4, :n], v[:4, :n], m[:4, :n], tid[:4, :n])
    rj, vj, mj, tj = (jnp.asarray(x) for x in (r, v, m, tid))
    _, loop = timed(lambda: peer_gae_loop(r, v, m, GAMMA, LAM), loop_reps)
    row = {}
    for method in ("sequential", "associative"):
        gae = jax.jit(functools.partial(A.token_gae, gamma=GAMMA, lam=LAM, method=method))
        mae = jax.jit(functools.partial(A.multiscale_advantages, method=method, **MAE))
        row["gae", method] = timed(lambda gae=gae: gae(rj, vj, mj), reps)
        row["mae", method] = timed(lambda mae=mae: mae(rj, vj, mj, tj), reps)
    ms = lambda x: f"{1e3 * x:.0f}"  # noqa: E731
    pad = 1 - np.maximum.accumulate(m[:, ::-1], axis=1)[:, ::-1].mean()  # after the last action
    cells = [layout, f"{b} x {t}", f"{100 * m.mean():.0f}%", f"{100 * pad:.0f}%", ms(loop)]
    for est in ("gae", "mae"):
        first, warm = row[est, "sequential"]
        cells += [ms(warm), f"**{loop / warm:.1f}x**", ms(row[est, "associative"][1]), ms(first)]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--loop-reps", type=int, default=3)
    parser.add_argument("--sizes", default="16x4096,256x4096,256x32768")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    print(f"jax {jax.__version__} on {platform}, float32, median of {args.reps} warm calls")
    header = (
        "| layout | B x T | action | tail pad | peer loop | token_gae | x loop | assoc | 1st call "
        "| MAE | x loop | assoc | 1st call |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for layout in args.layouts.split(","):
        for size in args.sizes.split(","):
            b, t = (int(x) for x in size.split("x"))
            print(bench(layout, b, t, args.reps, args.loop_reps), flush=True)
    print(
        "ms per call; token_gae / MAE: the sequential (default) form, warm; assoc: "
        "method='associative', warm; 1st call: the sequential form's first call, compile included."
    )


if __name__ == "__main__":
    main()
