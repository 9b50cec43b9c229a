"""Rollouts on an inference server: the vLLM and SGLang clients against in-process servers that
speak their JSON (tests/fake_servers.py, backed by our sampler), two training steps through each
with the learner's weights pushed after every update, and a server that dies mid-step."""

from __future__ import annotations

import numpy as np
import pytest

from tests.fake_servers import FakeServer
from tests.models import save_official_qwen3
from train import run
from train.core.config import parse_args
from train.core.metrics import read_metrics
from train.engine.servers import ServerError, connect

SMALL_RUN = [
    "--env", "guess-the-number", "--preset", "grpo", "--no-log-ref-kl", "--steps", "2",
    "--prompts-per-step", "1", "--group-size", "2", "--minibatches", "1",
    "--max-new-tokens", "8", "--max-len", "1024", "--eval-every", "0",
    "--checkpoint-every", "1", "--no-progress", "--rollout-weights-dtype", "float32",
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-for-servers")
    save_official_qwen3(path)
    return path


@pytest.fixture(params=["vllm", "sglang"])
def server(request, folder):
    fake = FakeServer(request.param, folder, capacity=1024)
    yield fake
    fake.close()


def test_a_turn_comes_back_as_our_sampler_samples_it(server):
    servers = connect(server.kind, [server.url])
    ids = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
    kwargs = dict(max_new_tokens=6, temperature=1.0, stop_ids=(151645,), seed=11)
    got = servers.generate(ids, **kwargs)
    want = server.generator.generate(ids, **kwargs)
    assert got.tokens == want.tokens and len(got.tokens) >= 1
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6)
    assert got.finish == want.finish and got.version == 0
    body = server.requests[0]
    if server.kind == "vllm":
        assert body["prompt"] == ids and body["logprobs"] == 0 and body["return_token_ids"]
        assert body["stop_token_ids"] == [151645] and body["max_tokens"] == 6
        params = body
    else:
        assert body["input_ids"] == ids and body["return_logprob"] is True
        assert body["sampling_params"]["max_new_tokens"] == 6
        params = body["sampling_params"]
    # the policy's own distribution: nothing a server default could truncate or penalise
    assert params["top_p"] == 1.0 and params["top_k"] in (0, -1) and params["min_p"] == 0.0
    assert params["repetition_penalty"] == 1.0


def test_two_steps_train_through_the_server_with_weights_pushed_after_each_update(
    server, folder, tmp_path
):
    run_dir = tmp_path / "run"
    args = ["--model-path", str(folder), *SMALL_RUN, "--run-dir", str(run_dir)]
    assert run.main([*args, "--rollout-backend", server.kind, "--rollout-url", server.url]) == 0
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # the initial weights before step 1, the first update's before step 2; each while paused
    assert [f.rsplit("/", 1)[-1] for f, _ in server.reloads] == ["v0", "v1"]
    assert server.paused_during_reload == [True, True]
    if server.kind == "sglang":
        assert [v for _, v in server.reloads] == ["0", "1"]
    assert sum(r["rollout_requests"] for r in rows) == len(server.requests)
    for r in rows:
        assert np.isfinite(r["policy_loss"]) and r["weight_sync_gb"] > 0
        # the server's log-probs (float32 weights) are the learner's own, token for token
        assert r["sampler_logp_gap"] < 1e-3
    # only the newest pushed folder and the one before are kept
    assert sorted(p.name for p in (run_dir / "rollout-weights").iterdir()) == ["v0", "v1"]


