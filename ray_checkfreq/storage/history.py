"""Near-lossless history: retained epoch-boundary checkpoints kept trimmed (the transforms;
``retention.py`` plans which checkpoints, ``CheckpointStore`` rewrites them).

A store with ``history_trim=HistoryTrim(...)`` rewrites a checkpoint once it becomes
*history*: an intact epoch-boundary checkpoint that retention keeps only because it is an
epoch boundary (older than the newest ``keep_last``). The copy holds the same state with
every floating tensor rounded (:func:`ray_checkfreq.codec.trim`), stored as XOR deltas
against the newest full trimmed copy where one is usable (a full copy every
``full_every``). Invariants:

1. Never touched: the newest ``keep_last`` checkpoints, the one just saved, the newest this
   store verified, protected steps, a newer writer's checkpoints, and any checkpoint an
   exact one still uses as its delta base (it is rewritten once nothing needs it).
2. The copy is committed (its manifest says ``history_trim`` and names its source)
   before the source is deleted; a crash in between leaves both, and the next retention
   deletes the source whose copy is committed. So the step is never lost.
3. ``latest()`` and ``load()`` without a step never return a trimmed copy: a resume reads
   exact state only. ``load(step)`` / ``load(ref)`` return it when asked for.
4. A failure here (a corrupt source, storage errors) is logged and leaves the source as
   it is: the save that triggered retention has committed already.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_checkfreq import codec
from ray_checkfreq.storage.arrays import leaf_bytes
from ray_checkfreq.storage.tree import flatten_state, unflatten_state


@dataclass(frozen=True, kw_only=True)
class HistoryTrim:
    """How history checkpoints are kept: one of ``precision_factor`` (B, a power of two:
    values of a tensor within [-1, 1] rounded to multiples of 1/B, error <= 1/(2B)) or
    ``precision_bits`` (mantissa bits kept, relative error <= 2^-bits); see
    :mod:`ray_checkfreq.codec.nearlossless`. ``full_every``: a full trimmed copy, then up
    to ``full_every - 1`` copies stored as XOR deltas against it (1: no deltas)."""

    precision_factor: int | float | None = None
    """B, a power of two: values of a tensor within [-1, 1] rounded to multiples of 1/B (error <= 1/(2B)); exactly
    one of this and ``precision_bits``."""
    precision_bits: int | None = None
    """Mantissa bits kept (relative error <= 2^-bits)."""
    full_every: int = 4
    """A full trimmed copy, then up to ``full_every - 1`` copies stored as XOR deltas against it (1: no deltas)."""

    def __post_init__(self) -> None:
        if (self.precision_factor is None) == (self.precision_bits is None):
            raise ValueError(f"HistoryTrim(precision_factor={self.precision_factor!r}, precision_bits="
                             f"{self.precision_bits!r}): give exactly one of the two")
        try:
            codec.trim(torch.zeros(1), precision_factor=self.precision_factor,
                       precision_bits=self.precision_bits)
        except codec.CodecError as err:
            raise ValueError(f"HistoryTrim: {err}") from None
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"HistoryTrim(full_every={self.full_every!r}): must be an int >= 1")

    def describe(self, source: str) -> dict:
        """What a trimmed copy's manifest records (``Manifest.history_trim``)."""
        if self.precision_factor is not None:
            return {"source": source, "precision_factor": int(self.precision_factor)}
        return {"source": source, "precision_bits": self.precision_bits}

    def trim_leaf(self, leaf: Any) -> Any:
        return trim_leaf(leaf, precision_factor=self.precision_factor, precision_bits=self.precision_bits)


def trim_leaf(leaf: Any, *, precision_factor: int | float | None = None,
              precision_bits: int | None = None) -> Any:
    """``leaf`` rounded if it is floating and the codec rounds its dtype, else as it is."""
    floating = leaf.is_floating_point() or leaf.is_complex() if isinstance(leaf, torch.Tensor) else (
        isinstance(leaf, np.ndarray) and leaf.dtype.kind in "fc")
    if not floating:
        return leaf
    try:
        return codec.trim(leaf, precision_factor=precision_factor, precision_bits=precision_bits)
    except codec.CodecError:  # a dtype without rounding support (float8 with a factor, say)
        return leaf


def trim_state(state: Mapping[str, Any], *, precision_factor: int | float | None = None,
               precision_bits: int | None = None) -> tuple[dict, int]:
    """(a copy of ``state`` with its floating tensors trimmed, how many of them changed)."""
    codec.trim(torch.zeros(1), precision_factor=precision_factor, precision_bits=precision_bits)  # validates
    flat = flatten_state(state)
    leaves = [trim_leaf(leaf, precision_factor=precision_factor, precision_bits=precision_bits)
              for leaf in flat.leaves]
    changed = sum(new is not old and leaf_bytes(new) != leaf_bytes(old) for new, old in zip(leaves, flat.leaves))
    return unflatten_state(flat.skeleton, leaves), changed
