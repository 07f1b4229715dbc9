"""Every rank's RNG states in a checkpoint: gathered at each checkpoint, each rank's own on
restore (``set_own_rng`` and ``seed_new_rank`` live in the engine, engine/rng.py)."""

from __future__ import annotations

from typing import Any

from ray_checkfreq.engine.rng import seed_new_rank, set_own_rng
from ray_checkfreq.engine.seams import local_rng_state
from ray_checkfreq.ray.transfer import all_gather_state

__all__ = ["gather_rng", "seed_new_rank", "set_own_rng"]


def gather_rng(*, world_size: int, group: Any) -> dict:
    """Every rank's RNG states (a collective: every rank calls it at each checkpoint)."""
    ranks = all_gather_state({"rng": local_rng_state()}, world_size=world_size, group=group)
    return {"world_size": world_size, "ranks": [entry["rng"] for entry in ranks]}
