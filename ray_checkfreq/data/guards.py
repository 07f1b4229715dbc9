"""Refusals of torch loaders whose sharding would fight ours.

Our lockstep sharding replaces ``DistributedSampler``: a loader that shards again on top
(``ray.train.torch.prepare_data_loader`` adds one) would give each rank 1/W of its 1/W.
torch is not imported here: an object can only be a DataLoader once torch is loaded.
"""

from __future__ import annotations

import sys
from typing import Any


def is_data_loader(obj: Any) -> bool:
    if "torch" not in sys.modules:
        return False
    from torch.utils.data import DataLoader

    return isinstance(obj, DataLoader)


def refuse_distributed_sampler(obj: Any, what: str) -> None:
    """Raise TypeError when ``obj`` is a DataLoader sharded by a ``DistributedSampler``."""
    if not is_data_loader(obj):
        return
    from torch.utils.data.distributed import DistributedSampler

    samplers = (getattr(obj, "sampler", None), getattr(getattr(obj, "batch_sampler", None), "sampler", None))
    if any(isinstance(s, DistributedSampler) for s in samplers):
        raise TypeError(
            f"{what} is a DataLoader sharded by a DistributedSampler (ray.train.torch.prepare_data_loader "
            "adds one): ray_checkfreq shards the data itself, so do not call prepare_data_loader; "
            "pass ray_checkfreq.data.resumable(loader.dataset, ...) instead"
        )


def refuse_data_loader(obj: Any, what: str) -> None:
    """Raise TypeError when ``obj`` is any DataLoader: the Dataset is what we need."""
    refuse_distributed_sampler(obj, what)
    if is_data_loader(obj):
        raise TypeError(
            f"{what} is a DataLoader ({type(obj).__name__}): pass its Dataset instead "
            "(resumable(loader.dataset, ...)); ray_checkfreq builds the loader and shards the data "
            "itself, replacing DistributedSampler"
        )
