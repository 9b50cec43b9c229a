"""vLLM and SGLang servers as [`Generator`][train.engine.generator.Generator] s, over HTTP.

    servers = connect("vllm", ["http://a:8000", "http://b:8000"], model="my-model")
    gen = servers.generate(ids, max_new_tokens=64, temperature=1.0, stop_ids=(2,), seed=0,
                           affinity=episode)

Token ids in and out, never text:

- **vLLM** (``vllm serve`` or ``python -m vllm.entrypoints.openai.api_server``, with
  ``VLLM_SERVER_DEV_MODE=1`` for the weight endpoints): ``POST /v1/completions`` with the prompt
  as a list of ids, ``logprobs: 0`` and ``return_token_ids: true``; the answer's
  ``choices[0].token_ids`` and ``choices[0].logprobs.token_logprobs``. New weights:
  ``POST /pause?mode=wait``, ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs":
  {"weights_path": folder}}``, ``POST /reset_prefix_cache``, ``POST /resume``. A LoRA run's
  adapters alone, where the server was started with ``--enable-lora --max-lora-rank R`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``: ``POST /v1/load_lora_adapter`` ``{"lora_name",
  "lora_path"}`` (a PEFT folder), then every request names that adapter as its ``model``, and the
  version before is ``POST /v1/unload_lora_adapter``-ed.
- **SGLang** (``python -m sglang.launch_server``): ``POST /generate`` with ``input_ids``,
  ``sampling_params`` and ``return_logprob: true``; the answer's
  ``meta_info.output_token_logprobs`` (``[logprob, id, text]`` per sampled token) and
  ``meta_info.finish_reason.type``. New weights: ``POST /pause_generation``,
  ``POST /update_weights_from_disk`` ``{"model_path", "weight_version", "flush_cache"}``,
  ``POST /continue_generation``.

Several URLs are replicas of one model: an episode's turns go to ``urls[affinity % n]`` so its
server's prefix cache holds its conversation; weights go to all of them. A request that fails to
connect or times out is retried (``retries``, backing off); then
[`ServerError`][train.engine.servers.ServerError] names the server, the endpoint and what went
wrong, and the run ends with it (a killed run resumes from its last checkpoint). A server's own
error answer (HTTP 4xx/5xx) is not retried: it will not change. A turn the server aborted
(``finish_reason`` ``abort``: an operator's pause in abort mode) is asked again from the same ids,
never booked as a cut turn.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from train.engine.generator import Generation

__all__ = [
    "BACKENDS",
    "ServerError",
    "AdaptersRefused",
    "Server",
    "VLLMServer",
    "SGLangServer",
    "Servers",
    "connect",
]

BACKENDS = ("vllm", "sglang")


class ServerError(RuntimeError):
    """A rollout server failed (it names the server, the endpoint and why); ``status`` is the
    HTTP code where the server answered, None where it could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class AdaptersRefused(ServerError):
    """A server that does not load LoRA adapters at run time (its kind has no such endpoint
    here, or it was not started with them): the push sends merged weights instead."""


class Server:
    """One server's HTTP conversation: JSON posts with a time limit and retries."""

    kind = "server"

    def __init__(self, url: str, *, model: str = "", timeout: float = 600.0, retries: int = 2):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"rollout_url: {url!r} is not an http(s) URL")
        self.url, self.model = url.rstrip("/"), model
        self.timeout, self.retries = timeout, retries
        self.version = 0
        self.adapter: str | None = None  # the LoRA adapter requests name (None: served weights)

    def post(self, path: str, body: dict | None = None, *, query: str = "") -> Any:
        data = json.dumps(body or {}).encode()
        target = f"{self.url}{path}{'?' + query if query else ''}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(
                target, data=data, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    text = response.read().decode()
                return _answer(text)
            except urllib.error.HTTPError as e:  # the server answered: retrying will not help
                detail = e.read().decode(errors="replace")[:500]
                raise ServerError(
                    f"{self.kind} server {self.url}: POST {path} answered HTTP {e.code}: {detail}",
                    status=e.code,
                ) from e
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = e
                if attempt < self.retries:
                    time.sleep(min(0.5 * 2**attempt, 5.0))
        raise ServerError(
            f"{self.kind} server {self.url}: POST {path} failed after {self.retries + 1} "
            f"attempts: {type(last).__name__}: {last}"
        ) from last

    def load_adapter(self, folder: str, version: int, name: str) -> None:
        """Has the server load the PEFT folder ``folder`` (policy ``version``) under ``name``
        and sample with it."""
        raise AdaptersRefused(
            f"{self.kind} server {self.url}: loading a LoRA adapter at run time is not built for "
            f"{self.kind} here (the merged weights are pushed instead)"
        )

    def _turn(self, path: str, body: dict, read, where: str) -> Generation:
        """A turn's request; ``read(answer)`` gives (tokens, logprobs, finish reason, version),
        a missing field raising what names it under ``where``. A turn the server aborted is asked
        again (at most ``retries`` times more), never booked as a cut one."""
        for _ in range(self.retries + 1):
            answer = self.post(path, body)
            try:
                tokens, logprobs, finish, version = read(answer)
            except (KeyError, IndexError, TypeError) as e:
                raise ServerError(
                    f"{self.kind} server {self.url}: POST {path} answered without {where}.{e}: "
                    f"{json.dumps(answer)[:300]}"
                ) from e
            if finish != "abort":
                kind = "stop" if finish == "stop" else "length"
                return Generation(tokens, logprobs, kind, version)
        raise ServerError(
            f"{self.kind} server {self.url}: POST {path} was aborted by the server "
            f"{self.retries + 1} times in a row"
        )


