"""The trainer's core: a run's typed configuration (``config``), its models and codec
(``build``), the step (``trainer``: rollout -> scoring -> credit -> update), scoring and the jitted
updates (``scoring``, ``learner``), which tasks a step draws (``episodes``), held-out evaluation
(``evaluation``), checkpoints and metrics, rollouts ahead of the learner (``async_rollouts``) and
several hosts (``distributed``). The commands at ``train.<command>`` are its only users."""