def test_a_server_that_dies_mid_step_ends_the_run_which_resumes_on_a_new_one(
    folder, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    args = ["--model-path", str(folder), *SMALL_RUN, "--run-dir", str(run_dir)]
    dying = FakeServer("vllm", folder, capacity=1024)
    dying.die_at = (2, 1)  # in step 2 (its weights pushed), after one turn was answered
    try:
        code = run.main([*args, "--rollout-backend", "vllm", "--rollout-url", dying.url])
    finally:
        dying.close()
    err = capsys.readouterr().err
    assert code == 3
    assert f"vllm server {dying.url}: POST /v1/completions failed" in err
    assert "resumes from its last checkpoint (step 1)" in err
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    fresh = FakeServer("vllm", folder, capacity=1024)
    try:
        resume = ["--resume", "--run-dir", str(run_dir), "--rollout-url", fresh.url]
        assert run.main(resume) == 0
    finally:
        fresh.close()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    # the fresh server got the learner's weights of the step it resumed at, first
    assert [f.rsplit("/", 1)[-1] for f, _ in fresh.reloads] == ["v1"]


def test_an_aborted_turn_is_asked_again_never_booked_as_cut(server):
    servers = connect(server.kind, [server.url], retries=2)
    ids = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
    kwargs = dict(max_new_tokens=5, temperature=1.0, stop_ids=(151645,), seed=3)
    server.abort_next = 2
    got = servers.generate(ids, **kwargs)
    assert got == server.generator.generate(ids, **kwargs) and len(server.requests) == 3
    server.abort_next = 3
    with pytest.raises(ServerError, match=rf"{server.url}: POST .* aborted by the server 3 times"):
        servers.generate(ids, **kwargs)


def test_a_server_error_names_the_server_and_the_endpoint(server):
    servers = connect(server.kind, [server.url], retries=0)
    with pytest.raises(ServerError, match=rf"{server.kind} server {server.url}: POST /nowhere"):
        servers.servers[0].post("/nowhere", {})
    dead = connect(server.kind, ["http://127.0.0.1:9"], retries=1, timeout=2)
    with pytest.raises(ServerError, match=r"http://127.0.0.1:9: POST .* failed after 2 attempts"):
        dead.generate([1, 2, 3], max_new_tokens=2, temperature=1.0, stop_ids=(), seed=0)


def test_an_episode_keeps_to_one_server_and_weights_go_to_every_one():
    from train.engine.generator import Generation
    from train.engine.servers import Servers

    class Replica:
        def __init__(self):
            self.seen, self.events, self.version = [], [], 0

        def generate(self, ids, **kwargs):
            self.seen.append(ids[0])
            return Generation([7], [-0.5], "length", self.version)

        def pause(self):
            self.events.append("pause")

        def resume(self):
            self.events.append("resume")

        def load_weights(self, folder, version):
            self.events.append(f"load {version}")

    replicas = [Replica(), Replica(), Replica()]
    servers = Servers(replicas)
    for episode in range(7):
        for _ in range(2):  # two turns each: the same replica both times
            servers.generate([episode], max_new_tokens=1, temperature=1.0, stop_ids=(), seed=0,
                             affinity=episode)  # fmt: skip
    assert [r.seen for r in replicas] == [[0, 0, 3, 3, 6, 6], [1, 1, 4, 4], [2, 2, 5, 5]]
    servers.load_weights("/w/v4", 4)
    assert all(r.events == ["pause", "load 4", "resume"] for r in replicas)
    assert servers.version == 4


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--rollout-backend", "vllm"], "rollout_url"),
        (["--rollout-url", "http://x:1"], "rollout_url"),
        (["--rollout-backend", "tgi", "--rollout-url", "http://x:1"], "rollout_backend"),
        (["--rollout-backend", "sglang", "--rollout-url", "http://x:1", "--slots", "2"], "slots"),
        (["--rollout-backend", "vllm", "--rollout-url", "http://x:1", "--rollout-timeout", "0"],
         "rollout_timeout"),
        (["--rollout-backend", "vllm", "--rollout-url", "ftp://x"], "rollout_url"),
    ],
)  # fmt: skip
def test_server_settings_are_refused_by_name(flags, field):
    with pytest.raises(ValueError, match=field):
        cfg = parse_args(flags)
        connect(cfg.rollout_backend, cfg.rollout_urls())


def test_asynchronous_rollouts_on_a_server_record_the_versions_it_sampled_with(folder, tmp_path):
    fake = FakeServer("sglang", folder, capacity=1024)
    run_dir = tmp_path / "run"
    args = ["--model-path", str(folder), *SMALL_RUN, "--run-dir", str(run_dir), "--steps", "3"]
    try:
        assert run.main([*args, "--max-staleness", "1", "--rollout-backend", "sglang",
                         "--rollout-url", fake.url]) == 0  # fmt: skip
    finally:
        fake.close()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the worker samples step s with the newest weights it was handed (version s-1 or s)
    pushed = [int(v) for _, v in fake.reloads]
    assert pushed == sorted(set(pushed)) and pushed[0] == 0
    for r in rows:
        assert 0 <= r["staleness_max"] <= 1
