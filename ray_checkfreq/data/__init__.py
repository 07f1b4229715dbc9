"""Resumable, elastic data iterators (exact in-epoch resume, every sample once per epoch).

``resumable(source, batch_size=..., ...)`` returns an iterator with ``state_dict()`` /
``load_state_dict()``. Importing this package imports neither Ray nor DALI (nor torch):
the front ends import them when they are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_checkfreq.data.context import train_context
from ray_checkfreq.data.core import STATE_VERSION, DataState, DataStateError, RankSlice, Sharding, rank_slices
from ray_checkfreq.data.factory import resumable
from ray_checkfreq.data.guards import refuse_distributed_sampler
from ray_checkfreq.data.index import IndexIterator
from ray_checkfreq.data.iterator import ResumableIterator, StaleIteratorError
from ray_checkfreq.data.order import FullOrder, WindowedOrder, epoch_rng
from ray_checkfreq.data.quorum import QuorumShare, QuorumSteps
from ray_checkfreq.data.seeds import SampleKeys, sample_rng, sample_seeds

if TYPE_CHECKING:
    from ray_checkfreq.data.dali import DaliIterator, DaliSource
    from ray_checkfreq.data.ray_data import RayDataIterator, RayDataOptions
    from ray_checkfreq.data.torch_loader import TorchIterator, TorchLoaderOptions

_LAZY = {
    "DaliIterator": "ray_checkfreq.data.dali",
    "DaliSource": "ray_checkfreq.data.dali",
    "RayDataIterator": "ray_checkfreq.data.ray_data",
    "RayDataOptions": "ray_checkfreq.data.ray_data",
    "TorchIterator": "ray_checkfreq.data.torch_loader",
    "TorchLoaderOptions": "ray_checkfreq.data.torch_loader",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ray_checkfreq.data' has no attribute {name!r}")


__all__ = [
    "DaliIterator",
    "DaliSource",
    "RayDataIterator",
    "RayDataOptions",
    "TorchIterator",
    "TorchLoaderOptions",
    "STATE_VERSION",
    "DataState",
    "DataStateError",
    "FullOrder",
    "IndexIterator",
    "QuorumShare",
    "QuorumSteps",
    "RankSlice",
    "StaleIteratorError",
    "ResumableIterator",
    "SampleKeys",
    "Sharding",
    "WindowedOrder",
    "epoch_rng",
    "rank_slices",
    "refuse_distributed_sampler",
    "resumable",
    "sample_rng",
    "sample_seeds",
    "train_context",
]
