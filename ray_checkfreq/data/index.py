"""The plainest front end: batches of global sample indices (numpy int64 arrays).

Useful for a custom loader and for testing the core: what it yields is exactly
what every other front end reads.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ray_checkfreq.data.core import RankSlice, Sharding
from ray_checkfreq.data.iterator import ResumableIterator
from ray_checkfreq.data.order import FullOrder, Order


class IndexIterator(ResumableIterator):
    def __init__(
        self, num_samples: int, *, sharding: Sharding, seed: int = 0, shuffle: bool = True
    ) -> None:
        super().__init__(num_samples=num_samples, sharding=sharding, seed=seed, shuffle=shuffle)

    def _order(self, epoch: int) -> Order:
        return FullOrder(num_samples=self.num_samples, seed=self.seed, epoch=epoch, shuffle=self.shuffle)

    def _produce(self, order: Order, epoch: int, slices: list[RankSlice]) -> Iterator[np.ndarray]:
        for piece in slices:
            yield order.take(piece.lo, piece.hi).copy()
