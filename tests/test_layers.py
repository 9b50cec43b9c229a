"""The house's rule of dependencies (docs/design.md §1): imports run one way.

    mpo_jax, kernels  <-  envs  <-  train.model  <-  train.engine  <-  train.core
        <-  the commands (train/<command>.py)  <-  train.study, benchmarks (importers only)

Every ``import`` in every module is read from its source (imports inside functions included), so
a dependency hidden in a function body to dodge a cycle fails too. A module belongs to the longest
layer name that prefixes its dotted path (``train.core.learner`` -> ``train.core``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("mpo_jax", "kernels", "envs", "train", "benchmarks")
_LIBRARY = {"mpo_jax", "kernels", "envs"}
_TRAINER = {"train", "train.core", "train.engine", "train.model"}  # the commands and below
# layer -> the layers it may import
ALLOWED = {
    "mpo_jax": {"mpo_jax"},
    "kernels": {"kernels"},
    "envs": {"envs", "mpo_jax", "kernels"},
    "train.model": {"train.model", "kernels"},
    "train.engine": {"train.engine", "train.model"} | _LIBRARY,
    "train.core": {"train.core", "train.engine", "train.model"} | _LIBRARY,
    "train": _TRAINER | _LIBRARY,
    "train.study": {"train.study"} | _TRAINER | _LIBRARY,
    "benchmarks": {"benchmarks", "train.study"} | _TRAINER | _LIBRARY,
}


def layer_of(dotted: str) -> str | None:
    """The layer a dotted module name belongs to: the longest ALLOWED key that prefixes it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in ALLOWED:
            return name
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def imported_layers(path: Path) -> set[tuple[int, str]]:
    """(line, layer) of every import of a project module in the file. ``from train import run``
    names the module ``train.run``; ``from train.core import learner`` names ``train.core``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PROJECT:
                layer = layer_of(name)
                if layer is not None:
                    out.add((node.lineno, layer))
    return out


def _modules(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


@pytest.mark.parametrize("top", PROJECT)
def test_imports_run_one_way(top):
    files = _modules(top)
    assert files, f"no modules found under {top}/"
    wrong = []
    for f in files:
        own = layer_of(module_name(f))
        assert own is not None, f"{f.relative_to(ROOT)} belongs to no layer of ALLOWED"
        wrong += [
            f"{f.relative_to(ROOT)}:{line} ({own}) imports {layer}"
            for line, layer in sorted(imported_layers(f))
            if layer not in ALLOWED[own]
        ]
    assert not wrong, "\n".join(wrong)


def test_every_train_module_sits_in_a_subpackage_or_is_a_command():
    """train/ holds subpackages by job and the commands; a new module lands in a room."""
    loose = {p.stem for p in (ROOT / "train").glob("*.py")} - {"__init__"}
    commands = {"run", "evaluate", "export", "plan", "plot", "sft", "convert_gguf"}
    assert loose <= commands, (
        f"modules outside a subpackage that are not commands: {loose - commands}"
    )
    for sub in ("model", "engine", "core", "study"):
        init = ROOT / "train" / sub / "__init__.py"
        assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), (
            f"train/{sub}/__init__.py must say its job in a docstring"
        )


def test_the_checker_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "def f():\n    from train.engine.sampler import Sampler\n    import envs.chat\n"
        "    from train import run\n    from train.study import round2\n"
    )
    assert imported_layers(f) == {
        (2, "train.engine"),
        (3, "envs"),
        (4, "train"),
        (5, "train.study"),
    }


def test_the_checker_refuses_a_lower_layer_importing_a_higher_one():
    assert "train.core" not in ALLOWED["train.model"]
    assert "train.study" not in ALLOWED["train"] and "benchmarks" not in ALLOWED["train"]
    assert layer_of("train.core.learner") == "train.core" and layer_of("train.run") == "train"
