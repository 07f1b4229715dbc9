"""Moving states and small values between ranks without pickle.

A state travels as its JSON skeleton and leaf specs (the store's own flat form) plus its
bytes in one uint8 tensor; small values travel as JSON. No rank ever unpickles what
another sent, as no checkpoint load ever unpickles.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ray_checkfreq.storage.arrays import LeafSpec, leaf_bytes, leaf_from_buffer, leaf_spec
from ray_checkfreq.storage.tree import flatten_state, unflatten_state

_ALIGN = 64  # every leaf starts 64-byte aligned, so any dtype's view of the buffer is aligned


def broadcast_state(state: Any, *, src: int, rank: int, world_size: int, group: Any) -> Any:
    """``state`` of rank ``src`` on every rank (the others pass None); tensors arrive as copies."""
    if world_size == 1:
        return state
    packed = pack_state(state) if rank == src else None
    return unpack_state(broadcast_bytes(packed, src=src, rank=rank, group=group))


def all_gather_state(state: Any, *, world_size: int, group: Any) -> list[Any]:
    """Every rank's ``state``, in rank order."""
    if world_size == 1:
        return [state]
    return [unpack_state(data) for data in all_gather_bytes(pack_state(state), world_size=world_size, group=group)]


def broadcast_json(value: Any, *, src: int, rank: int, group: Any) -> Any:
    encoded = json.dumps(value).encode() if rank == src else None
    return json.loads(broadcast_bytes(encoded, src=src, rank=rank, group=group).tobytes())


def all_gather_json(value: Any, *, world_size: int, group: Any) -> list[Any]:
    gathered = all_gather_bytes(json.dumps(value).encode(), world_size=world_size, group=group)
    return [json.loads(data.tobytes()) for data in gathered]


# ------------------------------------------------------------------ bytes
def broadcast_bytes(data: bytes | np.ndarray | None, *, src: int, rank: int, group: Any) -> np.ndarray:
    size = torch.tensor([len(data) if rank == src and data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if rank == src:
        assert data is not None
        buffer = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return buffer.numpy()


def all_gather_bytes(data: bytes | np.ndarray, *, world_size: int, group: Any) -> list[np.ndarray]:
    mine = np.frombuffer(data, dtype=np.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([mine.size], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:mine.size] = torch.from_numpy(mine.copy())
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)
    return [g.numpy()[:int(s.item())] for g, s in zip(gathered, sizes)]


# ------------------------------------------------------------- state packing
def pack_state(state: Any) -> np.ndarray:
    """[8-byte header length][JSON: skeleton, leaf specs, offsets][aligned leaf bytes]."""
    flat = flatten_state(state)
    specs = [leaf_spec(leaf) for leaf in flat.leaves]
    offsets, total = _offsets([spec.nbytes for spec in specs])
    header = json.dumps({"skeleton": flat.skeleton, "offsets": offsets,
                         "specs": [[s.kind, s.dtype, list(s.shape)] for s in specs]}).encode()
    start = _aligned(8 + len(header))
    packed = np.zeros(start + total, dtype=np.uint8)
    packed[:8] = np.frombuffer(len(header).to_bytes(8, "little"), dtype=np.uint8)
    packed[8:8 + len(header)] = np.frombuffer(header, dtype=np.uint8)
    for leaf, spec, offset in zip(flat.leaves, specs, offsets):
        if spec.nbytes:
            packed[start + offset:start + offset + spec.nbytes] = np.frombuffer(leaf_bytes(leaf), dtype=np.uint8)
    return packed


def unpack_state(packed: np.ndarray) -> Any:
    length = int.from_bytes(packed[:8].tobytes(), "little")
    header = json.loads(packed[8:8 + length].tobytes())
    start = _aligned(8 + length)
    data = packed[start:]
    leaves = [leaf_from_buffer(LeafSpec(kind, dtype, tuple(shape)), data, offset)
              for (kind, dtype, shape), offset in zip(header["specs"], header["offsets"])]
    return unflatten_state(header["skeleton"], leaves)


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    offsets, position = [], 0
    for size in sizes:
        offsets.append(position)
        position += _aligned(size)
    return offsets, position


def _aligned(value: int) -> int:
    return (value + _ALIGN - 1) // _ALIGN * _ALIGN
