"""The studies' figures: rates by training step, drawn one way (matplotlib's Agg backend: no
display needed).

    fig, axes = panels(1, 2)
    band(axes[0][0], steps, mean, low, high, label="mpo (3 seeds)")
    rate_axes(axes[0][0], "held-out success", "held-out success rate")
    save(fig, out_dir / "curves.png")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["panels", "band", "rate_axes", "save"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panels(rows: int = 1, cols: int = 1, **options: Any):
    """(figure, axes as a rows x cols list of lists), 6.5 x 4.5 inches a panel unless told."""
    options.setdefault("figsize", (6.5 * cols, 4.5 * rows))
    return _pyplot().subplots(rows, cols, squeeze=False, **options)


def band(ax, steps, mean, low=None, high=None, *, label: str) -> None:
    """A curve with markers, and its interval shaded in the curve's colour when given."""
    (drawn,) = ax.plot(steps, mean, marker="o", ms=3, label=label)
    if low is not None and high is not None:
        ax.fill_between(steps, low, high, color=drawn.get_color(), alpha=0.15)


def rate_axes(ax, title: str, ylabel: str, *, unit_range: bool = True) -> None:
    """A figure by training step: labels, the [0, 1] range of a rate (``unit_range``), grid
    and (when anything is labelled) the legend."""
    ax.set_title(title)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    if unit_range:
        ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def save(fig, path: Path) -> Path:
    """Lay out, write at 90 dpi and close (figures are not kept open between games)."""
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path
