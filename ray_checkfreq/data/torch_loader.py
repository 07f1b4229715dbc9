"""torch front end: a map-style Dataset through a DataLoader, its batch sampler driven by the core.

The DataLoader keeps its workers and prefetching; the batch sampler hands them this rank's
slices of the epoch order from the saved position on. Each sample travels to the worker
as (index, epoch) so the per-sample transform is seeded by (seed, epoch, index) whichever
worker runs it; workers are started per epoch, so nothing else can leak between runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ray_checkfreq.data.core import RankSlice, Sharding
from ray_checkfreq.data.iterator import ResumableIterator, wants_keys
from ray_checkfreq.data.order import FullOrder, Order, take_slices
from ray_checkfreq.data.seeds import sample_rng


@dataclass(frozen=True, kw_only=True)
class TorchLoaderOptions:
    num_workers: int = 2
    """DataLoader worker processes."""
    collate_fn: Callable[[list[Any]], Any] | None = None
    """Builds a batch from samples (None: torch's default)."""
    pin_memory: bool = False
    """Pinned host memory for the batches."""
    prefetch_factor: int | None = None
    """Batches loaded ahead per worker (None: torch's default)."""
    multiprocessing_context: str | None = None
    """How workers start (None: torch's default)."""
    timeout_s: float = 0.0
    """Seconds to wait for a worker's batch (0: no timeout)."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be >= 1, got {self.prefetch_factor}")
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {self.timeout_s}")


class _Seeded(Dataset):
    """Reads (index, epoch) keys; applies the transform with the sample's own generator."""

    def __init__(self, dataset: Dataset, seed: int, transform: Callable[..., Any] | None) -> None:
        self.dataset = dataset
        self.seed = seed
        self.transform = transform
        self.with_rng = transform is not None and wants_keys(transform)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, epoch = key
        sample = self.dataset[index]
        if self.transform is None:
            return sample
        if self.with_rng:
            return self.transform(sample, sample_rng(self.seed, epoch, index))
        return self.transform(sample)


class _Batches:
    """A batch sampler over precomputed slices; computes each batch's indices lazily."""

    def __init__(self, order: FullOrder, epoch: int, slices: Sequence[RankSlice]) -> None:
        self.order, self.epoch, self.slices = order, epoch, slices

    def __len__(self) -> int:
        return len(self.slices)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for indices in take_slices(self.order, self.slices):
            yield [(int(i), self.epoch) for i in indices]


class TorchIterator(ResumableIterator):
    """Resumable batches of a map-style torch ``Dataset`` (default collate)."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        sharding: Sharding,
        seed: int = 0,
        shuffle: bool = True,
        transform: Callable[..., Any] | None = None,
        options: TorchLoaderOptions | None = None,
    ) -> None:
        try:
            num_samples = len(dataset)  # type: ignore[arg-type]
        except TypeError as exc:
            raise TypeError(f"a map-style dataset with __len__ is required, got {type(dataset).__name__}") from exc
        super().__init__(num_samples=num_samples, sharding=sharding, seed=seed, shuffle=shuffle)
        self.dataset = _Seeded(dataset, seed, transform)
        self.options = options or TorchLoaderOptions()

    def _order(self, epoch: int) -> Order:
        return FullOrder(
            num_samples=self.num_samples, seed=self.seed, epoch=epoch, shuffle=self.shuffle, version=self.order_version
        )

    def _produce(self, order: Order, epoch: int, slices: Sequence[RankSlice]) -> Iterator[Any]:
        assert isinstance(order, FullOrder)
        opts = self.options
        extra: dict[str, Any] = {}
        if opts.num_workers > 0:
            extra["prefetch_factor"] = opts.prefetch_factor or 2
            extra["multiprocessing_context"] = opts.multiprocessing_context
        # A private generator: a DataLoader otherwise draws its base seed from the global
        # torch RNG whenever it starts, and a resume starts it at a different point than an
        # uninterrupted run, which would shift every later dropout mask.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        loader = DataLoader(
            self.dataset,
            batch_sampler=_Batches(order, epoch, slices),
            generator=generator,
            num_workers=opts.num_workers,
            collate_fn=opts.collate_fn,
            pin_memory=opts.pin_memory and torch.cuda.is_available(),
            timeout=opts.timeout_s,
            **extra,
        )
        yield from loader
