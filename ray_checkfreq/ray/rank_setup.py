"""Set-up of one Ray Train rank: its context, store, process groups, node agent, metrics
and registrar, each built from what it needs (``session.py`` puts them together)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import ray
import torch
import torch.distributed as dist

from ray_checkfreq.engine import CheckFreqConfig
from ray_checkfreq.ray import agent as agents
from ray_checkfreq.ray import slots
from ray_checkfreq.ray.metrics import CheckFreqMetrics
from ray_checkfreq.ray.registration import PointedSteps, Registrar, RegistrationConfig
from ray_checkfreq.ray.transfer import all_gather_json
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.store import as_store

logger = logging.getLogger("ray_checkfreq.ray")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where this rank runs: ``nodes[r]`` is rank r's node; the first rank on each node
    ``snapshots`` (only rank 0's node's without replicas)."""

    rank: int
    world_size: int
    node_id: str
    nodes: list[str]
    snapshots: bool


def place_rank(*, rank: int, world_size: int, group: Any, replicas: bool) -> Placement:
    """Every rank's node id (a collective: an all-gather on ``group``)."""
    node_id = ray.get_runtime_context().get_node_id()
    nodes = all_gather_json(node_id, world_size=world_size, group=group)
    first_on_node = nodes.index(node_id) == rank
    return Placement(rank=rank, world_size=world_size, node_id=node_id, nodes=nodes,
                     snapshots=first_on_node and (replicas or rank == 0))


def train_context() -> Any:
    import ray.train

    try:
        return ray.train.get_context()
    except Exception as err:
        raise RuntimeError("ray_checkfreq.ray.CheckFreq runs inside a Ray Train training function; "
                           "use ray_checkfreq.CheckFreq elsewhere") from err


def store_for(storage: str | CheckpointStore | None, context: Any) -> CheckpointStore:
    if storage is None:
        run_storage = context.get_storage()
        path = os.path.join(run_storage.experiment_fs_path, "checkfreq")
        return CheckpointStore(path, filesystem=run_storage.storage_filesystem)
    if isinstance(storage, str) and not urlparse(storage).scheme and not os.path.isabs(storage):
        raise ValueError(f"storage={storage!r} is relative: each worker would resolve it in its own working "
                         "directory; give an absolute path or a URI")
    return as_store(storage)


def new_gloo_group(world_size: int) -> Any:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: use ray_checkfreq.ray.CheckFreq inside a "
                           "TorchTrainer training function")
    return dist.new_group(ranks=list(range(world_size)), backend="gloo")


def start_agent(*, run: str, node_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                shm_dir: str, slot_count: int, lease_s: float) -> Any:
    """This node's agent for ``run`` (renewed), or None when ``shm_dir`` has no room for its slots."""
    free = slots.shm_free_bytes(shm_dir)
    needed = slot_count * state_bytes_guess(model, optimizer)
    if free < needed:
        logger.warning("%s has %d MiB free, the snapshot slots need about %d MiB: persisting in the training "
                       "process instead (raise the shared-memory size, e.g. docker --shm-size)",
                       shm_dir, free >> 20, needed >> 20)
        return None
    handle = agents.get_or_create_agent(run, node_id, lease_s=lease_s, slot_count=slot_count)
    # Not awaited: a new node's agent starts (a process, its imports) while this rank sets up
    # and restores; the first snapshot's slot allocation waits for it if it must.
    handle.renew.remote()
    return handle


def new_metrics(*, run: str, rank: int, node_id: str, every_s: float | None) -> CheckFreqMetrics | None:
    """Rank 0's Ray metrics (None elsewhere, or when ``every_s`` is None)."""
    if rank != 0 or every_s is None:
        return None
    return CheckFreqMetrics(run=run, rank=rank, node_id=node_id, every_s=every_s)


def new_registrar(*, config: RegistrationConfig | None, rank: int, group: Any,
                  store: CheckpointStore,
                  context: Any, run_filesystem: bool, overhead: float, stats: Callable[[], Mapping[str, Any]],
                  metrics: CheckFreqMetrics | None) -> Registrar | None:
    """Pointer checkpoints for Ray Train (None: never); protects the pointed steps from retention."""
    if config is None:
        return None
    run_storage = context.get_storage()
    if store.protected_steps is None:
        store.protected_steps = PointedSteps(run_storage.storage_filesystem, run_storage.experiment_fs_path,
                                             store.uri)
    return Registrar(rank=rank, group=group, store=store, storage=run_storage, run_filesystem=run_filesystem,
                     overhead=overhead, config=config, metrics=lambda: report_metrics(stats()),
                     on_registered=metrics.record_registration if metrics is not None else None)


def overhead_of(engine_options: Mapping[str, Any]) -> float:
    """The overhead budget p the engine will use (``config=`` or the ``overhead`` keyword)."""
    config = engine_options.get("config")
    if config is not None:
        return float(config.overhead)
    return float(engine_options.get("overhead", CheckFreqConfig().overhead))


def adapts(engine_options: Mapping[str, Any]) -> bool:
    """Whether the engine would pick and adapt k itself (no fixed ``every``)."""
    config = engine_options.get("config")
    if config is not None:
        return config.every is None and config.adaptive
    return engine_options.get("every") is None and engine_options.get("adaptive") is not False


def report_metrics(stats: Mapping[str, Any]) -> dict:
    """The engine's figures that go into a Ray Train report (plain numbers)."""
    keys = ("k", "checkpoints_committed", "stall_s_total", "overhead_estimate", "bytes_written", "last_persist_s")
    return {f"checkfreq_{key}": stats[key] for key in keys if isinstance(stats.get(key), (int, float))}


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP (``module.``) and ``torch.compile`` (``_orig_mod.``) wrappers,
    so a checkpoint loads at any world size and into a plain model."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def state_bytes_guess(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The state's size before it exists: parameters, and per parameter as many tensors again
    as the optimizer's defaults suggest (Adam: two moments)."""
    # A sharded parameter's own piece (to_local()): what this rank's slots hold.
    params = sum(p.numel() * p.element_size() for p in map(_local_piece, model.parameters()))
    moments = 2 if any(key in optimizer.defaults for key in ("betas", "beta1")) else 1
    return params * (1 + moments) + (1 << 20)


def _local_piece(parameter: torch.Tensor) -> torch.Tensor:
    to_local = getattr(parameter, "to_local", None)
    return to_local() if callable(to_local) else parameter
