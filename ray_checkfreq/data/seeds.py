"""Per-sample random streams: a pure function of (seed, epoch, global sample index).

A sample's augmentation must not depend on which rank, worker or run produced it, so
its randomness is keyed by the sample, never by a process-wide generator. The key is
hashed with splitmix64 (vectorised in numpy, so a whole batch is keyed at once) into a
64-bit seed; ``sample_rng`` seeds numpy's PCG64 with it. Both are stable across runs,
processes and machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SAMPLE_DOMAIN = 0x5A3D_1E57


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def _u64(value: int) -> np.uint64:
    if value < 0:
        raise ValueError(f"seeds and indices must be >= 0, got {value}")
    return np.uint64(value & 0xFFFF_FFFF_FFFF_FFFF)


def sample_seeds(seed: int, epoch: int, indices: np.ndarray | list[int]) -> np.ndarray:
    """64-bit seeds (uint64 array) for the given global sample indices."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and idx.min() < 0:
        raise ValueError(f"sample indices must be >= 0, got {int(idx.min())}")
    key = mix64(np.asarray([_u64(seed) ^ np.uint64(_SAMPLE_DOMAIN)], dtype=np.uint64))
    key = mix64(key ^ _u64(epoch))
    return mix64(key ^ idx.astype(np.uint64))


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator for one sample's augmentation in one epoch."""
    return np.random.Generator(np.random.PCG64(int(sample_seeds(seed, epoch, [index])[0])))


@dataclass(frozen=True)
class SampleKeys:
    """What a batch transform needs to draw per-sample randomness reproducibly."""

    seed: int
    epoch: int
    indices: np.ndarray

    @property
    def seeds(self) -> np.ndarray:
        return sample_seeds(self.seed, self.epoch, self.indices)

    def rng(self, position: int) -> np.random.Generator:
        """Generator of the sample at ``position`` in the batch."""
        return sample_rng(self.seed, self.epoch, int(self.indices[position]))

    def __len__(self) -> int:
        return len(self.indices)
