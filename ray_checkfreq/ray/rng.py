"""Every rank's RNG states in a checkpoint: gathered at each checkpoint, each rank's own on restore."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ray_checkfreq.engine.seams import local_rng_state, set_local_rng_state
from ray_checkfreq.ray.transfer import all_gather_state


def gather_rng(*, world_size: int, group: Any) -> dict:
    """Every rank's RNG states (a collective: every rank calls it at each checkpoint)."""
    ranks = all_gather_state({"rng": local_rng_state()}, world_size=world_size, group=group)
    return {"world_size": world_size, "ranks": [entry["rng"] for entry in ranks]}


def set_own_rng(saved: Any, *, rank: int, seed: int) -> None:
    """This rank's states from what ``gather_rng`` saved (or a single process's checkpoint)."""
    ranks = saved.get("ranks") if isinstance(saved, Mapping) else None
    if ranks is None:
        set_local_rng_state(saved)  # a single-process checkpoint
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
