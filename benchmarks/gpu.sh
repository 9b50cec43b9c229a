#!/usr/bin/env bash
# The GPU checks, as one prepared script for a machine with an NVIDIA GPU (Python 3.12 there):
# a Qwen3-0.6B-shaped random model (28 layers, width 1024, 16 query / 8 key-value heads of 128,
# MLP 3072, vocab 151,936, bfloat16): the training step at 8k tokens (tokens/s and MFU, cuDNN
# attention), sampler throughput, chunked log-prob memory, the advantage estimators.
# Usage: bash benchmarks/gpu.sh  (writes its tables to stdout and to $OUT when set)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "jax[cuda12]" "flax>=0.12.10" optax orbax-checkpoint chex transformers \
  jinja2 safetensors tensorboardX tqdm matplotlib
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp}
python3 -c "import jax; print(jax.__version__, jax.devices())"
python3 benchmarks/train_step.py --seq 8192 --rows 1 --dtype bfloat16 --remat full \
  | tee "$out/train_step_gpu.md"
python3 benchmarks/train_step.py --seq 8192 --rows 4 --dtype bfloat16 --remat dots \
  | tee -a "$out/train_step_gpu.md"
python3 benchmarks/sampler.py --layers 28 --width 1024 --heads 16 --kv-heads 8 --head-dim 128 \
  --mlp 3072 --dtype bfloat16 --batches 1,8,64 --reps 3 | tee "$out/sampler_gpu.md"
python3 benchmarks/logprobs.py --tokens 8192 --width 1024 --reps 5 | tee "$out/logprobs_gpu.md"
python3 benchmarks/advantages.py --sizes 256x32768 --reps 5 | tee "$out/advantages_gpu.md"
