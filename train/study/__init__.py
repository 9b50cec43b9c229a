"""The research harness of the credit-assignment studies: round 1 (``python -m
train.study.round1``), round 2 (``python -m train.study.round2``) and their statistics (``stats``:
bootstrap intervals, areas under curves). It launches ``python -m train.run`` child processes and
reads their metrics; nothing in the library imports it."""
