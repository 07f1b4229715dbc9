"""A checkpoint state from one rank to all: its layout as a small object, its bytes in one buffer."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ray_checkfreq.storage.arrays import leaf_bytes, leaf_from_buffer, leaf_spec
from ray_checkfreq.storage.tree import flatten_state, unflatten_state


def broadcast_state(state: Any, *, src: int, rank: int, world_size: int, group: Any) -> Any:
    """``state`` of rank ``src`` on every rank (the others pass None); tensors arrive as copies."""
    if world_size == 1:
        return state
    layout: list[Any] = [None]
    payload: torch.Tensor | None = None
    if rank == src:
        flat = flatten_state(state)
        specs = [leaf_spec(leaf) for leaf in flat.leaves]
        offsets, total = _offsets([spec.nbytes for spec in specs])
        payload = torch.empty(total, dtype=torch.uint8)
        target = payload.numpy()
        for leaf, spec, offset in zip(flat.leaves, specs, offsets):
            if spec.nbytes:
                target[offset:offset + spec.nbytes] = np.frombuffer(leaf_bytes(leaf), dtype=np.uint8)
        layout = [(flat.skeleton, specs, total)]
    dist.broadcast_object_list(layout, src=src, group=group)
    skeleton, specs, total = layout[0]
    if payload is None:
        payload = torch.empty(total, dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    buffer = payload.numpy()
    offsets, _ = _offsets([spec.nbytes for spec in specs])
    leaves = [leaf_from_buffer(spec, buffer, offset) for spec, offset in zip(specs, offsets)]
    return unflatten_state(skeleton, leaves)


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Each leaf 64-byte aligned, so every dtype's view of the buffer is aligned."""
    offsets, position = [], 0
    for size in sizes:
        offsets.append(position)
        position += (size + 63) // 64 * 64
    return offsets, position
