"""The plainest front end: batches of global sample indices (numpy int64 arrays).

Useful for a custom loader and for testing the core: what it yields is exactly
what every other front end reads. ``order_version=1`` starts a run on the old
permutation order (for comparisons); a restored state sets it anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ray_checkfreq.data.core import STATE_VERSION, RankSlice, Sharding
from ray_checkfreq.data.iterator import ResumableIterator
from ray_checkfreq.data.order import FullOrder, Order, take_slices


class IndexIterator(ResumableIterator):
    def __init__(
        self,
        num_samples: int,
        *,
        sharding: Sharding,
        seed: int = 0,
        shuffle: bool = True,
        order_version: int = STATE_VERSION,
    ) -> None:
        super().__init__(
            num_samples=num_samples, sharding=sharding, seed=seed, shuffle=shuffle, order_version=order_version
        )

    def _order(self, epoch: int) -> Order:
        return FullOrder(
            num_samples=self.num_samples, seed=self.seed, epoch=epoch, shuffle=self.shuffle, version=self.order_version
        )

    def _produce(self, order: Order, epoch: int, slices: Sequence[RankSlice]) -> Iterator[np.ndarray]:
        assert isinstance(order, FullOrder)
        yield from take_slices(order, slices)
