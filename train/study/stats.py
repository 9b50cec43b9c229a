"""The arithmetic of the credit-assignment study: learning-curve summaries and confidence intervals.

Pure NumPy functions on made-up or measured curves (a curve is the held-out success at the
evaluation steps of one run):

* `normalised_auc`: the area under a curve divided by its step span (trapezoids), so it
  reads as the curve's mean success over training, between 0 and 1 for success rates;
* `steps_to_threshold`: the first evaluation step at which a curve reaches a threshold;
* `bootstrap_ci`: the mean over seeds and a percentile-bootstrap 95% interval of it;
* `mean_band`: per-step mean and bootstrap band of several seeds' curves (the plots).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["normalised_auc", "steps_to_threshold", "bootstrap_ci", "mean_band"]


def normalised_auc(steps: Sequence[float], values: Sequence[float]) -> float:
    """``∫ v d(step) / (last step - first step)`` by trapezoids; one point: that value.

    Raises ``ValueError`` for empty or unsorted steps, or lengths that differ.
    """
    s, v = np.asarray(steps, float), np.asarray(values, float)
    if s.shape != v.shape or s.ndim != 1 or not len(s):
        raise ValueError(f"curve: need equal-length 1-d steps and values, got {s.shape}, {v.shape}")
    if np.any(np.diff(s) <= 0):
        raise ValueError("curve: steps must increase")
    if len(s) == 1:
        return float(v[0])
    area = np.sum((v[1:] + v[:-1]) / 2 * np.diff(s))
    return float(area / (s[-1] - s[0]))


def steps_to_threshold(
    steps: Sequence[float], values: Sequence[float], threshold: float
) -> float | None:
    """The first step whose value is >= ``threshold``, or None if the curve never gets there."""
    s, v = np.asarray(steps, float), np.asarray(values, float)
    if s.shape != v.shape:
        raise ValueError(f"curve: steps {s.shape} and values {v.shape} differ")
    hit = np.nonzero(v >= threshold)[0]
    return float(s[hit[0]]) if len(hit) else None


def bootstrap_ci(
    samples: Sequence[float], *, level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``samples`` (one per seed) and the percentile bootstrap
    interval of the mean at ``level``. With one sample the interval is that sample. NaN samples
    are dropped; none left gives NaNs.

    With 3-5 seeds the bootstrap interval is narrower than a t-interval would be (it cannot
    reach beyond the observed values): read it as the spread of the seeds, not a guarantee.
    """
    x = np.asarray([s for s in samples if s is not None and np.isfinite(s)], float)
    if not len(x):
        return (float("nan"),) * 3
    if len(x) == 1:
        return (float(x[0]),) * 3
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(x.mean()), float(low), float(high)


def mean_band(curves: Sequence[Sequence[float]], **kwargs) -> tuple[np.ndarray, ...]:
    """(mean, low, high) per step over several equal-length curves (rows: seeds)."""
    c = np.asarray(curves, float)
    if c.ndim != 2:
        raise ValueError(f"curves: need [seeds, steps], got shape {c.shape}")
    out = np.array([bootstrap_ci(c[:, j], **kwargs) for j in range(c.shape[1])])
    return out[:, 0], out[:, 1], out[:, 2]