class VLLMServer(Server):
    kind = "vllm"

    def generate(self, ids, *, max_new_tokens, temperature, stop_ids, seed, affinity=0):
        version, model = self.version, self.adapter or self.model
        body = {
            **({"model": model} if model else {}),
            "prompt": list(map(int, ids)),
            "max_tokens": int(max_new_tokens),
            "temperature": float(temperature),
            # every setting the sampled distribution depends on, so the server's own defaults
            # (vLLM applies the model's generation_config.json) never reshape the policy
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "seed": int(seed),
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": list(map(int, stop_ids)),
            "skip_special_tokens": False,
        }

        def read(answer):
            choice = answer["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            return tokens, logprobs, choice["finish_reason"], version

        return self._turn("/v1/completions", body, read, "choices[0]")

    def pause(self) -> None:
        self.post("/pause", query="mode=wait")

    def resume(self) -> None:
        self.post("/resume")

    def load_weights(self, folder: str, version: int) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        self.post("/collective_rpc", body)
        self.post("/reset_prefix_cache")
        self.adapter = None
        self.version = int(version)

    def load_adapter(self, folder: str, version: int, name: str) -> None:
        try:
            self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        except ServerError as e:
            if self.adapter is not None or e.status is None:
                raise  # it took adapters before, or it cannot be reached: a failure, not a "no"
            raise AdaptersRefused(
                f"vllm server {self.url} did not load a LoRA adapter ({e}); start it with "
                "--enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 to push "
                "adapters alone",
                status=e.status,
            ) from e
        old, self.adapter = self.adapter, name
        if old is not None:
            self.post("/v1/unload_lora_adapter", {"lora_name": old})
        self.version = int(version)


class SGLangServer(Server):
    kind = "sglang"

    def generate(self, ids, *, max_new_tokens, temperature, stop_ids, seed, affinity=0):
        version = self.version
        body = {
            "input_ids": list(map(int, ids)),
            "sampling_params": {
                "max_new_tokens": int(max_new_tokens),
                "temperature": float(temperature),
                "top_p": 1.0,
                "top_k": -1,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "stop_token_ids": list(map(int, stop_ids)),
                "skip_special_tokens": False,
                "no_stop_trim": True,
                "sampling_seed": int(seed),
            },
            "return_logprob": True,
        }

        def read(answer):
            meta = answer["meta_info"]
            triples = meta["output_token_logprobs"]
            finish = (meta.get("finish_reason") or {}).get("type")
            reported = str(meta.get("weight_version", ""))  # "default" until a versioned update
            tokens, logprobs = [int(t[1]) for t in triples], [float(t[0]) for t in triples]
            return tokens, logprobs, finish, int(reported) if reported.isdigit() else version

        return self._turn("/generate", body, read, "meta_info")

    def pause(self) -> None:
        self.post("/pause_generation", {"mode": "retract"})

    def resume(self) -> None:
        self.post("/continue_generation")

    def load_weights(self, folder: str, version: int) -> None:
        body = {"model_path": str(folder), "weight_version": str(version), "flush_cache": True}
        answer = self.post("/update_weights_from_disk", body)
        if not answer.get("success", False):
            raise ServerError(
                f"sglang server {self.url}: POST /update_weights_from_disk refused {folder}: "
                f"{answer.get('message', answer)}"
            )
        self.version = int(version)


_KINDS = {"vllm": VLLMServer, "sglang": SGLangServer}


class Servers:
    """Replicas of one model behind the [`Generator`][train.engine.generator.Generator]
    interface."""

    def __init__(self, servers: Sequence[Server]):
        if not servers:
            raise ValueError("rollout_url: no server given")
        self.servers = list(servers)
        self.version = 0
        self._lock = threading.Lock()

    @property
    def kind(self) -> str:
        return self.servers[0].kind

    def generate(self, ids, *, max_new_tokens, temperature, stop_ids, seed, affinity=0):
        server = self.servers[affinity % len(self.servers)]
        return server.generate(
            ids, max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=stop_ids,
            seed=seed,
        )  # fmt: skip

    def pause(self) -> None:
        for s in self.servers:
            s.pause()

    def resume(self) -> None:
        for s in self.servers:
            s.resume()

    def load_weights(self, folder: str, version: int) -> None:
        """Pause, reload and resume every replica (so no turn mixes two versions)."""
        self._each_paused(lambda s: s.load_weights(folder, version), version)

    def load_adapter(self, folder: str, version: int, name: str) -> None:
        """Pause, load the adapter folder as ``name`` on every replica and resume;
        ``AdaptersRefused`` (every replica back on its served weights) where one does not take
        it."""
        try:
            self._each_paused(lambda s: s.load_adapter(folder, version, name), version)
        except AdaptersRefused:
            for s in self.servers:
                s.adapter = None
            raise

    def _each_paused(self, load, version: int) -> None:
        with self._lock:
            self.pause()
            try:
                for s in self.servers:
                    load(s)
            finally:
                self.resume()
            self.version = int(version)


def _answer(text: str):
    """A server's answer: its JSON, ``{}`` for none, ``{"text": ...}`` for plain text (vLLM's
    adapter endpoints answer a sentence)."""
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return {"text": text}


def connect(
    kind: str, urls: Sequence[str], *, model: str = "", timeout: float = 600.0, retries: int = 2
) -> Servers:
    """The replicas at ``urls`` speaking ``kind`` (``vllm`` or ``sglang``)."""
    if kind not in _KINDS:
        raise ValueError(f"rollout_backend: {kind!r} is not one of {BACKENDS}")
    return Servers([_KINDS[kind](u, model=model, timeout=timeout, retries=retries) for u in urls])
