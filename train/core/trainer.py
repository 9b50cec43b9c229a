"""The trainer: one run's models, optimizers, environments and sampler, and its step.

The loop is [`Trainer.step`][train.core.trainer.Trainer.step], one call into a module with one job
per phase:

    rollouts = play(envs, codec, sampler)        train/engine/ (rollout engine, KV-cache sampler)
    batch    = score(rollouts)                   train/core/scoring.py (old/ref log-probs, values)
    credit   = compute_advantages(algo, batch)   mpo_jax/algorithms.py
    metrics  = update(batch, credit)             train/core/learner.py: epochs x minibatches x
                                                 micro-batches
    log, checkpoint, then evaluate               train/run.py (a failing evaluation loses nothing)

Held-out evaluation runs on the environment's ``--eval-split`` (default ``test``: tasks training
never draws); environments with small task spaces are also evaluated on fresh episodes of the
training split. Each set is logged under its own name (``eval_heldout_*``, ``eval_fresh_*``).
The command that drives it is ``python -m train.run`` (train/run.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import envs
from envs.rollout import EPISODE_FIGURES
from mpo_jax import algorithms, diagnostics, losses
from mpo_jax.batch import TurnBatch, num_turns, validate
from train.core.build import compute_dtype as resolve_compute_dtype
from train.core.build import (
    initial_actor,
    model_config,
    model_source,
    needs_reference,
    run_codec,
)
from train.core.config import (
    TrainConfig,
    check_mesh_fit,
)
from train.core.distributed import (
    gather_rollouts,
    is_multiprocess,
    put_global,
    to_host,
)
from train.core.episodes import (
    EVAL_STREAM,
    TRAIN_STREAM,
    fit_tasks,
    length_budget,
    make_episodes,
    sampling_key,
)
from train.core.evaluation import evaluate_set, evaluation_due
from train.core.learner import Models, UpdateFns, loss_fields, make_optimizer, split_micro
from train.core.metrics import PhaseTimer
from train.core.preflight import check_split_draws
from train.core.roles import build_roles, check_resumed_base
from train.core.scoring import Scorer
from train.engine.remote import collect_remote
from train.engine.rollouts import play
from train.engine.sampler import Sampler
from train.engine.servers import connect
from train.engine.weight_sync import AdapterFolder, WeightPush
from train.model.sharding import (
    MeshShape,
    batch_sharding,
    batch_ways,
    param_shardings,
    shard_params,
)

__all__ = ["Trainer", "CREDIT_PROBES", "StartupError", "rollout_metrics"]

# Estimators whose credit is correlated with the environment's decision grades on every batch
# (the same batch and critic for all of them): credit quality apart from optimisation noise.
CREDIT_PROBES = ("ppo", "turn_ppo", "mpo", "grpo", "rloo")


class StartupError(ValueError):
    """A configuration refused before anything is written (the message names the flag)."""


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr)


class Trainer:
    """Holds the models, optimizers, environments and sampler of one run.

    Construction validates everything that can be checked before a rollout (the environment, its
    tasks against the length budget, the preset against the environment, the codec against the
    model, the mesh and every size relation) and writes nothing. Only what is read is built: the
    critic for critic presets, the reference model where a KL term, ``ref_kl`` or TRACE reads it.
    """

    def __init__(self, cfg: TrainConfig):
        self.algo = algorithms.get(cfg.preset, **cfg.algo_set)
        defaulted = cfg.defaulted_fields
        cfg = dataclasses.replace(cfg, compute_dtype=resolve_compute_dtype(cfg.compute_dtype))
        self.env_options = {"split": "train", **cfg.env_set}
        self.eval_options = {**cfg.env_set, "split": cfg.eval_split, **cfg.eval_env_set}
        probe = envs.make(cfg.env, seed=0, **self.env_options)
        eval_probe = envs.make(cfg.env, seed=0, **self.eval_options)  # fails now, not later
        if cfg.eval_every:  # a held-out task drawn now, not after the first steps' work
            check_split_draws(cfg.env, self.eval_options, flag="--eval-split")
        if self.algo.needs_reference_answers and not probe.gold_answers:
            raise StartupError(
                f"preset: {cfg.preset} scores the reference model's belief in each task's gold "
                f"answer, and {cfg.env} has none; choose a preset without TRACE"
            )
        self.eval_fresh = bool(probe.eval_fresh) and cfg.eval_split != "train"
        self.source = model_source(cfg)
        if self.source.kind == "hf":  # the checkpoint's config first: it names what is wrong
            model_config(cfg, None, self.source)
        self.codec = run_codec(cfg, probe)
        self.model_config = mc = model_config(cfg, self.codec, self.source)
        if hasattr(self.codec, "check_vocabulary"):
            self.codec.check_vocabulary(mc.vocab_size, model=self.source.path or "the model")
        self.max_new = cfg.max_new_tokens or probe.turn_budget or 256
        max_len = length_budget(cfg.max_len, probe, self.codec, name=cfg.env, say=_say)
        self.cfg = cfg = dataclasses.replace(cfg, max_len=max_len)
        for env, options in ((probe, self.env_options), (eval_probe, self.eval_options)):
            fit_tasks(
                env,
                self.codec,
                options,
                name=cfg.env,
                max_len=max_len,
                max_new_tokens=self.max_new,
                drop=cfg.drop_long_tasks,
                say=_say,
            )
        self.mesh = self.micro_sharding = None
        mesh_shape = cfg.mesh_shape() or (MeshShape() if is_multiprocess() else None)
        if mesh_shape:  # several processes: one global mesh (default: data-parallel over all)
            self.mesh = mesh_shape.make()
            self.micro_sharding = batch_sharding(self.mesh)
        # a micro-batch's row count divides by this (the data-parallel ways of the mesh)
        self.row_multiple = batch_ways(self.mesh) if self.mesh else 1
        check_mesh_fit(cfg, self.row_multiple, jax.process_count())
        if defaulted and cfg.pretrained:
            chosen = " ".join(f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in defaulted)
            _say(f"defaults for a pretrained model: {chosen} (pass a flag to change one)")

        actor = self._actor()
        self.roles = build_roles(
            cfg,
            actor,
            needs_critic=self.algo.needs_critic,
            needs_reference=needs_reference(cfg, self.algo),
            place=self._place,
        )
        if cfg.resume:
            try:
                check_resumed_base(self.roles, f"{cfg.run_dir}/checkpoints")
            except ValueError as e:
                raise StartupError(str(e)) from e
        self.state: dict = {**self.roles.trainable, "step": 0}
        if self.roles.lora:
            self.state["base"] = self.roles.base  # a checkpoint names its base
        opt = dict(
            warmup_steps=cfg.warmup_steps,
            updates_per_step=cfg.epochs * cfg.minibatches,
            clip=cfg.grad_clip,
            weight_decay=cfg.weight_decay,
        )
        self.models = Models(self.roles.actor_def, self.roles.critic_def)
        self.fns = UpdateFns(
            self.models,
            self.algo,
            make_optimizer(cfg.lr, **opt),
            make_optimizer(cfg.critic_lr, **opt),
            temperature=cfg.temperature,
            entropy_coef=cfg.entropy_coef,
            opt_dtype=jnp.dtype(cfg.opt_dtype),
        )
        for which in ("actor", "critic"):
            if which in self.state:
                self.state[f"{which}_opt"] = self.fns.init(which, self.state[which])
        # The reference model is the initial weights (LoRA: the base), where something reads it.
        self.ref = self.roles.ref_params
        self.batch_size = cfg.prompts_per_step * cfg.group_size
        self.push = self._servers() if cfg.rollout_backend != "jax" else None
        # One sampler for training and evaluation: its cache lives only during a rollout.
        self.sampler = Sampler(
            actor, capacity=cfg.max_len, mesh=None if is_multiprocess() else self.mesh
        )
        # Device work happens under self.device (a FairLock shared with an asynchronous rollout
        # worker; nothing without one). The off-policy correction runs where data can be stale.
        self.device = contextlib.nullcontext()
        self.behaviour = cfg.max_staleness > 0 and cfg.is_level != "none"
        self.scorer = Scorer(
            rows=cfg.micro_rows,
            max_tokens=cfg.micro_batch_tokens,
            multiple=self.row_multiple,
            temperature=cfg.temperature,
            put=self._put,
            to_host=to_host,
        )
        self._probe_algos = [algorithms.get(n) for n in CREDIT_PROBES]
        self._credit = jax.jit(
            algorithms.compute_advantages, static_argnums=0, static_argnames="need_returns"
        )

    # -- construction ----------------------------------------------------------------------------

    def _actor(self):
        """The initial policy, its parameters placed on the mesh (read shard by shard from a
        checkpoint)."""
        cfg, mc = self.cfg, self.model_config
        if self.mesh is None:
            return initial_actor(cfg, mc)
        from train.core.build import abstract_actor

        shardings = param_shardings(nnx.state(abstract_actor(mc)), self.mesh)
        actor = initial_actor(cfg, mc, shardings=shardings)
        graphdef, params = nnx.split(actor)
        return nnx.merge(graphdef, self._place(params))

    def _servers(self) -> WeightPush:
        """The inference servers the rollouts are sampled on, and the push of weights to them."""
        cfg = self.cfg
        if is_multiprocess():
            raise StartupError(
                f"rollout_backend: {cfg.rollout_backend} from a multi-process learner is not "
                "supported yet (run the learner as one process, or use --rollout-backend jax)"
            )
        servers = connect(cfg.rollout_backend, cfg.rollout_urls(), timeout=cfg.rollout_timeout)
        root = cfg.rollout_weights_dir or f"{cfg.run_dir}/rollout-weights"
        lora = None
        if self.roles.lora:
            base = self.roles.base
            lora = AdapterFolder(self.roles.adapted_cfg, base["path"], base["fingerprint"])
        return WeightPush(servers, self.roles.sample_def, root, dtype=cfg.rollout_weights_dtype,
                          lora=lora, mode=cfg.rollout_push)  # fmt: skip

    def _on_mesh(self, *, sampling: bool = False):
        """The mesh as JAX's current mesh during device work (the model then keeps activation
        rows split over the data axes: train.model.qwen3.constrain_rows); none without a mesh, nor
        for the sampler of a multi-process run, which samples with this host's own copy."""
        if self.mesh is None or (sampling and is_multiprocess()):
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    def _place(self, params):
        return params if self.mesh is None else shard_params(params, self.mesh)

    def resolved(self) -> dict:
        """What config.json records beside the flags: the resolved algorithm."""
        return dataclasses.asdict(self.algo)

    # -- the RL step -------------------------------------------------------------------------------

    def step(self, step: int, rollouts=None) -> dict[str, float]:
        """One RL step: rollout (or the ``rollouts`` an asynchronous worker made), scoring,
        credit, update. Evaluation is not part of it:
        [`evaluate`][train.core.trainer.Trainer.evaluate] runs when
        [`evaluation_due`][train.core.trainer.Trainer.evaluation_due], after the step's metrics and
        checkpoint are written."""
        timer = PhaseTimer()
        with timer("rollout"):
            rollouts = self.rollout(step) if rollouts is None else rollouts
        with timer("scoring"):
            batch, scored = self.score(rollouts)
            if self.cfg.validate_batches:
                validate(batch, vocab_size=self.codec.vocab_size)
        with timer("credit"):
            credit = self._credit(self.algo, batch)
            credit_metrics = self.credit_metrics(rollouts, batch, credit)
        with timer("update"):
            update = self.update(batch, credit)
        self.state["step"] = step + 1
        tokens = int(sum(e["tokens"] for e in rollouts.episodes))
        metrics = {
            "step": step + 1,
            **rollout_metrics(rollouts),
            **scored,
            **credit_metrics,
            **update,
            **timer.metrics(tokens),
        }
        return metrics

    def evaluation_due(self, steps_done: int) -> bool:
        """Whether held-out evaluation runs after ``steps_done`` steps: every ``--eval-every``
        steps and after the last one. The caller runs it once the step is saved (train/run.py)."""
        return evaluation_due(steps_done, self.cfg.eval_every, self.cfg.steps)

    def _local_params(self):
        """The weights the actor samples with (LoRA: merged), on this process's devices."""
        weights = self.roles.sampling(self.state["actor"])
        if not is_multiprocess():
            return weights
        return jax.tree.map(lambda x: jnp.asarray(to_host(x)), weights)

    def _put(self, x):
        """A host array (the same on every process) as a jit input: rows split over the data
        axes when they divide evenly, replicated otherwise; plain ``jnp`` without a mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        rows = batch_sharding(self.mesh)
        if len(x) % batch_ways(self.mesh):
            rows = jax.sharding.NamedSharding(self.mesh, jax.P())
        return put_global(x, rows)

    def _rollout_params(self):
        """What the step's rollouts sample with: the sampler's weights, or for a LoRA run on
        servers its base and (a copy of) its adapters apart, which the push sends as adapters or
        merges ([`WeightPush`][train.engine.weight_sync.WeightPush])."""
        if self.push is not None and self.roles.lora:
            return self.roles.pushed(jax.tree.map(jnp.copy, self.state["actor"]))
        return self._local_params()

    def rollout(self, step: int):
        """The step's rollouts: this process's share, then every process's (the global batch)."""
        return gather_rollouts(self.local_rollouts(step, self._rollout_params(), self.sampler))

    def local_rollouts(self, step: int, params, sampler, publish=None, version=None):
        """This process's share of the step's rollouts, sampled with ``params`` (policy version
        ``version``, default ``step``); ``publish`` (the asynchronous worker's) hands the engine
        newer weights between decode chunks. With a server backend, ``params`` go to the servers
        first unless they hold that version."""
        cfg = self.cfg
        batch_envs, groups = make_episodes(
            cfg.env,
            seed=cfg.seed,
            step=step,
            prompts=cfg.prompts_per_step,
            group=cfg.group_size,
            options=self.env_options,
        )
        key = sampling_key(cfg.seed, TRAIN_STREAM, step, jax.process_index())
        if self.push is not None:
            pushed = self.push(params, step if version is None else version)
            out = collect_remote(
                batch_envs,
                self.codec,
                self.push.servers,
                group_ids=groups,
                max_len=cfg.max_len,
                max_new_tokens=self.max_new,
                temperature=cfg.temperature,
                seed=key,
                concurrency=cfg.rollout_concurrency,
            )
            out.stats.sync = self.push.figures() if pushed else {}
            return out
        sampler.state = params
        with self._on_mesh(sampling=True):
            return play(
                batch_envs,
                self.codec,
                sampler,
                cfg.engine_settings(),
                group_ids=groups,
                max_len=cfg.max_len,
                max_new_tokens=self.max_new,
                temperature=cfg.temperature,
                seed=key,
                publish=publish,
            )

    def score(self, rollouts) -> tuple[TurnBatch, dict[str, float]]:
        with self._on_mesh():
            return self._score(rollouts)

    def _score(self, rollouts) -> tuple[TurnBatch, dict[str, float]]:
        """The batch with old (actor) and reference log-probs, critic values and bootstrap values
        (the critic's value after the last action token, for truncated rows; 0 for finished
        ones), and TRACE's answer log-probs, scored micro-batch by micro-batch
        (`train.core.scoring.Scorer`); plus what scoring measures (sampler gap, KL to the
        reference)."""
        b, scorer, actor = rollouts.batch, self.scorer, self.models.actor
        groups, shape = scorer.groups(b), b.tokens.shape
        roles = self.roles
        actor_params = roles.params("actor", self.state["actor"])
        fields = {"old_logp": scorer.logprobs(actor, actor_params, groups, shape)}
        gap = np.where(b.loss_mask, b.sampler_logp - fields["old_logp"], 0)
        scored = {"sampler_logp_gap": float(np.abs(gap).max(initial=0))}
        if self.algo.needs_critic:
            # the bootstrap state: the conversation up to and including its last action token
            critic_params = roles.params("critic", self.state["critic"])
            values, boot = scorer.values(
                self.models.critic, critic_params, groups, b.row_lengths(), shape
            )
            fields["values"] = values
            fields["bootstrap_values"] = np.where(b.truncated, boot, 0).astype(np.float32)
        if self.ref is not None and (self.algo.kl_coef or self.cfg.log_ref_kl):
            fields["ref_logp"] = scorer.logprobs(roles.ref_def, self.ref, groups, shape)
            kl = losses.kl_penalty(fields["old_logp"], fields["ref_logp"], b.loss_mask, kind="k3")
            scored["ref_kl"] = float(np.sum(kl) / max(int(b.loss_mask.sum()), 1))
        if self.algo.needs_reference_answers:
            fields["answer_logprobs"] = self._trace_scores(rollouts)
        if self.behaviour:
            fields["is_weights"], off_policy = self._behaviour_weights(b, fields["old_logp"])
            scored.update(off_policy)
        return dataclasses.replace(b, **fields), scored

    def _behaviour_weights(self, b: TurnBatch, proximal: np.ndarray):
        """The off-policy correction (decoupled PPO): truncated weights proximal / behaviour at
        ``--is-level`` (``mpo_jax.losses.behaviour_weights``), and what it did: the KL between the
        two policies (k3 on the behaviour's samples), the share of action tokens and turns whose
        weight was truncated or masked."""
        cfg, mask = self.cfg, b.loss_mask
        kwargs = dict(level=cfg.is_level, reduce=cfg.is_reduce, mask_bound=cfg.is_mask or None)
        weights = losses.behaviour_weights(
            proximal, b.sampler_logp, mask, b.turn_ids, cap=cfg.is_cap, **kwargs
        )
        raw = np.asarray(losses.behaviour_weights(
            proximal, b.sampler_logp, mask, b.turn_ids, cap=None, **{**kwargs, "mask_bound": None}
        ))  # fmt: skip
        weights = np.asarray(weights, np.float32)
        tokens = max(int(mask.sum()), 1)
        truncated, masked = mask & (raw > cfg.is_cap), mask & (weights == 0) & (raw > 0)
        rows, cols = np.nonzero(truncated | masked)
        hit_turns = len(set(zip(rows.tolist(), b.turn_ids[rows, cols].tolist(), strict=True)))
        turns = max(int(np.sum(num_turns(mask, b.turn_ids))), 1)
        gap = np.where(mask, proximal - b.sampler_logp, 0)
        return weights, {
            "behaviour_kl": float(np.sum(np.where(mask, np.expm1(gap) - gap, 0)) / tokens),
            "is_truncated_frac": float(truncated.sum() / tokens),
            "is_masked_frac": float(masked.sum() / tokens),
            "is_turn_affected_frac": hit_turns / turns,
            "is_weight_mean": float(weights[mask].mean()) if mask.any() else 1.0,
        }

    def _trace_scores(self, rollouts) -> np.ndarray:
        b = rollouts.batch
        rows, cols = np.nonzero(b.boundary_mask)
        width = max(1, max(len(a) for a in rollouts.answer_ids))
        answers = np.zeros((len(rows), width), np.int32)
        alen = np.zeros(len(rows), np.int32)
        for n, r in enumerate(rows):
            ids = rollouts.answer_ids[r]  # every task has one: the start-up check said so
            answers[n, : len(ids)] = ids
            alen[n] = len(ids)
        scores = self.scorer.answers(
            self.roles.ref_def,
            self.ref,
            b.tokens[rows],
            rollouts.boundary_lengths[rows, cols],
            answers,
            alen,
        )
        out = np.zeros(b.boundary_mask.shape, np.float32)
        out[rows, cols] = np.minimum(scores, 0.0)
        return out

    def credit_metrics(self, rollouts, batch: TurnBatch, credit) -> dict[str, float]:
        """Advantage statistics, the share of groups whose rollouts all earned the same return
        (``flat_group_frac``: group-relative credit is 0 there), the critic's diagnostics and,
        where the environment grades each turn's decision, the correlation of the run's credit
        (``credit_corr``) and of every probe estimator's on the same batch
        (``credit_corr_<preset>``) with those grades."""
        mask = batch.loss_mask
        adv = np.asarray(credit.advantages)
        out = {
            "advantage_mean": float(adv[mask].mean()) if mask.any() else 0.0,
            "flat_group_frac": float(
                diagnostics.flat_group_fraction(np.asarray(batch.rewards), batch.group_ids)
            ),
        }
        if batch.values is not None and credit.returns is not None:
            out["explained_variance"] = float(
                diagnostics.explained_variance(batch.values, credit.returns, mask)
            )
            out["turn_variance_fraction"] = float(
                diagnostics.median_turn_variance_fraction(batch.values, mask, batch.turn_ids)
            )
        quality = rollouts.turn_quality
        if quality is None or not np.isfinite(quality).any():
            return out

        def corr(advantages):
            c = diagnostics.decision_credit_correlation(advantages, mask, batch.turn_ids, quality)
            return float(c)

        out["credit_corr"] = corr(adv)
        for algo in self._probe_algos:
            if algo.needs_critic and batch.values is None:
                continue
            probe = self._credit(algo, batch, need_returns=False)
            out[f"credit_corr_{algo.name}"] = corr(probe.advantages)
        return {k: v for k, v in out.items() if np.isfinite(v)}

    def update(self, batch: TurnBatch, credit) -> dict[str, float]:
        """Epochs x minibatches of actor (and critic) updates; metrics weighted by tokens (turns
        for the turn clip fraction and turn log-ratios), ``*_max`` the largest of any update."""
        cfg = self.cfg
        returns = None if credit.returns is None else np.asarray(credit.returns)
        batch = batch.replace(advantages=np.asarray(credit.advantages), returns=returns)
        fields = loss_fields(self.algo, behaviour=self.behaviour)
        batch = batch.only("tokens", "loss_mask", "turn_ids", *fields)
        rng = np.random.default_rng(cfg.seed * 31 + self.state["step"])
        totals: dict[str, float] = {}
        for _ in range(cfg.epochs):
            for rows in np.array_split(rng.permutation(self.batch_size), cfg.minibatches):
                with self._on_mesh(), self.device:
                    out = self._minibatch(batch.take_rows(rows))
                for k, v in out.items():
                    merge = max if k.endswith("_max") else (lambda a, b: a + b)
                    totals[k] = merge(totals[k], v) if k in totals else v
        return _summarise_updates(totals)

    def _minibatch(self, mb: TurnBatch) -> dict[str, float]:
        """One optimizer update of the actor (and critic) on a minibatch; returns sums. Each
        micro-batch runs at the padded length of its own longest row."""
        algo, parts = self.algo, self.cfg.micro_batches
        zeros = np.zeros(mb.loss_mask.shape)
        _, normalizer = losses.aggregate(zeros, mb.loss_mask, mb.turn_ids, mode=algo.aggregation)
        tokens = max(float(mb.loss_mask.sum()), 1.0)
        jobs = [("actor", self.fns.actor_grad, (normalizer, tokens))]
        if algo.needs_critic:
            _, v_norm = losses.aggregate(zeros, mb.loss_mask)
            jobs.append(("critic", self.fns.critic_grad, (v_norm,)))
        out = {"updates": 1.0, "skipped_updates": 0.0}
        for which, grad_fn, extra in jobs:
            grads, loss = None, 0.0
            for micro in split_micro(
                mb,
                parts,
                loss_fields(algo, behaviour=self.behaviour),
                max_tokens=self.cfg.micro_batch_tokens,
                multiple=self.row_multiple,
            ):
                n_tok = float(micro.loss_mask.sum())
                n_turns = float(num_turns(micro.loss_mask, micro.turn_ids).sum())
                if self.micro_sharding is not None:
                    micro = put_global(micro, self.micro_sharding)
                params = self.roles.params(which, self.state[which])
                (micro_loss, m), g = grad_fn(params, micro, *extra)
                grads = g if grads is None else self.fns.accumulate(grads, g)
                del g  # not held through the next micro-step or the update (the plan counts one)
                loss = loss + micro_loss
                if which == "actor":
                    sums = {
                        "clip_tokens": float(m["clip_frac"]) * n_tok,
                        "clip_turns": float(m["turn_clip_frac"]) * n_turns,
                        "dual_clip_tokens": float(m["dual_clip_frac"]) * n_tok,
                        "approx_kl_sum": float(m["approx_kl"]) * n_tok,
                        "turn_lr_abs_sum": float(m["turn_log_ratio_abs"]) * n_turns,
                        "turn_mean_lr_abs_sum": float(m["turn_mean_log_ratio_abs"]) * n_turns,
                        "entropy_sum": float(m["entropy_sum"]),
                        "kl_penalty_sum": float(m.get("kl_sum", 0.0)),
                        "tokens": n_tok,
                        "turns": n_turns,
                    }
                    for k, v in sums.items():
                        out[k] = out.get(k, 0.0) + v
                    for k in ("ratio_max", "turn_log_ratio_abs_max"):
                        out[k] = max(out.get(k, 0.0), float(m[k]))
            params, opt, ok, gnorm = self.fns.apply(
                which, self.state[which], self.state[f"{which}_opt"], grads, loss
            )
            self.state[which], self.state[f"{which}_opt"] = params, opt
            out["skipped_updates"] += float(not bool(ok))
            prefix = "policy" if which == "actor" else "value"
            out[f"{prefix}_loss"] = float(loss)
            out[f"{prefix}_grad_norm"] = float(gnorm)
        return out

    def run_async(self, steps: range):
        """The steps' metrics with rollouts from a worker thread that samples ahead of the
        learner (``--max-staleness`` K > 0; train/core/async_rollouts.py): each row records the
        version that sampled it, the correction weights the learner's update, and the step's
        metrics add staleness, the worker's and the learner's time and idle time, and steps/s."""
        from train.core.async_rollouts import FairLock, RolloutWorker

        self.device = lock = FairLock()
        self.sampler.device = self.scorer.device = lock
        worker_sampler = Sampler(
            nnx.merge(self.roles.sample_def, self._local_params()),
            capacity=self.cfg.max_len,
            mesh=None if is_multiprocess() else self.mesh,
            device=lock,
        )

        def newer():  # weights published since the step started: swapped in between chunks
            params, version = worker.newest()
            return (params, version) if version > worker_sampler.version else None

        def generate(step, params):
            worker_sampler.version = version = worker.sampling_version
            return self.local_rollouts(step, params, worker_sampler, newer, version)

        worker = RolloutWorker(
            generate,
            start=steps.start,
            steps=steps.stop,
            max_staleness=self.cfg.max_staleness,
            timeout=self.cfg.worker_timeout,
        )
        worker.publish(steps.start, self._published())
        worker.begin()
        idle = 0.0
        try:
            for step in steps:
                t0 = time.perf_counter()
                local, version, generate_s = worker.take(step)
                waited = time.perf_counter() - t0
                rollouts = gather_rollouts(local)
                versions = row_versions(rollouts, version)
                rollouts.batch = rollouts.batch.replace(policy_version=versions)
                metrics = self.step(step, rollouts=rollouts)
                worker.publish(step + 1, self._published())
                lag = step - versions
                metrics.update(
                    staleness_mean=float(lag.mean()),
                    staleness_max=int(lag.max()),
                    staleness_swapped_frac=float(
                        np.mean(row_versions(rollouts, -1, newest=True) > versions)
                    ),
                    worker_generate_s=generate_s,
                    worker_idle_s=worker.idle_s - idle,
                    learner_wait_s=waited,
                    device_wait_learner_s=lock.waited.get("MainThread", 0.0),
                    device_wait_worker_s=lock.waited.get("rollout-worker", 0.0),
                )
                lock.waited.clear()
                idle = worker.idle_s
                yield metrics
        finally:
            worker.stop()

    def _published(self):
        """A copy of the actor's weights for the worker (the update donates its own; a LoRA
        run's are made anew: merged, or its adapters copied for a server push)."""
        if self.roles.lora:
            return self._rollout_params()
        return jax.tree.map(jnp.copy, self._local_params())

    def evaluate(self, step: int) -> dict[str, float]:
        """Success rate, unbiased pass@k and the environment's own figures on held-out tasks
        (``eval_heldout_*``: the environment's ``--eval-split``, by default tasks training never
        draws) and, for small task spaces, on fresh episodes of the training split
        (``eval_fresh_*``);
        [`train.core.evaluation.evaluate_set`][train.core.evaluation.evaluate_set]. The same tasks
        at every evaluation, so the numbers are comparable; sampling keys of their own stream."""
        name = "heldout" if self.cfg.eval_split == "test" else self.cfg.eval_split
        out = self._evaluate_set(step, name, self.eval_options, 0)
        if self.eval_fresh:
            out.update(self._evaluate_set(step, "fresh", self.env_options, 1))
        return out

    def _evaluate_set(self, step: int, name: str, options: dict, which: int) -> dict[str, float]:
        cfg = self.cfg
        self.sampler.state = self._local_params()
        with self._on_mesh(sampling=True):
            metrics, _ = evaluate_set(
                name,
                env=cfg.env,
                options=options,
                codec=self.codec,
                sampler=self.sampler,
                seed=cfg.seed,
                episodes=cfg.eval_episodes,
                k=cfg.eval_k,
                max_len=cfg.max_len,
                max_new_tokens=self.max_new,
                temperature=cfg.temperature,
                key=sampling_key(cfg.seed, EVAL_STREAM, step * 2 + which, jax.process_index()),
                engine=cfg.engine_settings(),
            )
        return metrics


