"""Learning curves of one or more runs as PNG files.

    python -m train.plot runs/mpo runs/grpo [--out curves.png] [--metrics success_rate,...]

Each metric gets a panel; each run a line (a moving average over ``--smooth`` steps, raw values
faint behind it); held-out evaluation points are drawn as markers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from train.core.metrics import read_metrics  # noqa: E402

DEFAULT_METRICS = (
    "success_rate",
    "eval_heldout_success_rate",
    "eval_fresh_success_rate",
    "entropy",
    "policy_loss",
    "value_loss",
    "explained_variance",
)


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(y) < window:
        return y
    kernel = np.ones(window) / window
    head = np.cumsum(y[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(y, kernel, mode="valid")])


def plot(run_dirs: list[str], out: Path, metrics=DEFAULT_METRICS, window: int = 10) -> Path:
    runs = {str(d): read_metrics(d) for d in run_dirs}
    missing = [d for d, rows in runs.items() if not rows]
    if missing:
        raise SystemExit(f"no metrics.jsonl rows in {missing}")
    cols = 2
    rows_n = -(-len(metrics) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6 * cols, 3.2 * rows_n), squeeze=False)
    for ax, key in zip(axes.ravel(), metrics, strict=False):
        for name, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            x, y = (np.asarray(v, float) for v in zip(*pts, strict=True))
            if key.startswith("eval_"):
                ax.plot(x, y, "o-", label=Path(name).name)
            else:
                (line,) = ax.plot(x, smooth(y, window), label=Path(name).name)
                ax.plot(x, y, color=line.get_color(), alpha=0.2, linewidth=0.8)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(metrics) :]:
        ax.axis("off")
    axes[0, 0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default=None, help="PNG path (default: <first run>/curves.png)")
    p.add_argument("--metrics", default=",".join(DEFAULT_METRICS))
    p.add_argument("--smooth", type=int, default=10)
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.runs[0]) / "curves.png"
    print(plot(args.runs, out, tuple(args.metrics.split(",")), args.smooth))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
