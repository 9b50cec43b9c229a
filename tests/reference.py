"""Slow, obviously-correct NumPy float64 transcriptions of docs/design.md §3, row by row.

They loop over the compacted action positions exactly as the formulas are written, so the fast
estimators are checked against the math, not against themselves.
"""

from __future__ import annotations

import numpy as np


def _turns(mask_row, tid_row):
    """[(k, [positions of S_k])] in order."""
    cols = np.nonzero(mask_row)[0]
    out = {}
    for c in cols:
        out.setdefault(int(tid_row[c]), []).append(int(c))
    return [(k, out[k]) for k in sorted(out)]


def token_gae(r, v, m, gamma, lam, boot=None):
    b, t = r.shape
    adv = np.zeros((b, t))
    ret = np.zeros((b, t))
    for i in range(b):
        p = np.nonzero(m[i])[0]
        nxt = 0.0 if boot is None else float(boot[i])
        a = 0.0
        for j in reversed(range(len(p))):
            delta = r[i, p[j]] + gamma * nxt - v[i, p[j]]
            a = delta + gamma * lam * a
            adv[i, p[j]] = a
            ret[i, p[j]] = a + v[i, p[j]]
            nxt = v[i, p[j]]
    return adv, ret


def turn_gae(r, v, m, tid, gamma, lam, boot=None):
    b, t = r.shape
    adv = np.zeros((b, t))
    ret = np.zeros((b, t))
    for i in range(b):
        turns = _turns(m[i], tid[i])
        nxt = 0.0 if boot is None else float(boot[i])
        a = 0.0
        for _, s in reversed(turns):
            rk = sum(r[i, c] for c in s)
            delta = rk + gamma * nxt - v[i, s[0]]
            a = delta + gamma * lam * a
            for c in s:
                adv[i, c] = a
                ret[i, c] = a + v[i, s[0]]
            nxt = v[i, s[0]]
    return adv, ret


def multiscale(r, v, m, tid, gt, lt, gk, lk, beta, boot=None):
    turn_adv, _ = turn_gae(r, v, m, tid, gt, lt, boot)
    out = np.zeros_like(turn_adv)
    for i in range(r.shape[0]):
        turns = _turns(m[i], tid[i])
        for idx, (_, s) in enumerate(turns):
            if idx + 1 < len(turns):
                v_next_turn = v[i, turns[idx + 1][1][0]]
            else:
                v_next_turn = 0.0 if boot is None else float(boot[i])
            n = len(s) - 1
            deltas = []
            for j, c in enumerate(s):
                if j < n:
                    deltas.append(r[i, c] + gk * v[i, s[j + 1]] - v[i, c])
                else:
                    deltas.append(r[i, c] + gt * v_next_turn - v[i, c])
            trace = [
                sum((gk * lk) ** q * deltas[j + q] for q in range(n - j + 1)) for j in range(n + 1)
            ]
            mean = np.mean(trace)
            for j, c in enumerate(s):
                out[i, c] = turn_adv[i, c] + beta * (trace[j] - mean)
    return out


def turn_log_ratio(logp, old, m, tid, reduce="sum"):
    out = np.zeros(logp.shape)
    for i in range(logp.shape[0]):
        for _, s in _turns(m[i], tid[i]):
            total = sum(logp[i, c] - old[i, c] for c in s)
            if reduce == "mean":
                total /= len(s)
            for c in s:
                out[i, c] = total
    return out


def group_advantages(x, g, baseline="mean", scale="std", eps=1e-6):
    x = np.asarray(x, float)
    g = np.asarray(g)
    out = np.zeros_like(x)
    for i in range(len(x)):
        same = x[g == g[i]]
        if len(same) == 1:
            continue
        if baseline == "mean":
            base = same.mean()
        else:
            base = (same.sum() - x[i]) / (len(same) - 1)
        a = x[i] - base
        if scale == "std":
            a /= same.std(ddof=1) + eps
        out[i] = a
    return out


def trace_credit(lp, bmask, eps=0.1, horizon=3, gamma=0.8, normalize=True):
    b, mm = lp.shape
    out = np.zeros((b, mm - 1))
    for i in range(b):
        n = int(bmask[i].sum())
        d = -lp[i, :n] + eps
        delta = [np.log(d[k] / d[k + 1]) for k in range(n - 1)]
        for k in range(n - 1):
            js = [j for j in range(horizon) if k + j < n - 1]
            c = sum(gamma**j * delta[k + j] for j in js)
            if normalize:
                c /= sum(gamma**j for j in js)
            out[i, k] = c
    return out