def _summarise_updates(totals: dict[str, float]) -> dict[str, float]:
    """Sums over a step's updates -> the logged figures: losses and norms averaged over updates,
    fractions weighted by tokens (turns), the largest ratio, the skipped count."""
    n = max(totals.pop("updates", 1.0), 1.0)
    tokens, turns = max(totals.pop("tokens", 0.0), 1.0), max(totals.pop("turns", 0.0), 1.0)
    out = {
        "skipped_updates": int(totals.pop("skipped_updates", 0)),
        "clip_frac": totals.pop("clip_tokens", 0.0) / tokens,
        "turn_clip_frac": totals.pop("clip_turns", 0.0) / turns,
        "dual_clip_frac": totals.pop("dual_clip_tokens", 0.0) / tokens,
        "approx_kl": totals.pop("approx_kl_sum", 0.0) / tokens,
        "entropy": totals.pop("entropy_sum", 0.0) / tokens,
        "ratio_max": totals.pop("ratio_max", 0.0),
        "turn_log_ratio_abs": totals.pop("turn_lr_abs_sum", 0.0) / turns,
        "turn_mean_log_ratio_abs": totals.pop("turn_mean_lr_abs_sum", 0.0) / turns,
        "turn_log_ratio_abs_max": totals.pop("turn_log_ratio_abs_max", 0.0),
    }
    kl_penalty = totals.pop("kl_penalty_sum", 0.0)
    if kl_penalty:
        out["kl_penalty"] = kl_penalty / tokens
    out.update({k: v / n for k, v in totals.items()})
    return out


