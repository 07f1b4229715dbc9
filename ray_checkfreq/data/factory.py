"""``resumable(source, ...)``: picks the front end from the type of the source."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ray_checkfreq.data.context import train_context
from ray_checkfreq.data.core import Sharding
from ray_checkfreq.data.guards import refuse_data_loader
from ray_checkfreq.data.iterator import ResumableIterator


def _is_ray_dataset(source: Any) -> bool:
    if not type(source).__module__.startswith("ray.data"):
        return False
    from ray.data import Dataset

    return isinstance(source, Dataset)


def _is_torch_dataset(source: Any) -> bool:
    if "torch" not in sys.modules:
        return False
    from torch.utils.data import Dataset, IterableDataset

    if isinstance(source, IterableDataset):
        raise TypeError(
            f"an IterableDataset ({type(source).__name__}) has no random access; "
            "pass a map-style Dataset"
        )
    return isinstance(source, Dataset)


def resumable(
    source: Any,
    *,
    batch_size: int | None = None,
    global_batch_size: int | None = None,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
    transform: Callable[..., Any] | None = None,
    options: Any = None,
) -> ResumableIterator:
    """A resumable, elastic, per-rank iterator over ``source``.

    ``source``: a ``ray.data.Dataset`` (RayDataIterator), a ``DaliSource`` (DaliIterator),
    a map-style ``torch.utils.data.Dataset`` (TorchIterator) or an ``int`` sample count
    (IndexIterator, batches of global indices); never a DataLoader (pass its Dataset).
    Give exactly one of ``batch_size`` (per rank; the global batch is batch_size * W) and
    ``global_batch_size`` (G, fixed; each of W ranks takes G // W, W must divide G).
    ``rank``/``world_size`` default to the Ray Train context, else 0 and 1. ``options`` is
    the front end's options dataclass.
    """
    refuse_data_loader(source, "the source of resumable()")
    if (rank is None) != (world_size is None):
        raise ValueError(f"give both rank and world_size or neither, got rank={rank}, world_size={world_size}")
    if rank is None or world_size is None:
        rank, world_size = train_context() or (0, 1)
    sharding = _sharding(batch_size, global_batch_size, world_size=world_size, rank=rank, drop_last=drop_last)
    common: dict[str, Any] = dict(sharding=sharding, seed=seed, shuffle=shuffle)
    if isinstance(source, bool) or not _known(source):
        raise TypeError(
            f"cannot iterate a {type(source).__name__}: expected a ray.data.Dataset, a DaliSource, "
            "a map-style torch Dataset or an int sample count"
        )
    if isinstance(source, int):
        from ray_checkfreq.data.index import IndexIterator

        _no_options("an int source", transform=transform, options=options)
        return IndexIterator(source, **common)
    if _is_ray_dataset(source):
        from ray_checkfreq.data.ray_data import RayDataIterator, RayDataOptions

        return RayDataIterator(source, transform=transform, options=_checked(options, RayDataOptions), **common)
    if type(source).__name__ == "DaliSource":
        from ray_checkfreq.data.dali import DaliIterator

        _no_options("a DaliSource (configure the source itself)", options=options)
        return DaliIterator(source, transform=transform, **common)
    from ray_checkfreq.data.torch_loader import TorchIterator, TorchLoaderOptions

    return TorchIterator(source, transform=transform, options=_checked(options, TorchLoaderOptions), **common)


def _sharding(
    batch_size: int | None, global_batch_size: int | None, *, world_size: int, rank: int, drop_last: bool
) -> Sharding:
    if (batch_size is None) == (global_batch_size is None):
        raise ValueError(
            "give exactly one of batch_size (per rank) and global_batch_size (all ranks), "
            f"got batch_size={batch_size}, global_batch_size={global_batch_size}"
        )
    if global_batch_size is not None:
        return Sharding.for_global_batch(global_batch_size, world_size=world_size, rank=rank, drop_last=drop_last)
    assert batch_size is not None
    return Sharding(batch_size=batch_size, world_size=world_size, rank=rank, drop_last=drop_last)


def _checked(options: Any, kind: type) -> Any:
    if options is not None and not isinstance(options, kind):
        raise TypeError(f"options for this source must be a {kind.__name__}, got {type(options).__name__}")
    return options


def _no_options(what: str, **given: Any) -> None:
    bad = [name for name, value in given.items() if value is not None]
    if bad:
        raise ValueError(f"{what} takes no {bad[0]}, got {given[bad[0]]!r}")


def _known(source: Any) -> bool:
    if isinstance(source, int):
        return True
    if type(source).__name__ == "DaliSource" and type(source).__module__ == "ray_checkfreq.data.dali":
        return True
    return _is_ray_dataset(source) or _is_torch_dataset(source)
