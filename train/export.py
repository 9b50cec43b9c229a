"""A run's checkpoint as a Hugging Face folder that transformers, vLLM and SGLang load.

    python -m train.export --run-dir runs/x --out exported/ [--step N] [--dtype bfloat16]
    python -m train.export --run-dir runs/x --out exported/ --critic   # the critic beside it
    python -m train.export --run-dir runs/lora --out adapters/ --adapters   # LoRA: PEFT's folder

Reads the run's ``config.json`` and the actor alone from its checkpoint (no trainer, sampler,
optimizer or critic is built; ``--critic`` reads the critic too) and writes to ``--out``:
``config.json`` and ``model.safetensors`` (sharded with an index past 5 GiB), the tokenizer files
and chat template the run spoke (for the chat environments), ``generation_config.json`` (the
source checkpoint's, or one naming the run's stop tokens and temperature) and
``mpo_jax_export.json`` (where it came from). ``--critic`` adds ``critic/``: the critic's trunk
under the causal LM's names plus ``value_head.weight`` and ``value_head.bias``, which
``train.run --critic-from OUT/critic`` reads back. ``train.run --init-from OUT`` (or
``--model-path OUT``) starts a new run from the export.

A LoRA run (``--lora-rank``) exports either the merged model (the default: the base re-read, the
adapters added in, the folder above) or, with ``--adapters``, the actor's adapters alone as a PEFT
folder (``adapter_config.json``, ``adapter_model.safetensors``;
[`train.model.lora.save_peft`][train.model.lora.save_peft]) that ``peft.PeftModel.from_pretrained``
puts on the transformers base, that ``train.evaluate --model-path BASE --adapter OUT`` evaluates and
``train.run --init-from OUT`` starts from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp

import envs
from train.core.build import model_config, model_source, restore_model, run_codec, run_config
from train.core.checkpoint import Checkpoints
from train.model.weights import save_pretrained

__all__ = ["main", "export", "export_adapters"]


def _generation_config(cfg, codec, source_folder: str | None) -> dict:
    """The source checkpoint's generation_config.json, or one naming the run's stop tokens."""
    if source_folder and (Path(source_folder) / "generation_config.json").exists():
        return json.loads((Path(source_folder) / "generation_config.json").read_text())
    stops = list(getattr(codec, "stop_ids", ()))
    out = {"do_sample": True, "temperature": cfg.temperature}
    if stops:
        out.update(eos_token_id=stops, pad_token_id=stops[-1])
    return out


def export(
    run_dir: Path, out: Path, *, step: int | None = None, dtype: str | None = None, critic=False
) -> Path:
    """Writes the export (see the module docstring); refuses a non-empty ``out``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out: {out} exists and is not empty (nothing was written)")
    cfg = run_config(run_dir)
    if critic and not (Path(run_dir) / "checkpoints").exists():
        raise FileNotFoundError(f"--run-dir: {run_dir} has no checkpoint")
    probe = envs.make(cfg.env, seed=0, **{"split": "train", **cfg.env_set})
    codec = run_codec(cfg, probe)
    mc = model_config(cfg, codec)
    actor = restore_model(run_dir, mc, step=step)
    critic_model = None
    if critic:
        try:
            critic_model = restore_model(run_dir, mc, step=step, part="critic")
        except (KeyError, FileNotFoundError, ValueError) as e:
            raise ValueError(f"--critic: the run {run_dir} has no critic ({e})") from e
    np_dtype = None if dtype is None else jnp.dtype(dtype)
    save_pretrained(actor, out, dtype=np_dtype)
    source = model_source(cfg)
    if hasattr(codec, "tokenizer"):
        codec.tokenizer.save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps(_generation_config(cfg, codec, source.folder), indent=2) + "\n"
    )
    if critic_model is not None:
        save_pretrained(critic_model, out / "critic", dtype=np_dtype)
    step = step if step is not None else Checkpoints(Path(run_dir) / "checkpoints").latest()
    meta = {
        "run_dir": str(Path(run_dir).absolute()),
        "step": step,
        "preset": cfg.preset,
        "env": cfg.env,
        "source": source.path,
        "chat_template": getattr(codec, "source", None),
        "enable_thinking": cfg.enable_thinking,
        "dtype": str(np_dtype or mc.param_dtype),
        "critic": bool(critic),
    }
    (out / "mpo_jax_export.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def export_adapters(run_dir: Path, out: Path, *, step: int | None = None) -> Path:
    """Writes a LoRA run's actor adapters at ``step`` as a PEFT folder (refuses a run without
    LoRA, and a non-empty ``out``)."""
    from train.core.build import restore_adapters
    from train.model.lora import save_peft
    from train.model.qwen3 import Qwen3ForCausalLM

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out: {out} exists and is not empty (nothing was written)")
    cfg = run_config(run_dir)
    if not cfg.lora_rank:
        raise ValueError(f"--adapters: {run_dir} trained the full model (no --lora-rank); "
                         "export it without --adapters")  # fmt: skip
    codec = run_codec(cfg, envs.make(cfg.env, seed=0, **{"split": "train", **cfg.env_set}))
    checkpoints = Checkpoints(Path(run_dir) / "checkpoints", create=False)
    r = restore_adapters(cfg, checkpoints, model_config(cfg, codec), step, Qwen3ForCausalLM)
    save_peft(out, r.trainable, r.mc, base_path=r.path, base_hash=r.fingerprint)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, help="the run directory of train.run / train.sft")
    p.add_argument("--out", required=True, help="the Hugging Face folder to write (new or empty)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="weights' dtype (default: as trained)"
    )
    p.add_argument("--critic", action="store_true", help="also write the critic to OUT/critic")
    p.add_argument(
        "--adapters",
        action="store_true",
        help="a LoRA run: the actor's adapters alone, as a PEFT folder (default: merged model)",
    )
    args = p.parse_args(argv)
    try:
        if args.adapters:
            if args.critic or args.dtype:
                raise ValueError("--adapters: writes the actor's float32 adapters alone; drop "
                                 "--critic and --dtype")  # fmt: skip
            out = export_adapters(Path(args.run_dir), Path(args.out), step=args.step)
        else:
            out = export(
                Path(args.run_dir),
                Path(args.out),
                step=args.step,
                dtype=args.dtype,
                critic=args.critic,
            )
    except (ValueError, FileNotFoundError) as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
