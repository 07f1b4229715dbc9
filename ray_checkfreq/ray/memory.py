"""Snapshots into the node agent's shared-memory slots, and persists the agent runs.

``SlotMemory`` is the engine's host memory: a snapshot's tensors are copied straight from
the model into views of the agent's slot file (one copy). Slots alternate (A/B), so the
newest COMPLETE slot stays intact while the next snapshot is written into the other.
``SlotPersister`` is the engine's persister: once the copies landed it seals the slot
(meta, checksum, COMPLETE last) and, on the rank that persists, asks the agent to commit
it; on a replica rank sealing is all there is to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from ray_checkfreq.engine.persist import PersistError, PersistResult, PersistWorker
from ray_checkfreq.engine.snapshot import Snapshot
from ray_checkfreq.ray import slots
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.tree import KeyPath

logger = logging.getLogger("ray_checkfreq.ray")


class SlotMemory:
    """The engine's ``HostMemory`` backed by an agent's slot files on this node."""

    def __init__(self, agent: Any, *, generation: Callable[[], int], owner: int | None = None,
                 world_size: int | None = None) -> None:
        self.agent = agent
        self._generation = generation
        self._owner = owner  # a sharded run's rank: slots of its own (None: the node's replica)
        self._world_size = world_size
        self._mapped: list[slots.MappedSlot] = []
        self._stale = False

    def prepare(self, step: int, layout: list[tuple[KeyPath, tuple[int, ...], torch.dtype]]
                ) -> tuple[Any, dict[KeyPath, torch.Tensor]]:
        plan = slots.slot_layout(layout)
        if self._stale or not self._mapped or not all(self._fits(slot, plan) for slot in self._mapped):
            self._remap(plan)
        slot = self._writable_slot()
        views = slot.begin_write(step=step, generation=self._generation(), layout=plan)
        return slot, views

    @staticmethod
    def _fits(slot: slots.MappedSlot, plan: slots.SlotLayout) -> bool:
        return slot.fits(plan) and slot.header().meta_capacity >= slots.meta_capacity_for(plan)

    def replace_agent(self, agent: Any) -> None:
        """A new agent for this node: its slots are mapped at the next snapshot."""
        self.agent = agent
        self._stale = True

    def _remap(self, plan: slots.SlotLayout) -> None:
        paths = ray.get(self.agent.allocate.remote(plan.data_bytes, slots.meta_capacity_for(plan), self._owner,
                                                   self._world_size))
        self.close()
        self._mapped = [slots.MappedSlot.open(path) for path in paths]
        self._stale = False
        for slot in self._mapped:
            slots.register_pinned(slot)  # page-locked for device-to-host copies; a no-op without CUDA

    def _writable_slot(self) -> slots.MappedSlot:
        """A slot that is not COMPLETE, else the one with the oldest snapshot: the newest
        complete snapshot (the one a restart may need) is never the one overwritten."""
        def age(slot: slots.MappedSlot) -> tuple[bool, int, int]:
            header = slot.header()
            return header.state == slots.SLOT_COMPLETE, header.step, header.seq

        return min(self._mapped, key=age)

    def close(self) -> None:
        for slot in self._mapped:
            slot.close()
        self._mapped = []


class SlotPersister(PersistWorker):
    """Seals each snapshot's slot, then (``persists=True``) has the agent commit it.

    The agent finishes a persist it started even if this process dies; ``restart_persist``
    hands it a slot restored after a restart that is newer than the newest commit.
    ``on_agent_report`` gets each persist as the agent measured it (its dict).
    """

    def __init__(self, store: CheckpointStore, on_done: Callable[[PersistResult], None] | None, *,
                 agent: Any, persists: bool, generation: Callable[[], int],
                 on_agent_lost: Callable[[], Any] | None = None, route: Callable[[], Any] | None = None,
                 replica_wait_s: float = 30.0, on_agent_report: Callable[[dict], None] | None = None) -> None:
        self.agent = agent
        self._on_agent_report = on_agent_report
        self._on_agent_lost = on_agent_lost
        self._route = route
        self._replica_wait_s = replica_wait_s
        self.persists = persists
        self._generation = generation
        super().__init__(store, on_done=on_done)

    def _persist_source(self, path: str, header: slots.SlotHeader) -> tuple[Any, str, int]:
        """Own agent and slot; while this node drains, another node's agent and its replica."""
        target = self._route() if self._route is not None else None
        if target is None:
            return self.agent, path, header.seq
        replica_path, seq = _replica_slot(target, header.step, self._replica_wait_s)
        logger.warning("persisting iteration %d from another node's replica (this node is draining)", header.step)
        return target, replica_path, seq

    def _persist(self, snapshot: Snapshot, options: dict) -> tuple[PersistResult | None, Any]:
        snapshot.copies.wait_complete()  # held open until the next iteration starts: not persist time
        start = time.perf_counter()
        try:
            snapshot.copies.wait()
            copied = time.perf_counter()
            slot: slots.MappedSlot = snapshot.memory
            header = slot.finish_write(snapshot.state)
            if not self.persists:
                return None, None
            agent, path, seq = self._persist_source(slot.path, header)
            done = ray.get(agent.persist.remote(
                path, seq, self.store, self._generation(),
                codec=options.get("codec"), epoch_boundary=snapshot.epoch_boundary))
        except ray.exceptions.RayActorError as err:
            if self._on_agent_lost is None:
                return None, _persist_error(snapshot.step, err)
            logger.warning("checkpoint of iteration %d not persisted: the node agent died (%s)", snapshot.step, err)
            self.agent = self._on_agent_lost()
            return None, None
        except BaseException as err:
            return None, _persist_error(snapshot.step, err)
        if self._on_agent_report is not None:
            self._on_agent_report(done)
        return PersistResult(step=snapshot.step, seconds=time.perf_counter() - start, copy_s=copied - start,
                             codec=str(done["codec"]), raw_bytes=snapshot.size_bytes,
                             stored_bytes=int(done["stored_bytes"]), uri=str(done["uri"])), None


def _replica_slot(agent: Any, step: int, timeout_s: float) -> tuple[str, int]:
    """(path, seq) of ``agent``'s COMPLETE slot of ``step``, once its rank has sealed it."""
    deadline = time.monotonic() + timeout_s
    while True:
        for header in ray.get(agent.slot_headers.remote(), timeout=timeout_s):
            if header["state"] == slots.SLOT_COMPLETE and header["step"] == step:
                return str(header["path"]), int(header["seq"])
        if time.monotonic() > deadline:
            raise slots.SlotError("<replica>", f"no complete replica of step {step} after {timeout_s:.0f} s")
        time.sleep(0.05)


def _persist_error(step: int, err: BaseException) -> PersistError:
    error = PersistError(step, f"{type(err).__name__}: {err}")
    error.__cause__ = err
    return error
