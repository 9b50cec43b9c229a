"""Every notebook runs top to bottom without an error (small sizes: NOTEBOOK_STEPS=4), and the
committed ones carry their outputs (they are read on a code-hosting site without running)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == [
        "01_credit_by_hand.ipynb",
        "02_train_and_compare.ipynb",
        "03_your_environment.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_are_executed_with_figures(path):
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(c.get("execution_count") for c in code), "not executed top to bottom"
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        from execute import execute
    finally:
        sys.path.remove(str(ROOT / "notebooks"))
    monkeypatch.setenv("NOTEBOOK_STEPS", "4")
    execute(path, tmp_path / path.name)
    assert (tmp_path / path.name).exists()
