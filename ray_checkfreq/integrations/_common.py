"""What the framework callbacks share: which CheckFreq to build, and the optimizer under a wrapper."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ray_checkfreq.data.context import train_context

# The attributes under which frameworks keep the optimizer they wrap: accelerate's
# AcceleratedOptimizer (``optimizer``), Lightning's LightningOptimizer (``_optimizer``).
_WRAPPED_OPTIMIZER = ("optimizer", "_optimizer")


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under a framework's wrappers.

    A wrapper may subclass ``torch.optim.Optimizer`` without its hooks (accelerate's does),
    so a wrapper is recognised by the optimizer it holds, not by its type.
    """
    found = optimizer
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = next((getattr(found, name) for name in _WRAPPED_OPTIMIZER
                      if isinstance(getattr(found, name, None), torch.optim.Optimizer)), None)
        if inner is None:
            break
        found = inner
    if not isinstance(found, torch.optim.Optimizer) or not hasattr(found, "_optimizer_step_pre_hooks"):
        raise TypeError(f"{type(optimizer).__name__}: not a torch.optim.Optimizer, nor a wrapper of one")
    return found


def in_ray_train() -> bool:
    """True inside a Ray Train worker."""
    return train_context() is not None


def announce(line: str, logger: logging.Logger) -> None:
    """One visible line in a plain process (a script shows no INFO logs); the log under Ray
    Train, whose restart already says where each rank restored from."""
    if in_ray_train():
        logger.info(line)
    else:
        print(line, flush=True)


def open_checkfreq(*, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Any,
                   extra_state: Mapping[str, Any], storage: Any, options: Mapping[str, Any]) -> Any:
    """``ray_checkfreq.ray.CheckFreq`` in a Ray Train worker (storage defaults to the run's),
    else the engine's ``CheckFreq`` (``storage`` required)."""
    if in_ray_train():
        from ray_checkfreq.ray.session import CheckFreq as RayCheckFreq

        return RayCheckFreq(model=model, optimizer=optimizer, data=data, extra_state=extra_state,
                            storage=storage, **options)
    if storage is None:
        raise ValueError("storage=None outside Ray Train: give the callback storage= (a path or s3:// URL) "
                         "where the checkpoints go")
    from ray_checkfreq.engine import CheckFreq

    return CheckFreq(model=model, optimizer=optimizer, data=data, extra_state=extra_state, storage=storage,
                     **options)
