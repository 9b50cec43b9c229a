"""The README's commands exist as written: every ``make`` target is in the Makefile, every flag of
every ``python -m train.<command>`` line is one its ``--help`` lists, and ``train.run`` lines pass
the configuration's own checks (the values, not only the names)."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                commands.append(shlex.split(line))
    return commands


def _help(module: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(["--help"])
    assert stop.value.code == 0, module
    return out.getvalue()


def test_the_readme_has_the_two_commands_and_they_are_make_targets():
    commands = readme_commands()
    assert ["make", "run"] in commands and ["make", "test"] in commands
    targets = set(re.findall(r"(?m)^([a-z0-9-]+):", (ROOT / "Makefile").read_text()))
    for cmd in commands:
        if cmd[0] == "make":
            assert cmd[1] in targets, f"README: make {cmd[1]} is not a Makefile target"


def test_every_flag_of_every_readme_command_exists():
    from train.core.config import parse_args

    seen = set()
    for cmd in readme_commands():
        if cmd[:2] != ["python", "-m"]:
            continue
        module, args = cmd[2], cmd[3:]
        seen.add(module)
        flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
        known = set(re.findall(r"--[a-z0-9-]+", _help(module)))
        missing = sorted(flags - known)
        assert not missing, f"README: {module} has no flag {missing}"
        if module == "train.run" and "--resume" not in args:
            parse_args(args)  # raises, naming the field, on a value the run would refuse
    assert {"train.run", "train.evaluate", "train.export"} <= seen
