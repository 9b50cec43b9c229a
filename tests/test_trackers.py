"""The trackers beside metrics.jsonl (train/core/trackers.py): what W&B (offline) and Trackio
stored, read back from their own files, equals the JSONL and config.json; a resumed run continues
the same tracker run; a tracker that fails never stops training; one not installed is refused."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from tests.test_train import TINY
from train import run, sft
from train.core import trackers
from train.core.metrics import read_metrics
from train.core.trackers import scalars
from train.study.round1 import check_study_loggers

# two steps, a held-out evaluation after the second (its figures amend step 2's line)
ARGS = [*TINY, "--steps", "2", "--eval-every", "2", "--eval-episodes", "2", "--eval-k", "1"]


def _by_step(rows: list[tuple[int, dict]]) -> dict[int, dict[str, float]]:
    """Every number logged at each step; a key logged twice at a step keeps the later value."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for step, values in rows:
        out[step].update(values)
    return dict(out)


def _jsonl_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    return {m["step"]: scalars(m) for m in read_metrics(run_dir)}


def _assert_same(logged: dict[int, dict], expected: dict[int, dict]) -> None:
    assert sorted(logged) == sorted(expected)
    for step, values in expected.items():
        assert sorted(logged[step]) == sorted(values), step
        for key, value in values.items():
            got = logged[step][key]
            assert (math.isnan(got) and math.isnan(value)) or got == pytest.approx(value), key


def _expected_config(run_dir: Path) -> dict:
    config = json.loads((run_dir / "config.json").read_text())
    return {**config, "run_name": run_dir.resolve().name, "run_dir": str(run_dir.resolve())}


