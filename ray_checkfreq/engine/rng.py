"""Each rank's own RNG states out of a checkpoint that holds every rank's, and seeds for new ranks."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ray_checkfreq.engine.seams import set_local_rng_state


def set_own_rng(saved: Any, *, rank: int, seed: int) -> None:
    """This rank's states from ``saved``: ``{"world_size": W, "ranks": states}`` where
    ``states`` is a list by rank (every rank's, gathered) or a mapping ``{rank: state}``
    (the ranks a sharded restore read), or a single process's states. A rank ``states``
    lacks (the world grew) is seeded from ``(seed, rank, W)``."""
    ranks = saved.get("ranks") if isinstance(saved, Mapping) else None
    if ranks is None:
        set_local_rng_state(saved)  # a single-process checkpoint
    elif isinstance(ranks, Mapping):
        if rank in ranks:
            set_local_rng_state(ranks[rank])
        else:
            seed_new_rank(seed, rank, int(saved["world_size"]))
    elif rank < len(ranks):
        set_local_rng_state(ranks[rank])
    else:
        seed_new_rank(seed, rank, int(saved["world_size"]))


def seed_new_rank(seed: int, rank: int, saved_world_size: int) -> None:
    """A rank the checkpoint has no RNG state for (the world grew): seeded from (seed, rank)."""
    sequence = np.random.SeedSequence([seed, rank, saved_world_size])
    value = int(sequence.generate_state(1, dtype=np.uint32)[0])
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)
