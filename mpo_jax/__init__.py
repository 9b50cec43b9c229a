"""mpo-jax: credit assignment for multi-turn LLM agents (MPO, TRACE, PPO, GRPO-family), in JAX.

The core is pure, jittable functions on padded [B, T] turn-segment arrays (docs/design.md §2):

    from mpo_jax import advantages, losses
    adv = advantages.multiscale_advantages(rewards, values, loss_mask, turn_ids,
                                           gamma_turn=1.0, lam_turn=0.95,
                                           gamma_token=1.0, lam_token=0.95, beta=0.5)
"""

from mpo_jax import advantages, algorithms, batch, diagnostics, losses, scan
from mpo_jax.batch import TurnBatch, validate

__all__ = [
    "advantages",
    "algorithms",
    "batch",
    "diagnostics",
    "losses",
    "scan",
    "TurnBatch",
    "validate",
]
__version__ = "0.1.0"
