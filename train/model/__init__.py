"""The model: Qwen3 dense and MoE (and the Llama/Qwen2 relatives that cost a flag) in flax.nnx,
Hugging Face checkpoints read and written (``weights``), and the table of rules that maps each
parameter's logical axis names to a device mesh (``sharding``). Nothing here knows about RL."""
