"""Generation: token ids in, a turn's sampled token ids and their log-probs out. ``sampler`` is
the KV-cache sampler over ragged batches of conversations; the rollout loop (``envs.rollout``)
drives it through the ``Policy`` protocol. Depends on ``train.model`` only."""