# -- W&B's offline run files -----------------------------------------------------------------------


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: LevelDB's log format (32 KiB blocks of records
    with a 7-byte header: crc32c, length, type 1 full / 2 first / 3 middle / 4 last) behind a
    7-byte file header ``:W&B``, version."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pieces = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def _wandb_run(run_dir: Path):
    """(run ids, history rows by step, config) of every offline run file under ``run_dir``."""
    ids, rows, config = set(), [], {}
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, f"no W&B offline run files under {run_dir / 'wandb'}"
    for path in files:
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                updates = record.run.config.update
            elif kind == "config":
                updates = record.config.update
            else:
                updates = ()
            for item in updates:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    config[key] = json.loads(item.value_json)
            if kind == "history":
                values = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                step = values.pop("step")
                rows.append((int(step), {k: v for k, v in values.items() if not k.startswith("_")}))
    return ids, _by_step(rows), config


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """No API key, no mode: the tracker must choose offline itself."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "home" / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "home" / "wandb-data"))


def test_wandb_offline_holds_the_jsonl_and_config_and_a_resume_continues_its_run(
    tmp_path, wandb_home, capsys
):
    out = tmp_path / "run"
    assert run.main([*ARGS, "--loggers", "jsonl,tensorboard,wandb", "--run-dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("wandb: offline (no API key set)") == 1
    ids, logged, config = _wandb_run(out)
    assert len(ids) == 1
    assert any(k.startswith("eval_") for k in logged[2])  # the held-out evaluation is there
    _assert_same(logged, _jsonl_by_step(out))
    assert config == _expected_config(out)

    assert run.main(["--resume", "--run-dir", str(out), "--steps", "3", "--no-progress"]) == 0
    resumed_ids, logged, _ = _wandb_run(out)
    assert resumed_ids == ids  # the same W&B run, continued
    assert len(list((out / "wandb").glob("offline-run-*"))) == 2
    assert sorted(logged) == [1, 2, 3]
    _assert_same(logged, _jsonl_by_step(out))


# -- Trackio's SQLite store -----------------------------------------------------------------------


@pytest.fixture
def trackio_project():
    """A project of its own in Trackio's store, which lives in the session's TRACKIO_DIR."""
    from trackio.sqlite_storage import SQLiteStorage

    project = f"mpo-jax-test-{uuid.uuid4().hex[:8]}"
    yield project
    path = SQLiteStorage.get_project_db_path(project)
    assert path.is_relative_to(os.environ["TRACKIO_DIR"]), f"{path}: outside the test's TRACKIO_DIR"


def _trackio_run(project: str, run_dir: Path):
    from trackio.sqlite_storage import SQLiteStorage

    name = json.loads((run_dir / "trackers.json").read_text())["trackio"]["name"]
    assert SQLiteStorage.get_runs(project) == [name]
    rows = []
    for log in SQLiteStorage.get_logs(project, name):
        values = {k: v for k, v in log.items() if k not in ("step", "timestamp")}
        rows.append((log["step"], {k: v for k, v in values.items() if not k.startswith("_")}))
    config = SQLiteStorage.get_run_config(project, name) or {}
    return _by_step(rows), {k: v for k, v in config.items() if not k.startswith("_")}


def test_trackio_holds_the_jsonl_and_config_and_a_resume_continues_its_run(
    tmp_path, trackio_project
):
    out = tmp_path / "run"
    argv = [*ARGS, "--loggers", "trackio", "--tracker-project", trackio_project]
    assert run.main([*argv, "--run-dir", str(out)]) == 0
    logged, config = _trackio_run(trackio_project, out)
    assert not (out / "tensorboard").exists()  # only the trackers named (and the JSONL)
    assert any(k.startswith("eval_") for k in logged[2])
    _assert_same(logged, _jsonl_by_step(out))
    assert config == _expected_config(out)

    assert run.main(["--resume", "--run-dir", str(out), "--steps", "3", "--no-progress"]) == 0
    logged, config = _trackio_run(trackio_project, out)  # one run, now three steps
    assert sorted(logged) == [1, 2, 3]
    _assert_same(logged, _jsonl_by_step(out))
    assert config == _expected_config(out)


# -- failures: warnings, never a stopped run -------------------------------------------------------


def test_a_tracker_that_raises_mid_run_or_at_start_does_not_stop_training(
    tmp_path, trackio_project, monkeypatch, capsys
):
    calls = []

    def broken_log(self, step, values):
        calls.append(step)
        if step == 2:
            raise ConnectionError("the tracker's server went away")

    monkeypatch.setattr(trackers.TrackioTracker, "log", broken_log)
    out = tmp_path / "run"
    argv = [*ARGS, "--steps", "3", "--loggers", "jsonl,tensorboard,trackio"]
    assert run.main([*argv, "--tracker-project", trackio_project, "--run-dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: the trackio tracker failed logging step 2 (ConnectionError") == 1
    assert calls == [1, 2]  # dropped after the failure: step 2's evaluation and step 3 not sent
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    assert any(k.startswith("eval_") for k in read_metrics(out)[1])

    def broken_start(self, *args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(trackers.WandbTracker, "__init__", broken_start)
    out = tmp_path / "run2"
    assert run.main([*ARGS, "--loggers", "wandb", "--run-dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: the wandb tracker failed to start (OSError: no space left" in err
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


def test_trackers_named_wrong_or_not_installed_are_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    assert run.main([*ARGS, "--loggers", "jsonl,neptune", "--run-dir", str(out)]) == 2
    assert (
        "loggers: ['neptune'] not among jsonl, tensorboard, wandb, trackio"
        in capsys.readouterr().err
    )
    assert not out.exists()

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    assert run.main([*ARGS, "--loggers", "jsonl,wandb", "--run-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "loggers: wandb is named but the wandb package is not installed" in err
    assert "pip install 'mpo-jax[wandb]'" in err
    assert not out.exists()
    argv = ["--env", "synthetic-nav", "--layers", "1", "--width", "32", "--heads", "2"]
    assert sft.main([*argv, "--loggers", "wandb", "--run-dir", str(out)]) == 2
    assert "mpo-jax[wandb]" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit, match=r"--loggers: wandb is named but"):
        check_study_loggers("jsonl,wandb")
