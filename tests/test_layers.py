"""The house's one rule of dependencies: mpo_jax, kernels <- envs <- train (docs/design.md §1).

Every ``import`` in every module of the four top-level packages is read from its source (imports
inside functions included), so a dependency hidden in a function body to dodge a cycle fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> the project packages it may import
ALLOWED = {
    "mpo_jax": {"mpo_jax"},
    "kernels": {"kernels"},
    "envs": {"envs", "mpo_jax", "kernels"},
    "train": {"train", "envs", "mpo_jax", "kernels"},
}


def imported_packages(path: Path) -> set[tuple[int, str]]:
    """(line, top-level project package) of every import in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in ALLOWED:
                out.add((node.lineno, top))
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_run_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found under {package}/"
    wrong = [
        f"{f.relative_to(ROOT)}:{line} imports {top}"
        for f in files
        for line, top in sorted(imported_packages(f))
        if top not in ALLOWED[package]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from train.sampler import Sampler\n    import envs.chat\n")
    assert imported_packages(f) == {(2, "train"), (3, "envs")}
