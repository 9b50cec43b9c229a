"""A LoRA run's weights out to inference servers: the adapters alone (a PEFT folder vLLM loads at
run time) where the server takes them, the merged weights where it does not, each said and
measured (tests/fake_servers.py speaks vLLM's adapter endpoints when started with ``lora``)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from tests.fake_servers import FakeServer
from tests.models import save_official_qwen3
from tests.test_servers import SMALL_RUN
from train import run
from train.core.config import parse_args
from train.core.metrics import read_metrics
from train.engine.generator import SamplerGenerator
from train.engine.sampler import Sampler
from train.engine.servers import AdaptersRefused, connect
from train.engine.weight_sync import AdapterFolder, WeightPush
from train.model.lora import LORA_TARGETS, Adapted, init_trainable
from train.model.qwen3 import Qwen3ForCausalLM

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "3e-2", "--warmup-steps", "0"]
PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-for-lora-push")
    save_official_qwen3(path)
    return path


def test_a_lora_run_pushes_its_adapters_alone_to_a_vllm_server_that_loads_them(folder, tmp_path):
    fake = FakeServer("vllm", folder, capacity=1024, lora=True)
    run_dir = tmp_path / "run"
    args = ["--model-path", str(folder), *SMALL_RUN, *LORA, "--run-dir", str(run_dir)]
    try:
        assert run.main([*args, "--rollout-backend", "vllm", "--rollout-url", fake.url]) == 0
    finally:
        fake.close()
    assert fake.reloads == []  # never the whole model
    run_name = fake.adapter_loads[0][0].removesuffix("-v0")
    v0, v1 = f"{run_name}-v0", f"{run_name}-v1"
    assert [n for n, _ in fake.adapter_loads] == [v0, v1]
    assert fake.adapter_unloads == [v0] and set(fake.adapters) == {v1}
    assert fake.paused_during_reload == [True, True]  # no turn mixes two versions
    step_of = {v0: 1, v1: 2}
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    asked = [r["model"] for r in fake.requests]  # each request names its step's adapter
    assert sorted(set(asked), key=step_of.get) == [v0, v1]
    assert len(asked) == sum(r["rollout_requests"] for r in rows)
    for r in rows:
        assert r["weight_sync_adapter"] == 1.0
        # the adapter folder (rank 4) is a few hundred kB; the model's weights are megabytes
        assert 0 < r["weight_sync_gb"] < 1e-3
        # the server's log-probs (base + the loaded adapters) are the learner's own
        assert r["sampler_logp_gap"] < 1e-3
    written = run_dir / "rollout-weights" / "v1"
    assert (written / "adapter_config.json").exists() and not (written / "config.json").exists()


def test_a_lora_run_on_a_server_without_adapters_pushes_merged_weights_and_says_so(
    folder, tmp_path, capsys
):
    fake = FakeServer("vllm", folder, capacity=1024)  # vLLM without --enable-lora: 404
    run_dir = tmp_path / "run"
    args = ["--model-path", str(folder), *SMALL_RUN, *LORA, "--run-dir", str(run_dir)]
    try:  # asynchronous: the worker pushes what the learner published
        assert run.main([*args, "--max-staleness", "1", "--rollout-backend", "vllm",
                         "--rollout-url", fake.url]) == 0  # fmt: skip
    finally:
        fake.close()
    err = capsys.readouterr().err
    assert err.count("rollout_push: vllm server") == 1 and "--enable-lora" in err
    assert [f.rsplit("/", 1)[-1] for f, _ in fake.reloads][:1] == ["v0"]
    assert all("model" not in r for r in fake.requests)  # the served (merged) weights
    for r in read_metrics(run_dir):
        assert r.get("weight_sync_adapter", 0.0) == 0.0
        assert r["sampler_logp_gap"] < 1e-3  # merged on the server = base + adapters here


def _drawn_adapters(model, rank: int = 2):
    """Adapters on every projection of ``model`` with B drawn (a fresh B is zero)."""
    cfg = dataclasses.replace(model.cfg, lora_rank=rank, lora_alpha=2 * rank,
                              lora_targets=LORA_TARGETS)  # fmt: skip
    flat = []
    for i, (path, var) in enumerate(nnx.to_flat_state(init_trainable(Qwen3ForCausalLM, cfg, 0))):
        if path[-1] == "lora_b":
            var = var.replace(0.05 * jax.random.normal(jax.random.key(i), var.get_value().shape))
        flat.append((path, var))
    return cfg, nnx.from_flat_state(flat)


def test_a_pushed_adapter_is_what_the_server_samples_with(folder, tmp_path):
    fake = FakeServer("vllm", folder, capacity=64, lora=True)
    cfg, adapters = _drawn_adapters(fake.model)
    push = WeightPush(connect("vllm", [fake.url]), None, tmp_path / "w", mode="adapters",
                      lora=AdapterFolder(cfg, str(folder), "0123"))  # fmt: skip
    ours = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))),
                     nnx.state(fake.model), adapters)  # fmt: skip
    kwargs = dict(max_new_tokens=4, temperature=1.0, stop_ids=(), seed=5)
    try:
        assert push(Adapted(nnx.state(fake.model), adapters), 3) and push.last["adapter"] == 1.0
        assert not push(Adapted(nnx.state(fake.model), adapters), 3)  # it holds version 3
        got = connect("vllm", [fake.url]).servers[0]
        got.adapter = push.adapter_name(3)
        served = got.generate(PROMPT, **kwargs)
        base = fake.generator.generate(PROMPT, **kwargs)
    finally:
        fake.close()
    want = SamplerGenerator(Sampler(ours, capacity=64)).generate(PROMPT, **kwargs)
    assert served.tokens == want.tokens
    np.testing.assert_allclose(served.logprobs, want.logprobs, atol=1e-4)
    assert np.max(np.abs(np.subtract(served.logprobs[:1], base.logprobs[:1]))) > 1e-3


def test_pushing_adapters_to_a_server_that_refuses_them_is_an_error_when_asked_for(
    folder, tmp_path
):
    plain = FakeServer("vllm", folder, capacity=64)
    sglang = FakeServer("sglang", folder, capacity=64)
    cfg, adapters = _drawn_adapters(plain.model)
    params = Adapted(nnx.state(plain.model), adapters)
    lora = AdapterFolder(cfg, str(folder), "0123")
    try:
        push = WeightPush(connect("vllm", [plain.url]), None, tmp_path / "w", lora=lora,
                          mode="adapters")  # fmt: skip
        with pytest.raises(AdaptersRefused, match=r"HTTP 404.*--enable-lora --max-lora-rank"):
            push(params, 0)
        with pytest.raises(AdaptersRefused, match="not built for sglang"):
            connect("sglang", [sglang.url]).load_adapter(str(tmp_path), 0, "a")
    finally:
        plain.close()
        sglang.close()
    with pytest.raises(ValueError, match="rollout_push: 'lora' is not one of"):
        parse_args(["--rollout-push", "lora"])
