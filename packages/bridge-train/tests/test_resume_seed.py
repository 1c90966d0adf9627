"""The seed a run resumed under another parallel layout continues with.

Its saved generator states are per rank of the saved layout, so ``pretrain`` reseeds every
generator from ``rng.seed`` and the resumed iteration (docs/checkpoints.md, "Dropout and the
RNG across a layout change"). End to end (two ranks, dropout):
``tests/test_megatron_checkpoints.py::test_dropout_after_a_layout_change`` (extended).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from bridge.config import RNGConfig
from bridge.train.engine.initialize import resume_seed, seed_from_rng_config


def test_resume_seed_is_a_function_of_seed_and_iteration() -> None:
    seeds = {resume_seed(1234, iteration) for iteration in range(1, 200)}
    assert len(seeds) == 199  # no two iterations share one
    assert resume_seed(1234, 7) == resume_seed(1234, 7) != resume_seed(1235, 7)
    # megatron adds up to 100 x pipeline rank and 2718 + tensor rank: still a valid seed.
    assert all(0 <= seed < 2**31 - 2**24 for seed in seeds)


def test_reseeding_at_a_resume_differs_from_a_fresh_start() -> None:
    """Every generator (Python, NumPy, torch) starts from the resume seed, not from the
    fresh-start seed whose draws a fresh run already made."""
    rng = RNGConfig(seed=1234)

    def draws() -> tuple[float, float, torch.Tensor]:
        return random.random(), float(np.random.rand()), torch.rand(3)

    seed_from_rng_config(rng)
    fresh = draws()
    used = seed_from_rng_config(rng, 10)
    resumed = draws()
    seed_from_rng_config(rng, 10)
    again = draws()
    assert used == resume_seed(1234, 10)
    assert resumed[:2] == again[:2] and torch.equal(resumed[2], again[2])
    assert resumed[:2] != fresh[:2] and not torch.equal(resumed[2], fresh[2])
