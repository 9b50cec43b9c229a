"""The trainer side of mpo-jax: models, generation, the RL step, and the commands that drive them.

Subpackages, one job each (imports run one way: ``model`` <- ``engine`` <- ``core`` <- the
commands <- ``study``; see tests/test_layers.py):

- ``train.model``: Qwen3 (and the Llama/Qwen2 relatives) in flax.nnx, checkpoints in and out
  (Hugging Face folders; GGUF files converted to them), the sharding rules that place its
  parameters on a mesh.
- ``train.engine``: generation: the KV-cache sampler that turns token ids into a turn's tokens
  and their log-probs.
- ``train.core``: the trainer's core: configuration, building a run's models, scoring, the jitted
  updates, checkpoints, metrics, evaluation, asynchronous rollouts, several hosts.
- ``train.study``: the research harness of the credit-assignment studies (it only imports).

The commands a user types are the modules at this level, each ``python -m train.<command>``:
``run`` (train), ``evaluate``, ``export``, ``plan`` (memory), ``plot``, ``sft`` (warm start),
``convert_gguf`` (a GGUF file as a Hugging Face folder).
"""
