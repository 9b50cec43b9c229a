"""Train a multi-turn agent with any preset of ``mpo_jax.algorithms``.

    python -m train.run                       # the embedded default: a tiny Qwen3-architecture
                                              # policy and critic learn synthetic-nav with MPO
    python -m train.run --preset grpo --run-dir runs/grpo
    python -m train.run --resume --run-dir runs/default       # continue a killed run

The loop, one step per iteration (each line a call into a module with one job):

    rollouts = collect(envs, codec, sampler)     envs/rollout.py (host loop + KV-cache sampler)
    batch    = score(rollouts)                   train/learner.py (old/ref log-probs, values)
    credit   = compute_advantages(algo, batch)   mpo_jax/algorithms.py
    metrics  = update(batch, credit)             epochs x minibatches x micro-batches
    log, evaluate, checkpoint                    train/metrics.py, train/checkpoint.py
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import envs
from envs.rollout import collect
from mpo_jax import algorithms, diagnostics, losses
from mpo_jax.batch import TurnBatch
from train.checkpoint import Checkpoints
from train.config import TrainConfig, parse_args, save_config
from train.distributed import (
    gather_array,
    gather_rollouts,
    host_share,
    initialize_from_env,
    is_multiprocess,
    put_global,
    to_host,
)
from train.learner import (
    Models,
    UpdateFns,
    answer_logprobs,
    make_optimizer,
    split_micro,
    token_logprobs,
    token_values,
)
from train.metrics import MetricsLog, pass_at_k
from train.qwen3 import ModelConfig, Qwen3ForCausalLM, Qwen3ValueModel
from train.sampler import Sampler
from train.sharding import batch_sharding, make_mesh, shard_params

__all__ = ["main", "Trainer"]


class Trainer:
    """Holds the models, optimizers, environments and sampler of one run."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.algo = algorithms.get(cfg.preset, **cfg.algo_set)
        probe = envs.make(cfg.env, seed=0, **cfg.env_set)
        self.codec = getattr(probe, "codec", None) or self._chat_codec()
        self.max_new = cfg.max_new_tokens or getattr(probe, "turn_length", 256)
        actor = self._build_actor()
        critic = Qwen3ValueModel.from_policy(actor, rngs=nnx.Rngs(cfg.seed + 1))
        actor_def, actor_params = nnx.split(actor)
        critic_def, critic_params = nnx.split(critic)
        self.mesh = self.micro_sharding = None
        mesh_shape = cfg.mesh_shape() or ((-1, 1, 1) if is_multiprocess() else None)
        if mesh_shape:  # several processes: one global mesh (default: data-parallel over all)
            data, fsdp, tensor = mesh_shape
            self.mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor)
            self.micro_sharding = batch_sharding(self.mesh)
            actor_params = shard_params(actor_params, self.mesh)
            critic_params = shard_params(critic_params, self.mesh)
        self.models = Models(actor_def, critic_def)
        opt = dict(warmup=cfg.warmup_steps, clip=cfg.grad_clip, weight_decay=cfg.weight_decay)
        actor_tx = make_optimizer(cfg.lr, **opt)
        critic_tx = make_optimizer(cfg.critic_lr, **opt)
        self.fns = UpdateFns(
            self.models,
            self.algo,
            actor_tx,
            critic_tx,
            temperature=cfg.temperature,
            entropy_coef=cfg.entropy_coef,
        )
        self.state = {
            "actor": actor_params,
            "critic": critic_params,
            "ref": jax.tree.map(jnp.copy, actor_params),
            "actor_opt": jax.jit(actor_tx.init)(actor_params),  # follows the params' sharding
            "critic_opt": jax.jit(critic_tx.init)(critic_params),
            "step": 0,
        }
        self.batch_size = cfg.prompts_per_step * cfg.group_size
        # Each process rolls out its share of the step's tasks (all of them with one process).
        self.task_share = host_share(cfg.prompts_per_step)
        local_rows = (self.task_share.stop - self.task_share.start) * cfg.group_size
        self.sampler = Sampler(actor, batch_size=local_rows, capacity=cfg.max_len)
        self.eval_sampler = None
        self._logp = jax.jit(token_logprobs, static_argnums=0, static_argnames="temperature")
        self._values = jax.jit(token_values, static_argnums=0)
        self._answers = jax.jit(answer_logprobs, static_argnums=0)

    # -- construction ----------------------------------------------------------------------------

    def _chat_codec(self):
        from train.chat import ChatFormat, load_tokenizer

        return ChatFormat(load_tokenizer())

    def _build_actor(self) -> Qwen3ForCausalLM:
        cfg = self.cfg
        if cfg.model_path:
            from train.weights import load_pretrained

            return load_pretrained(cfg.model_path)
        mc = ModelConfig(
            vocab_size=self.codec.vocab_size,
            hidden_size=cfg.width,
            intermediate_size=2 * cfg.width,
            num_layers=cfg.layers,
            num_heads=cfg.heads,
            num_kv_heads=cfg.kv_heads,
            head_dim=cfg.width // cfg.heads,
            rope_theta=1e4,
            tie_word_embeddings=True,
        )
        return Qwen3ForCausalLM(mc, rngs=nnx.Rngs(cfg.seed))

    def _envs(self, step: int, prompts: int, group: int, *, offset: int = 0):
        """This process's episodes of one step: its share of ``prompts`` tasks x ``group``
        rollouts each (group ids are global). The task seeds are a function of (seed, step)
        alone, so a resumed run sees the same data."""
        base = offset + self.cfg.seed * 1_000_003 + step * prompts
        out, groups = [], []
        for p in range(prompts)[host_share(prompts)]:
            for _ in range(group):
                out.append(envs.make(self.cfg.env, seed=base + p, **self.cfg.env_set))
                groups.append(p)
        return out, groups

    # -- the RL step -------------------------------------------------------------------------------

    def _local_params(self):
        """The actor's parameters on this process's devices, for its sampler."""
        if not is_multiprocess():
            return self.state["actor"]
        return jax.tree.map(lambda x: jnp.asarray(to_host(x)), self.state["actor"])

    def _put(self, x):
        """A host array (the same on every process) as a jit input: rows split over the data
        axes when they divide evenly, replicated otherwise; plain ``jnp`` without a mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        rows = batch_sharding(self.mesh)
        ways = int(np.prod([self.mesh.shape[a] for a in np.atleast_1d(rows.spec[0])]))
        sharding = rows if len(x) % ways == 0 else jax.sharding.NamedSharding(self.mesh, jax.P())
        return put_global(x, sharding)

    def rollout(self, step: int):
        """The step's rollouts: this process's share, then every process's (the global batch)."""
        self.sampler.state = self._local_params()
        batch_envs, groups = self._envs(step, self.cfg.prompts_per_step, self.cfg.group_size)
        local = collect(
            batch_envs,
            self.codec,
            self.sampler,
            group_ids=groups,
            max_len=self.cfg.max_len,
            max_new_tokens=self.max_new,
            temperature=self.cfg.temperature,
            seed=self.cfg.seed * 7919 + step + jax.process_index() * 1_000_003,
        )
        return gather_rollouts(local)

    def score(self, rollouts) -> TurnBatch:
        b = rollouts.batch
        tokens = self._put(b.tokens)
        old_logp, _ = self._logp(
            self.models.actor, self.state["actor"], tokens, temperature=self.cfg.temperature
        )
        fields = {"old_logp": to_host(old_logp), "logp": to_host(old_logp)}
        if self.algo.needs_critic:
            fields["values"] = to_host(
                self._values(self.models.critic, self.state["critic"], tokens)
            )
        if self.algo.kl_coef:
            ref, _ = self._logp(
                self.models.actor, self.state["ref"], tokens, temperature=self.cfg.temperature
            )
            fields["ref_logp"] = to_host(ref)
        if self.algo.needs_reference_answers:
            fields["answer_logprobs"] = self._trace_scores(rollouts)
        self.sampler_gap = float(
            np.abs(np.where(b.loss_mask, b.old_logp - fields["old_logp"], 0)).max(initial=0)
        )
        return dataclasses.replace(b, **fields)

    def _trace_scores(self, rollouts) -> np.ndarray:
        b = rollouts.batch
        rows, cols = np.nonzero(b.boundary_mask)
        lengths = rollouts.boundary_lengths[rows, cols]
        width = max(1, max(len(a) for a in rollouts.answer_ids))
        answers = np.zeros((len(rows), width), np.int32)
        alen = np.zeros(len(rows), np.int32)
        for n, r in enumerate(rows):
            ids = rollouts.answer_ids[r] or [0]
            answers[n, : len(ids)] = ids
            alen[n] = len(ids)
        scores = self._answers(
            self.models.actor,
            self.state["ref"],
            self._put(b.tokens[rows]),
            self._put(lengths),
            self._put(answers),
            self._put(alen),
        )
        out = np.zeros(b.boundary_mask.shape, np.float32)
        out[rows, cols] = np.minimum(to_host(scores), 0.0)
        return out

    def update(self, batch: TurnBatch, credit) -> dict[str, float]:
        cfg, algo = self.cfg, self.algo
        data = {
            "tokens": batch.tokens,
            "loss_mask": batch.loss_mask,
            "turn_ids": batch.turn_ids,
            "old_logp": batch.old_logp,
            "advantages": np.asarray(credit.advantages),
        }
        if algo.kl_coef:
            data["ref_logp"] = batch.ref_logp
        if algo.needs_critic:
            data["values"] = batch.values
            data["returns"] = np.asarray(credit.returns)
        rng = np.random.default_rng(cfg.seed * 31 + self.state["step"])
        sums: dict[str, float] = {}
        counts = {"skipped": 0, "updates": 0}
        for _ in range(cfg.epochs):
            for rows in np.array_split(rng.permutation(self.batch_size), cfg.minibatches):
                mb = {k: v[rows] for k, v in data.items()}
                self._minibatch(mb, sums, counts)
        n = max(counts["updates"], 1)
        out = {k: v / n for k, v in sums.items()}
        out["skipped_updates"] = counts["skipped"]
        return out

    def _minibatch(self, mb, sums, counts):
        algo, parts = self.algo, self.cfg.micro_batches
        _, normalizer = losses.aggregate(
            np.zeros(mb["loss_mask"].shape), mb["loss_mask"], mb["turn_ids"], mode=algo.aggregation
        )
        tokens = max(float(mb["loss_mask"].sum()), 1.0)
        rows = np.arange(len(mb["tokens"]))
        jobs = [("actor", self.fns.actor_grad, (normalizer, tokens))]
        if algo.needs_critic:
            _, v_norm = losses.aggregate(np.zeros(mb["loss_mask"].shape), mb["loss_mask"])
            jobs.append(("critic", self.fns.critic_grad, (v_norm,)))
        for which, grad_fn, extra in jobs:
            grads, loss, metrics = None, 0.0, {}
            for micro in split_micro(mb, rows, parts):
                if self.micro_sharding is not None:
                    micro = put_global(micro, self.micro_sharding)
                (micro_loss, m), g = grad_fn(self.state[which], micro, *extra)
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
                loss = loss + micro_loss
                for k, v in m.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v)
            params, opt, ok, gnorm = self.fns.apply(
                which, self.state[which], self.state[f"{which}_opt"], grads, loss
            )
            self.state[which], self.state[f"{which}_opt"] = params, opt
            counts["skipped"] += int(not bool(ok))
            prefix = "policy" if which == "actor" else "value"
            acc = {f"{prefix}_loss": float(loss), f"{prefix}_grad_norm": float(gnorm)}
            if which == "actor":
                acc.update(
                    clip_frac=metrics["clip_frac"] / parts,
                    turn_clip_frac=metrics["turn_clip_frac"] / parts,
                    kl=metrics["approx_kl"] / parts,
                    entropy=metrics["entropy_sum"] / tokens,
                    ratio_max=metrics["ratio_max"] / parts,
                )
            for k, v in acc.items():
                sums[k] = sums.get(k, 0.0) + v
        counts["updates"] += 1

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out tasks (a seed range training never uses): success rate and unbiased pass@k."""
        cfg = self.cfg
        k = cfg.eval_k
        # The same held-out tasks at every evaluation, so the numbers are comparable.
        batch_envs, groups = self._envs(0, cfg.eval_episodes, k, offset=10**9)
        if self.eval_sampler is None:
            self.eval_sampler = Sampler(
                nnx.merge(self.models.actor, self._local_params()),
                batch_size=len(batch_envs),
                capacity=cfg.max_len,
            )
        self.eval_sampler.state = self._local_params()
        out = collect(
            batch_envs,
            self.codec,
            self.eval_sampler,
            group_ids=groups,
            max_len=cfg.max_len,
            max_new_tokens=self.max_new,
            temperature=cfg.temperature,
            seed=10**6 + step,
        )
        success = gather_array(np.array([ep["success"] for ep in out.episodes], float))
        success = success.reshape(-1, k)
        correct = success.sum(axis=1).astype(int)
        return {
            "eval_success_rate": float(success.mean()),
            "eval_pass@1": float(np.mean([pass_at_k(k, c, 1) for c in correct])),
            f"eval_pass@{k}": float(np.mean([pass_at_k(k, c, k) for c in correct])),
        }


def step_metrics(rollouts, batch: TurnBatch, credit) -> dict[str, float]:
    eps = rollouts.episodes
    mask = batch.loss_mask
    out = {
        "success_rate": float(np.mean([e["success"] for e in eps])),
        "reward_mean": float(np.mean([e["reward"] for e in eps])),
        "turns_mean": float(np.mean([e["turns"] for e in eps])),
        "truncated_frac": float(np.mean([e["truncated"] for e in eps])),
        "tokens": int(sum(e["tokens"] for e in eps)),
        "action_tokens": int(mask.sum()),
        "advantage_mean": float(np.asarray(credit.advantages)[mask].mean()) if mask.any() else 0.0,
    }
    if batch.values is not None and credit.returns is not None:
        out["explained_variance"] = float(
            diagnostics.explained_variance(batch.values, credit.returns, mask)
        )
        out["turn_variance_fraction"] = float(
            diagnostics.median_turn_variance_fraction(batch.values, mask, batch.turn_ids)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """One process of a run (several under ``jax.distributed``; see train/distributed.py). With
    several, the run directory must be on a filesystem they share; process 0 writes the config
    and metrics, and all of them write their checkpoint shards."""
    initialize_from_env()
    cfg = parse_args(argv)
    run_dir = Path(cfg.run_dir)
    lead = jax.process_index() == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    if lead:
        save_config(cfg, run_dir / "config.json")
    trainer = Trainer(cfg)
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    if cfg.resume and checkpoints.latest() is not None:
        trainer.state = checkpoints.restore(trainer.state)
    elif not cfg.resume and checkpoints.latest() is not None:
        print(
            f"{run_dir} has checkpoints; pass --resume to continue it or choose another --run-dir",
            file=sys.stderr,
        )
        return 2
    start = int(trainer.state["step"])
    log = None
    if lead:
        log = MetricsLog(run_dir, start_step=start, progress=cfg.progress, total=cfg.steps)
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        rollouts = trainer.rollout(step)
        t1 = time.perf_counter()
        batch = trainer.score(rollouts)
        credit = algorithms.compute_advantages(trainer.algo, batch)
        t2 = time.perf_counter()
        update = trainer.update(batch, credit)
        t3 = time.perf_counter()
        trainer.state["step"] = step + 1
        metrics = {"step": step + 1, **step_metrics(rollouts, batch, credit), **update}
        total = t3 - t0
        tokens = metrics["tokens"]
        metrics.update(
            rollout_s=t1 - t0,
            scoring_s=t2 - t1,
            update_s=t3 - t2,
            rollout_tok_s=tokens / max(t1 - t0, 1e-9),
            scoring_tok_s=tokens / max(t2 - t1, 1e-9),
            update_tok_s=tokens / max(t3 - t2, 1e-9),
            rollout_frac=(t1 - t0) / total,
            scoring_frac=(t2 - t1) / total,
            update_frac=(t3 - t2) / total,
            sampler_logp_gap=trainer.sampler_gap,
        )
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            metrics.update(trainer.evaluate(step + 1))
        if log is not None:
            log.write(metrics)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            checkpoints.save(step + 1, trainer.state)
            if log is not None:
                log.flush()
    checkpoints.wait()
    if log is not None:
        log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
