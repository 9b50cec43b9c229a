"""Executes the notebooks top to bottom, in place (``make notebooks``) or into a copy (the tests).

    python notebooks/execute.py [NOTEBOOK ...]        # default: every notebooks/*.ipynb

Each runs in a fresh kernel from the repository root; an error in any cell raises
(``nbclient.exceptions.CellExecutionError``, naming the cell). Environment variables reach the
kernel, so ``NOTEBOOK_STEPS=4`` makes the training notebooks small.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def execute(path: Path, out: Path | None = None, *, timeout: int = 900) -> float:
    """Runs notebook ``path``; writes the executed notebook to ``out`` (default: in place).
    Returns the seconds it took."""
    start = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    nbformat.write(nb, out or path)
    return time.perf_counter() - start


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for p in paths:
        print(f"{p}: {execute(p):.0f} s", flush=True)
