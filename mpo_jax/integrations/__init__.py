"""Our estimators and losses inside other people's trainers.

Each integration is a module of its own, imported by name (``import mpo_jax.integrations.verl``),
never by ``import mpo_jax``: the core stays free of torch and of the trainers' own packages.
"""
