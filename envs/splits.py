"""The one train / held-out split every real-data environment uses when its data has none."""

from __future__ import annotations

import random

__all__ = ["SPLIT_SEED", "TEST_FRACTION", "check_split", "split_indices"]

SPLIT_SEED = 20_251_129
TEST_FRACTION = 0.2


def check_split(split: str) -> None:
    if split not in ("train", "test", "all"):
        raise ValueError(f"split: must be 'train', 'test' or 'all', got {split!r}")


def split_indices(n: int, split: str) -> list[int]:
    """Indices of ``n`` items in ``split``: a ``SPLIT_SEED`` shuffle of ``range(n)``, the first
    round(``TEST_FRACTION`` * n) of it ``test``, the rest ``train``, all of it ``all`` (in shuffled
    order; callers that want the data's order sort them)."""
    check_split(split)
    order = list(range(n))
    random.Random(SPLIT_SEED).shuffle(order)
    n_test = int(round(n * TEST_FRACTION))
    return {"test": order[:n_test], "train": order[n_test:], "all": order}[split]
