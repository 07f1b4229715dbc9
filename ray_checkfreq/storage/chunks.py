"""Chunk boxes of sharded tensors and the overlap planner (pure: numpy only, no I/O).

A sharded tensor is stored as chunks: each one a *box* of the global tensor, given by
per-dimension ``offsets`` and ``sizes`` (as DCP's ``ChunkStorageMetadata``; a ``Shard(1)``
piece is a box but not one byte range of the global tensor). A chunk's bytes are its box
in C order. Restoring at another world size or mesh copies, for every saved chunk that
overlaps a target box, the intersection into the target: ``plan_copies`` lists those copies
with the source sub-box relative to the saved chunk and the destination sub-box relative
to the target, so nothing outside either is ever addressed.

Copies run on byte views (``as_bytes``: shape ``sizes + (itemsize,)`` of uint8), so every
dtype (bfloat16, float8) is handled alike.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


class ChunkLayoutError(ValueError):
    """Boxes that do not fit their tensor, overlap, or leave part of it uncovered."""


@dataclass(frozen=True)
class Box:
    """A box of an n-d array: ``offsets[d] <= index[d] < offsets[d] + sizes[d]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ChunkLayoutError(f"box offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise ChunkLayoutError(f"box offsets {self.offsets} / sizes {self.sizes}: negative")

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    @functools.cached_property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def fits(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= d for e, d in zip(self.ends, shape))

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None when the two share no element."""
        lows = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        highs = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(lo >= hi for lo, hi in zip(lows, highs)):
            return None
        return Box(lows, tuple(hi - lo for lo, hi in zip(lows, highs)))

    def relative_to(self, origin: Box) -> Box:
        """This box in the coordinates of ``origin`` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, origin.offsets)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def whole(shape: Sequence[int]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


@dataclass(frozen=True)
class CopyStep:
    """Copy ``source_box`` of saved chunk ``source`` into ``target_box`` of the target."""

    source: int  # index into the saved chunks given to plan_copies
    source_box: Box  # relative to the saved chunk
    target_box: Box  # relative to the target box


def plan_copies(saved: Sequence[Box], target: Box) -> list[CopyStep]:
    """The copies that assemble ``target`` from the overlapping ``saved`` chunks."""
    steps = []
    for index, chunk in enumerate(saved):
        if chunk.ndim != target.ndim:
            raise ChunkLayoutError(f"saved chunk of rank {chunk.ndim} for a target box of rank {target.ndim}")
        common = chunk.intersect(target)
        if common is not None:
            steps.append(CopyStep(index, common.relative_to(chunk), common.relative_to(target)))
    return steps


def check_tiling(shape: Sequence[int], boxes: Sequence[Box]) -> None:
    """Raise ChunkLayoutError unless ``boxes`` cover ``shape`` exactly once.

    Every box inside the tensor, no two sharing an element, and their volumes adding up
    to the tensor's: then every element lies in exactly one box.
    """
    for box in boxes:
        if not box.fits(shape):
            raise ChunkLayoutError(f"chunk at {box.offsets} of sizes {box.sizes} lies outside shape {tuple(shape)}")
    nonempty = sorted((b for b in boxes if b.volume), key=lambda b: b.offsets)
    for i, box in enumerate(nonempty):
        # Sorted by first offset: only boxes starting before this one ends along dim 0 can meet it.
        for other in nonempty[i + 1:]:
            if box.ndim and other.offsets[0] >= box.ends[0]:
                break
            if box.intersect(other) is not None:
                raise ChunkLayoutError(f"chunks at {box.offsets} and {other.offsets} overlap")
    covered = sum(b.volume for b in nonempty)
    if covered != math.prod(shape):
        raise ChunkLayoutError(f"chunks cover {covered} of the {math.prod(shape)} elements of shape {tuple(shape)}")


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A uint8 view of a C-contiguous array, shaped ``array.shape + (itemsize,)``."""
    if not array.flags.c_contiguous:
        raise ValueError("expected a C-contiguous array")
    return array.reshape(-1).view(np.uint8).reshape(array.shape + (array.dtype.itemsize,))


def byte_span(sizes: Sequence[int], sub: Box, itemsize: int) -> tuple[int, int]:
    """[start, stop) in bytes of a C-order chunk of ``sizes`` spanning box ``sub`` of it.

    From the sub-box's first element to its last: exactly the sub-box when it differs
    from the chunk in the leading dimension only.
    """
    if not sub.fits(sizes):
        raise ChunkLayoutError(f"box at {sub.offsets} of sizes {sub.sizes} lies outside a chunk of {tuple(sizes)}")
    if sub.volume == 0:
        return 0, 0
    strides = _element_strides(sizes)
    first = sum(o * s for o, s in zip(sub.offsets, strides))
    last = sum((e - 1) * s for e, s in zip(sub.ends, strides))
    return first * itemsize, (last + 1) * itemsize


def span_view(span: np.ndarray, sizes: Sequence[int], sub: Box, itemsize: int) -> np.ndarray:
    """Sub-box ``sub`` of a chunk of ``sizes``, from the bytes ``byte_span`` gave (a view).

    ``span`` is a uint8 array starting at the span's first byte; the result has shape
    ``sub.sizes + (itemsize,)``.
    """
    start, stop = byte_span(sizes, sub, itemsize)
    if span.ndim != 1 or span.dtype != np.uint8 or span.size < stop - start:
        raise ValueError(f"span of {span.size} bytes for a sub-box needing {stop - start}")
    strides = tuple(s * itemsize for s in _element_strides(sizes)) + (1,)
    if sub.volume == 0:
        return np.zeros(sub.sizes + (itemsize,), np.uint8)
    return np.lib.stride_tricks.as_strided(span, shape=sub.sizes + (itemsize,), strides=strides, writeable=False)


def _element_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def fill(target: np.ndarray, steps: Sequence[CopyStep], read: Callable[[CopyStep], np.ndarray]) -> int:
    """Copy each step's source into ``target`` (a byte view, see ``as_bytes``).

    ``read(step)`` returns the step's source sub-box as bytes (``sizes + (itemsize,)``).
    Returns the number of elements copied.
    """
    copied = 0
    for step in steps:
        source = read(step)
        destination = target[step.target_box.slices()]
        if source.shape != destination.shape:
            raise ChunkLayoutError(f"source of shape {source.shape} for a destination of shape {destination.shape}")
        destination[...] = source
        copied += step.target_box.volume
    return copied


def assemble(target_box: Box, saved: Sequence[Box], chunk_bytes: Callable[[int], Any], itemsize: int) -> np.ndarray:
    """``target_box`` as bytes, from whole saved chunks (``chunk_bytes(i)``: chunk i's C-order bytes)."""
    out = np.empty(target_box.sizes + (itemsize,), np.uint8)
    steps = plan_copies(saved, target_box)

    def read(step: CopyStep) -> np.ndarray:
        data = np.frombuffer(chunk_bytes(step.source), np.uint8)
        chunk = data.reshape(saved[step.source].sizes + (itemsize,))
        return chunk[step.source_box.slices()]

    copied = fill(out, steps, read)
    if copied != target_box.volume:
        raise ChunkLayoutError(f"saved chunks cover {copied} of the {target_box.volume} elements of the box")
    return out
