"""In-process stand-ins for a vLLM and an SGLang server: their HTTP endpoints, their JSON request
and response fields, backed by our own sampler, so the tokens and log-probs they answer are real.

    server = FakeServer("vllm", model_folder, capacity=2048)   # listening on 127.0.0.1:<port>
    server.url, server.requests, server.reloads
    server = FakeServer("vllm", model_folder, lora=True)       # vLLM with --enable-lora and
    server.adapter_loads, server.adapter_unloads                # runtime LoRA updating
    server.die_at = (2, 1)        # after the 2nd reload, the 2nd generate request finds it gone
    server.close()

What each checks of a request is what the real server needs to answer as our client expects:
vLLM's completions take the prompt as a list of ids, ``logprobs`` 0 and ``return_token_ids``
true; SGLang's generate takes ``input_ids``, ``sampling_params`` and ``return_logprob``. A request
without them is answered HTTP 400, as the real servers answer a malformed one. With ``lora``, the
vLLM server has ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (answered with a
sentence, as vLLM answers) and samples a request whose ``model`` names a loaded adapter with the
base plus that PEFT folder's adapters; without it those paths are HTTP 404, as on a vLLM started
without runtime LoRA updating.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import jax.numpy as jnp
from flax import nnx

from train.core.build import trainable_like
from train.engine.generator import SamplerGenerator
from train.engine.sampler import Sampler
from train.model.lora import load_peft, lora_scale, merge_weights, peft_settings
from train.model.qwen3 import Qwen3ForCausalLM
from train.model.weights import load_pretrained

__all__ = ["FakeServer"]


class _Refused(Exception):
    pass


def _need(body: dict, field: str, kind, where: str = ""):
    value = body.get(field)
    if not isinstance(value, kind) or (kind is list and not value):
        raise _Refused(f"{where}{field}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


class FakeServer:
    def __init__(self, kind: str, folder, *, capacity: int = 2048, lora: bool = False):
        if kind not in ("vllm", "sglang"):
            raise ValueError(kind)
        self.kind, self.lora, self.capacity = kind, lora, capacity
        self.model = load_pretrained(folder, dtype=jnp.float32, log=lambda _: None)
        self.generator = SamplerGenerator(Sampler(self.model, capacity=capacity))
        self.adapters: dict[str, SamplerGenerator] = {}  # loaded LoRA adapters by name
        self.adapter_loads: list[tuple[str, str]] = []  # (name, folder) in order
        self.adapter_unloads: list[str] = []
        self.requests: list[dict] = []  # every generate request's body
        self.reloads: list[tuple[str, str]] = []  # (folder, version) in order
        self.paused_during_reload: list[bool] = []
        self.paused = False
        self.die_at: tuple[int, int] | None = None  # (reloads, requests after the last one)
        self.abort_next = 0  # answers to come that say the request was aborted
        self._since_reload = 0
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"fake": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- the endpoints ---------------------------------------------------------------------------

    def route(self, path: str, query: dict, body: dict) -> dict:
        generate = "/v1/completions" if self.kind == "vllm" else "/generate"
        if path == generate:
            with self._lock:
                reloads, after = self.die_at or (-1, 0)
                if len(self.reloads) >= reloads >= 0 and self._since_reload >= after:
                    threading.Thread(target=self.close, daemon=True).start()
                    raise ConnectionAbortedError("the server died")
                self.requests.append(body)
                self._since_reload += 1
                aborted, self.abort_next = self.abort_next > 0, max(0, self.abort_next - 1)
            answer = self._vllm(body) if self.kind == "vllm" else self._sglang(body)
            return self._abort(answer) if aborted else answer
        routes = {
            "vllm": {
                "/pause": self._pause,
                "/resume": self._resume,
                "/collective_rpc": self._vllm_rpc,
                "/reset_prefix_cache": lambda q, b: {},
                **(
                    {
                        "/v1/load_lora_adapter": self._load_adapter,
                        "/v1/unload_lora_adapter": self._unload_adapter,
                    }
                    if self.lora
                    else {}
                ),  # fmt: skip
            },
            "sglang": {
                "/pause_generation": self._pause,
                "/continue_generation": self._resume,
                "/update_weights_from_disk": self._sglang_reload,
            },
        }[self.kind]
        if path not in routes:
            raise LookupError(path)
        return routes[path](query, body)

    def _abort(self, answer: dict) -> dict:
        """The answer an abort gives: what was sampled so far, finish reason ``abort``."""
        if self.kind == "vllm":
            choice = answer["choices"][0]
            choice.update(
                finish_reason="abort", stop_reason=None, token_ids=choice["token_ids"][:1]
            )
            choice["logprobs"]["token_logprobs"] = choice["logprobs"]["token_logprobs"][:1]
        else:
            meta = answer["meta_info"]
            meta["finish_reason"] = {"type": "abort", "message": "Abort before prefill"}
            meta["output_token_logprobs"] = meta["output_token_logprobs"][:1]
        return answer

    def _pause(self, query, body):
        if self.kind == "vllm" and query.get("mode", ["abort"])[0] not in ("abort", "wait", "keep"):
            raise _Refused(f"mode: {query['mode']}")
        if self.kind == "sglang" and body.get("mode", "abort") not in (
            "abort",
            "retract",
            "in_place",
        ):
            raise _Refused(f"mode: {body['mode']}")
        self.paused = True
        for g in (self.generator, *self.adapters.values()):
            g.pause()
        return {"status": "paused"} if self.kind == "vllm" else {}

    def _resume(self, query, body):
        self.paused = False
        for g in (self.generator, *self.adapters.values()):
            g.resume()
        return {"status": "resumed"} if self.kind == "vllm" else {}

    def _reload(self, folder: str, version: str) -> None:
        self.paused_during_reload.append(self.paused)
        self.generator.load_weights(folder, int(version) if version.isdigit() else 0)
        self.reloads.append((folder, version))
        self._since_reload = 0

    def _vllm_rpc(self, query, body):
        if _need(body, "method", str) != "reload_weights":
            raise _Refused(f"method: {body['method']!r}")
        kwargs = _need(body, "kwargs", dict)
        self._reload(_need(kwargs, "weights_path", str, "kwargs."), "")
        return {"results": [None]}

    def _load_adapter(self, query, body):
        name, folder = _need(body, "lora_name", str), _need(body, "lora_path", str)
        if name in self.adapters:
            raise _Refused(f"The lora adapter '{name}' has already been loaded.")
        rank, alpha, targets = peft_settings(folder)
        cfg = dataclasses.replace(self.model.cfg, lora_rank=rank, lora_alpha=alpha,
                                  lora_targets=targets)  # fmt: skip
        adapters = load_peft(folder, trainable_like(Qwen3ForCausalLM, cfg), cfg)
        merged = merge_weights(nnx.state(self.model), adapters, lora_scale(rank, alpha))
        model = nnx.merge(nnx.graphdef(self.model), merged)
        self.adapters[name] = SamplerGenerator(Sampler(model, capacity=self.capacity))
        self.adapter_loads.append((name, folder))
        self.paused_during_reload.append(self.paused)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _unload_adapter(self, query, body):
        name = _need(body, "lora_name", str)
        if self.adapters.pop(name, None) is None:
            raise _Refused(f"The lora adapter '{name}' cannot be found.")
        self.adapter_unloads.append(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _sglang_reload(self, query, body):
        self._reload(_need(body, "model_path", str), str(body.get("weight_version", "")))
        return {"success": True, "message": "Succeeded to update model weights.",
                "num_paused_requests": 0}  # fmt: skip

    def _sample(self, ids, params: dict, stop_ids, seed):
        if not all(isinstance(t, int) for t in ids):
            raise _Refused("prompt: token ids must be integers")
        generator, name = self.generator, params.get("model")
        if self.kind == "vllm" and name is not None:
            if name not in self.adapters:  # vLLM: "The model `name` does not exist." (404)
                raise LookupError(name)
            generator = self.adapters[name]
        return generator.generate(
            ids,
            max_new_tokens=params["max"],
            temperature=float(params.get("temperature", 1.0)),
            stop_ids=tuple(stop_ids),
            seed=int(seed or 0),
        )

    def _vllm(self, body: dict) -> dict:
        ids = _need(body, "prompt", list)
        if body.get("logprobs") != 0 or body.get("return_token_ids") is not True:
            raise _Refused("logprobs: 0 and return_token_ids: true are what this client reads")
        stops = body.get("stop_token_ids") or []
        gen = self._sample(ids, {"max": int(body.get("max_tokens", 16)), **body}, stops,
                           body.get("seed"))  # fmt: skip
        stop_reason = gen.tokens[-1] if gen.finish == "stop" else None
        return {
            "id": f"cmpl-{len(self.requests)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "fake"),
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "logprobs": {
                        "text_offset": [0] * len(gen.tokens),
                        "token_logprobs": gen.logprobs,
                        "tokens": [f"token_id:{t}" for t in gen.tokens],
                        "top_logprobs": None,
                    },
                    "finish_reason": gen.finish,
                    "stop_reason": stop_reason,
                    "prompt_token_ids": None,
                    "token_ids": gen.tokens,
                }
            ],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(gen.tokens),
                "total_tokens": len(ids) + len(gen.tokens),
            },
        }

    def _sglang(self, body: dict) -> dict:
        ids = _need(body, "input_ids", list)
        params = _need(body, "sampling_params", dict)
        if body.get("return_logprob") is not True:
            raise _Refused("return_logprob: true is what this client reads")
        budget = {"max": int(params.get("max_new_tokens", 128)), **params}
        stops, seed = params.get("stop_token_ids") or [], params.get("sampling_seed")
        gen = self._sample(ids, budget, stops, seed)
        if gen.finish == "stop":
            finish = {"type": "stop", "matched": gen.tokens[-1]}
        else:
            finish = {"type": "length", "length": len(gen.tokens)}
        version = self.reloads[-1][1] if self.reloads else "default"
        return {
            "text": "",
            "output_ids": gen.tokens,
            "meta_info": {
                "id": f"req-{len(self.requests)}",
                "finish_reason": finish,
                "prompt_tokens": len(ids),
                "completion_tokens": len(gen.tokens),
                "cached_tokens": 0,
                "weight_version": version,
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(gen.logprobs, gen.tokens, strict=True)
                ],
            },
        }


class _Handler(BaseHTTPRequestHandler):
    fake: FakeServer

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            answer = self.fake.route(url.path, parse_qs(url.query), body)
        except ConnectionAbortedError:
            self.close_connection = True
            return  # no answer at all: the client sees the connection drop
        except LookupError:
            return self._send(404, {"detail": "Not Found"})
        except (_Refused, ValueError, json.JSONDecodeError) as e:
            return self._send(400, {"error": {"message": str(e), "type": "BadRequestError"}})
        self._send(200, answer)

    def _send(self, code: int, body: dict | str) -> None:
        text = isinstance(body, str)
        data = body.encode() if text else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