def row_versions(rollouts, version: int, *, newest: bool = False) -> np.ndarray:
    """Each row's policy version: the oldest (or with ``newest`` the newest) version that sampled
    one of its tokens (the engine may swap weights mid-step), ``version`` where a row has none."""
    tokens = rollouts.token_versions
    if tokens is None:
        return np.full(len(rollouts.batch.tokens), version, np.int32)
    sampled = tokens >= 0
    fill = -1 if newest else np.iinfo(np.int32).max
    pick = np.where(sampled, tokens, fill)
    out = pick.max(axis=1) if newest else pick.min(axis=1)
    return np.where(sampled.any(axis=1), out, version).astype(np.int32)


def rollout_metrics(rollouts) -> dict[str, float]:
    """Per-step means of the episodes' outcomes, how they ended, and the environments' own
    figures (exact match, F1, evidence recall, db match, question pass rate; over the episodes
    that report them)."""
    eps = rollouts.episodes
    truncated = np.array([e["truncated"] for e in eps], bool)
    by_length = np.array([e.get("length_cut", False) for e in eps], bool)
    out = {
        "success_rate": float(np.mean([e["success"] for e in eps])),
        "reward_mean": float(np.mean([e["reward"] for e in eps])),
        "turns_mean": float(np.mean([e["turns"] for e in eps])),
        "truncated_frac": float(truncated.mean()),
        "length_cut_frac": float(by_length.mean()),
        # turns that did not end with the template's end of turn (closed by the rollout)
        "turn_cut_frac": float(
            sum(e.get("turns_cut", 0) for e in eps) / max(sum(e["turns"] for e in eps), 1)
        ),
        "turn_limit_frac": float((truncated & ~by_length).mean()),
        "tokens": int(sum(e["tokens"] for e in eps)),
        "action_tokens": int(rollouts.batch.loss_mask.sum()),
    }
    for key in EPISODE_FIGURES:
        values = [float(e[key]) for e in eps if key in e]
        if values:
            out[f"env_{key}"] = float(np.mean(values))
    if rollouts.stats is not None:  # the continuous engine's slot utilisation and idle share
        out.update(rollouts.stats.figures())
    return out
