"""The server backend against a real vLLM server (vLLM's CPU build, in an environment of its own:
``make vllm``), on the real model (``make smollm2``): two training steps of a TextArena game with
the learner's weights reloaded by the server after each update, and the server's log-probs of the
sampled tokens checked against our scorer's. Slow: the server warms up for minutes.

    make test-vllm
    MPO_VLLM_URL=http://127.0.0.1:8000 pytest tests/test_vllm_server.py   # a server already up

A server of your own must serve the converted SmolLM2 folder in float32 with
``VLLM_SERVER_DEV_MODE=1`` (its weight-reload endpoints), and for the LoRA test
``--enable-lora --max-lora-rank 16`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from train import run
from train.core.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "smollm2-135m-instruct"
VLLM_PYTHON = Path(os.environ.get("MPO_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    if os.environ.get("MPO_VLLM_URL"):
        yield os.environ["MPO_VLLM_URL"]
        return
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: build it with `make vllm`")
    if not (MODEL / "config.json").exists():
        pytest.fail(f"no converted SmolLM2 at {MODEL}: build it with `make smollm2`")
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
        "--max-model-len", "2048", "--dtype", "float32", "--gpu-memory-utilization", "0.25",
        "--port", str(port), "--host", "127.0.0.1", "--enable-lora", "--max-lora-rank", "16",
        "--max-loras", "2",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None:
                pytest.fail(
                    f"the vLLM server exited ({server.returncode}):\n{log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server was not up in 900 s:\n{log.read_text()[-3000:]}")
            time.sleep(5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def test_two_steps_of_a_real_game_on_a_real_vllm_server(vllm_url, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "--model-path", str(MODEL), "--env", "guess-the-number", "--preset", "grpo",
        "--no-log-ref-kl", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
        "--minibatches", "1", "--max-new-tokens", "32", "--max-len", "1024", "--lr", "3e-5",
        "--eval-every", "0", "--checkpoint-every", "2", "--no-progress",
        "--rollout-backend", "vllm", "--rollout-url", vllm_url,
        "--rollout-weights-dtype", "float32", "--run-dir", str(run_dir),
    ]  # fmt: skip
    assert run.main(args) == 0
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        print(json.dumps({k: r[k] for k in sorted(r) if k.startswith(("weight_sync", "sampler",
              "rollout_req", "success", "env_format"))}), file=sys.stderr)  # fmt: skip
        assert r["rollout_requests"] >= 4 and r["weight_sync_reload_s"] > 0
        # vLLM's float32 CPU kernels against ours, on the tokens vLLM sampled: the same policy
        assert r["sampler_logp_gap"] < 1e-3, r["sampler_logp_gap"]
    # after the second push the server samples the updated weights: its answers moved with them
    assert (run_dir / "rollout-weights" / "v1" / "model.safetensors").exists()


def test_a_lora_run_pushes_only_its_adapters_to_a_real_vllm_server(vllm_url, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "--model-path", str(MODEL), "--env", "guess-the-number", "--preset", "grpo",
        "--no-log-ref-kl", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
        "--minibatches", "1", "--max-new-tokens", "32", "--max-len", "1024", "--lr", "1e-4",
        "--eval-every", "0", "--checkpoint-every", "2", "--no-progress",
        "--lora-rank", "16", "--lora-alpha", "32",
        "--rollout-backend", "vllm", "--rollout-url", vllm_url, "--run-dir", str(run_dir),
    ]  # fmt: skip
    assert run.main(args) == 0
    for r in read_metrics(run_dir):
        print(json.dumps({k: r[k] for k in sorted(r) if k.startswith(("weight_sync", "sampler",
              "rollout_"))}), file=sys.stderr)  # fmt: skip
        # PEFT's folder (20 MB at rank 16 on every projection), not the 0.54 GB model
        assert r["weight_sync_adapter"] == 1.0 and r["weight_sync_gb"] < 0.05
        # vLLM's LoRA kernels on its float32 base against our adapted model
        assert r["sampler_logp_gap"] < 1e-3, r["sampler_logp_gap"]
    assert (run_dir / "rollout-weights" / "v1" / "adapter_model.safetensors").exists()
