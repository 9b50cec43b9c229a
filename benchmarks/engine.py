"""The rollout engine against lockstep rounds, on the same episodes, with tools that take time.

    python benchmarks/engine.py [--episodes 16 --latencies 0,0.2,1 --reps 3]
    python benchmarks/engine.py --tasks synthetic --chunk 8
    python benchmarks/engine.py --tasks synthetic --configs lockstep,engine-half --refill 0,0.5

Two workloads, each a randomly initialised Qwen3-architecture model (its sampled turns are
noise: what is measured is how the rollout spends its time, not what it says):

* ``synthetic``: a conversation task written here: prompts of 16-64 ids, 4 turns, observations
  of 8-32 ids; a sixteenth of the vocabulary ends a turn, so turn lengths vary (geometric, mean
  about 16, capped at ``--new`` tokens); model of 4 layers, width 256, vocabulary 512;
* ``search``: the search environment with the Qwen3 tokenizer and chat template, and a 2-layer
  width-64 model over the real vocabulary (its turns run to ``--new`` tokens: a random model
  rarely ends one), 4 turns at most.

Each environment's ``step`` first sleeps a log-normal delay (``envs.make(..., tool_latency=m)``,
median m, σ 0.5) for each median in ``--latencies``. Configurations, each on the same episodes
(same seeds):

* ``lockstep``: ``envs.rollout.collect`` (one generate call a round for every live episode,
  then every environment in turn);
* ``engine``: ``train.engine.continuous.collect_continuous`` with one slot per episode, chunks of
  ``--chunk`` steps, ``--episodes`` environment threads;
* ``engine-half``: as ``engine`` with half as many slots as episodes (twice as many episodes in
  flight as slots): an episode waiting on its tool gives its slot up and recomputes its prefix;
* ``engine-half-hold``: the same, holding the slot while it waits (``recompute=False``).

``--refill r[,r2,...]``: ``collect_continuous``'s ``refill`` (default the engine's,
``REFILL``; 0: chunks run to their end); several values run every engine configuration at each,
side by side in one run.

Every configuration is run once untimed (compiles), then timed ``--reps`` times, the configurations
taking turns (one run of each, then the next round, so a load that drifts reaches all of them
alike); the table prints medians: episodes/s, sampled tokens/s, utilisation (the share of decode
slot-steps that sampled a live token; lockstep: live rows / batch rows over its rounds), the same
over the chunks started while an episode waited for a slot ("contended": every slot held; the step's
drain, when fewer episodes are left than slots, left out), the device's idle share (wall time
outside prefill and decode calls), and episodes/s over lockstep in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import envs
from envs.base import StepResult
from envs.latency import WithLatency
from envs.rollout import collect
from train.engine.continuous import REFILL, collect_continuous
from train.engine.sampler import Sampler
from train.model.qwen3 import ModelConfig, Qwen3ForCausalLM

CONFIGS = ("lockstep", "engine", "engine-half", "engine-half-hold")


class TalkCodec:
    """Ids are their own text; ids below ``vocab // 16`` end a turn."""

    end_of_turn = ()

    def __init__(self, vocab: int):
        self.vocab_size = vocab
        self.stop_ids = tuple(range(1, vocab // 16))

    def prompt(self, messages, tools=None):
        return list(messages[0]["content"])

    def observation(self, obs):
        return list(obs)

    def turn_text(self, ids):
        return ids

    def encode(self, text):
        return []


class Talk:
    """Four turns of noise; each answer is 8-32 random ids (drawn from the episode's seed)."""

    tools: list = []
    max_turns = 4
    gold_answer = None

    def __init__(self, seed: int, vocab: int):
        self.rng = np.random.default_rng(seed)
        self.vocab, self.turns = vocab, 0

    def reset(self):
        self.turns = 0
        ids = self.rng.integers(self.vocab // 16, self.vocab, self.rng.integers(16, 65))
        return [{"role": "user", "content": ids.tolist()}]

    def step(self, ids):
        self.turns += 1
        obs = self.rng.integers(self.vocab // 16, self.vocab, self.rng.integers(8, 33)).tolist()
        return StepResult(obs, float(self.turns == 4), self.turns == 4, False, {})


def _model(vocab, layers, width):
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=3 * width,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=width // 4,
        rope_theta=1e6,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))


def workload(task: str):
    """(model, codec, make_envs(n, latency), max_len) of a workload."""
    if task == "synthetic":
        codec = TalkCodec(512)

        def make(n, latency):
            return [WithLatency(Talk(i, 512), median=latency, seed=i) for i in range(n)]

        return _model(512, 4, 256), codec, make, 512
    if task == "search":
        from envs.chat import ChatFormat, load_tokenizer

        codec = ChatFormat(load_tokenizer())

        def make(n, latency):
            return [
                envs.make("search", seed=i, max_turns=4, tool_latency=latency) for i in range(n)
            ]

        return _model(len(codec.tokenizer), 2, 64), codec, make, 4096
    raise SystemExit(f"--tasks: unknown workload {task!r}; choose synthetic or search")


def run_once(config, model, codec, make, max_len, episodes, latency, new, chunk, refill=REFILL):
    batch = make(episodes, latency)
    sampler = Sampler(model, capacity=max_len)
    args = dict(
        group_ids=list(range(episodes)),
        max_len=max_len,
        max_new_tokens=new,
        temperature=1.0,
        seed=jax.random.key(0),
    )
    t0 = time.perf_counter()
    if config == "lockstep":
        busy = _Timed(sampler)
        out = collect(batch, codec, busy, **args)
        wall = time.perf_counter() - t0
        util = busy.live / busy.slot_steps if busy.slot_steps else 0.0
        idle = 1 - busy.seconds / wall
        contended = float("nan")  # every episode has its row: none waits for one
    else:
        slots = episodes if config == "engine" else max(1, episodes // 2)
        out = collect_continuous(
            batch, codec, sampler, **args, slots=slots, chunk=chunk, env_workers=episodes,
            recompute=config != "engine-half-hold", refill=refill,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        util, idle = out.stats.utilisation, out.stats.device_idle
        contended = out.stats.contended_utilisation if out.stats.contended_slot_steps else np.nan
    tokens = int(out.batch.loss_mask.sum())
    return {
        "eps_s": episodes / wall, "tok_s": tokens / wall, "util": util, "contended": contended,
        "idle": idle,
    }  # fmt: skip


class _Timed:
    """The lockstep loop's sampler, timed: seconds inside its calls and live rows a step."""

    def __init__(self, sampler):
        self.sampler, self.seconds, self.live, self.slot_steps = sampler, 0.0, 0, 0

    def _call(self, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        self.seconds += time.perf_counter() - t0
        return out

    def start(self, prompts):
        self._call(self.sampler.start, prompts)

    def extend(self, rows):
        self._call(self.sampler.extend, rows)

    def generate(self, **kw):
        gen = self._call(self.sampler.generate, **kw)
        lengths = [len(t) for t in gen.tokens]
        self.live += sum(lengths)
        self.slot_steps += len(lengths) * max(lengths)
        return gen

    def close(self):
        self.sampler.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="synthetic,search")
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--latencies", default="0,0.2,1")
    p.add_argument("--new", type=int, default=48, help="tokens a turn at most")
    p.add_argument("--chunk", type=int, default=16, help="decode steps a chunk")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--refill",
        default=f"{REFILL:g}",
        help="collect_continuous's refill (default the engine's); several (0,0.5): side by side",
    )
    p.add_argument("--configs", default=",".join(CONFIGS))
    args = p.parse_args()
    latencies = [float(x) for x in args.latencies.split(",")]
    refills = [float(x) for x in args.refill.split(",")]
    configs = [
        (config, refill)
        for config in args.configs.split(",")
        for refill in ([0.0] if config == "lockstep" else refills)
    ]
    print(
        f"{args.episodes} episodes, turns of <= {args.new} tokens, chunks of {args.chunk}, "
        f"refill {args.refill}, tool latency log-normal (sigma 0.5) at the medians given; "
        f"jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, {jnp.zeros(()).dtype}; medians of {args.reps}"
    )
    print(
        "| task | tool latency s | config | episodes/s | tokens/s | utilisation | utilisation, "
        "contended | device idle | episodes/s vs lockstep |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for task in args.tasks.split(","):
        model, codec, make, max_len = workload(task)
        shape = (model, codec, make, max_len, args.episodes)
        for config, refill in configs:  # compile every program once (each refill calls its own)
            run_once(config, *shape, 0.0, args.new, args.chunk, refill)
        for latency in latencies:
            runs: dict[str, list[dict]] = {}
            for _ in range(args.reps):  # round-robin: a load that drifts reaches every config
                for config, refill in configs:
                    named = (
                        config
                        if len(refills) == 1 or config == "lockstep"
                        else (f"{config}, refill {refill:g}")
                    )
                    run = run_once(config, *shape, latency, args.new, args.chunk, refill)
                    runs.setdefault(named, []).append(run)
            rows = {
                named: {k: statistics.median(r[k] for r in reps) for k in reps[0]}
                for named, reps in runs.items()
            }
            base = rows.get("lockstep", {}).get("eps_s")
            for config, r in rows.items():
                ratio = f"{r['eps_s'] / base:.2f}x" if base else "–"
                contended = "–" if np.isnan(r["contended"]) else f"{100 * r['contended']:.0f}%"
                print(
                    f"| {task} | {latency:g} | {config} | {r['eps_s']:.2f} | {r['tok_s']:.0f} "
                    f"| {100 * r['util']:.0f}% | {contended} | {100 * r['idle']:.0f}% | {ratio} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
