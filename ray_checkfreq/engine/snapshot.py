"""Phase 1 of a checkpoint: an in-memory snapshot taken off the critical path.

Invariant: parameters and optimizer state change only inside ``optimizer.step()``. Their
copies therefore run asynchronously (a side stream on each device that holds them, or a
host thread for host memory) while the next forward/backward runs, and the fence before
the next ``optimizer.step()`` makes every such device wait for them. Everything else
(module buffers such as BatchNorm statistics, which forward passes update, scheduler,
data iterator and RNG states) is copied when the snapshot starts, ahead of any later
work. A snapshot is therefore never a mix of two iterations. The host thread runs below
training's CPU priority (engine/threads.py): on cores that training keeps busy it takes
what training leaves, and the fence holds the next update until it has finished.

A snapshot may be held open (``CopyHandle.hold``) until the next iteration starts, for
``Snapshotter.refresh`` to copy the parts that user code may change between ``cf.step()``
and then (RNG, scheduler, optimizer hyper-parameters) over the ones taken at the step;
``CopyHandle.wait`` waits for its release, so the persist phase reads the final state.

A GPU-mode snapshot lives in spare device memory; the persist phase (``CopyHandle.wait``)
moves it to the host once per leaf, on the devices' copy streams, into pinned buffers
that are reused from one snapshot to the next, and the encoder reads those. Buffers are
keyed by each leaf's tuple key path, so two leaves never share one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ray_checkfreq.engine.devices import CudaOps, DeviceOps
from ray_checkfreq.engine.threads import BACKGROUND_NICE, lower_thread_priority
from ray_checkfreq.storage.tree import ContainerRebuilder, KeyPath, leaves_of, walk_state

Layout = list[tuple[KeyPath, tuple[int, ...], torch.dtype]]


class HostMemory(Protocol):
    """Host memory a snapshot's tensors are copied into (say, a node agent's shared slot)."""

    def prepare(self, step: int, layout: Layout) -> tuple[Any, dict[KeyPath, torch.Tensor]]:
        """Called as each snapshot starts with every tensor leaf (path, shape, dtype), in walk
        order. Returns a token (``Snapshot.memory``) and a host view per path, which the
        snapshot uses as its host buffer for that path."""
        ...

CopyPairs = list[tuple[torch.Tensor, torch.Tensor]]


class CopyHandle:
    """Completion of one snapshot's copies."""

    def __init__(self, ops: DeviceOps | None = None) -> None:
        self._ops = ops
        self._host_done = threading.Event()
        self._device_events: dict[Any, Any] = {}
        self._to_host: Callable[[], None] | None = None
        self._to_host_lock = threading.Lock()
        self._complete = threading.Event()
        self._complete.set()
        self.error: BaseException | None = None

    @classmethod
    def finished(cls) -> CopyHandle:
        """The handle of a snapshot whose bytes are already in host memory (nothing to copy)."""
        handle = cls()
        handle._host_done.set()
        return handle

    def hold(self) -> None:
        """The snapshot is not final yet: ``wait`` blocks until ``release``."""
        self._complete.clear()

    def release(self) -> None:
        self._complete.set()

    def wait_complete(self) -> None:
        """Block until the snapshot is final (released; at once when never held)."""
        self._complete.wait()

    @property
    def devices(self) -> list[Any]:
        """The devices whose copies the fence orders."""
        return list(self._device_events)

    def fence(self) -> None:
        """Called before the next weight update: after it, the update may overwrite sources."""
        for device, event in self._device_events.items():
            assert self._ops is not None
            self._ops.fence(device, event)  # device-side, no host wait
        self._host_done.wait()

    def wait(self) -> None:
        """Block until the snapshot is final and its bytes are in host buffers (for the persist phase)."""
        self._complete.wait()
        self._host_done.wait()
        for event in self._device_events.values():
            assert self._ops is not None
            self._ops.synchronize(event)
        if self.error is not None:
            raise self.error
        with self._to_host_lock:  # once, however many persists read this snapshot
            to_host, self._to_host = self._to_host, None
            if to_host is not None:
                to_host()


class HostCopier:
    """One long-lived thread that runs host-to-host copies in the background."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rcf-snapshot", daemon=True)
        self._thread.start()

    def submit(self, pairs: CopyPairs, handle: CopyHandle) -> None:
        self._jobs.put((pairs, handle))

    def _run(self) -> None:
        lower_thread_priority(BACKGROUND_NICE)  # training's threads first; the fence bounds how late it may end
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, handle = job
            try:
                with torch.no_grad():
                    for src, dst in pairs:
                        dst.copy_(src)
            except BaseException as err:  # surfaced by CopyHandle.wait in the persist phase
                handle.error = err
            finally:
                handle._host_done.set()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)


@dataclass
class Snapshot:
    step: int
    state: dict
    epoch_boundary: bool
    copies: CopyHandle
    size_bytes: int
    memory: Any = None  # the HostMemory token whose views hold this snapshot's host buffers
    # Sharded mode: the place (engine/state.py ChunkPlace) of every model and optimizer
    # tensor leaf, by its key path in ``state``; None for a whole-state snapshot.
    places: Mapping[KeyPath, Any] | None = None


class Snapshotter:
    """Takes snapshots into preallocated buffers, reused from one snapshot to the next.

    ``mode`` "cpu" copies into (pinned, for device sources) host memory; "gpu" into spare
    memory on the source's device, moved to pinned host buffers by the persist phase. One
    snapshot may be in flight: the caller must not take the next before the persist phase
    of the previous one has finished. With ``host_memory``, every tensor's host buffer is
    the view it hands out for that snapshot (the copy target in "cpu" mode, the target of
    the move to the host in "gpu" mode); none is allocated here.
    """

    def __init__(self, mode: str = "cpu", *, ops: DeviceOps | None = None,
                 host_memory: HostMemory | None = None) -> None:
        _check_mode(mode)
        self.mode = mode
        self.ops: DeviceOps = ops if ops is not None else CudaOps()
        self.host_memory = host_memory
        self._buffers: dict[KeyPath, tuple[torch.Tensor, Any]] = {}  # (buffer, where it lives)
        self._host_buffers: dict[KeyPath, torch.Tensor] = {}
        self._host = HostCopier()

    def set_mode(self, mode: str) -> None:
        _check_mode(mode)
        if mode != self.mode:
            self.mode = mode
            self._buffers.clear()
            self._host_buffers.clear()

    def take(self, step: int, live: Mapping[str, Any], async_keys: set[str], *,
             epoch_boundary: bool = False) -> Snapshot:
        """Snapshot ``live``: top-level entries in ``async_keys`` copy in the background."""
        memory, views = self._prepare_host_memory(step, live)
        copier = _SnapshotCopier(self, async_keys, views)
        state = walk_state(live, copier)
        handle = CopyHandle(self.ops)
        self._launch_device_copies(copier, handle)
        if copier.host_pairs:
            self._host.submit(copier.host_pairs, handle)
        else:
            handle._host_done.set()
        return Snapshot(step=step, state=state, epoch_boundary=epoch_boundary, copies=handle, size_bytes=copier.size,
                        memory=memory)

    def refresh(self, snapshot: Snapshot, parts: Mapping[tuple[str, ...], Any]) -> None:
        """Replace parts of a held snapshot (key path -> live value) with fresh copies.

        A tensor goes into the buffer its path already has (a slot's layout is fixed when
        the snapshot starts); one of another shape or dtype raises ``ValueError`` before
        anything changed.
        """
        old = {path: _at(snapshot.state, path) for path in parts}
        views = {(*path, *sub): leaf for path, value in old.items()
                 for sub, _, leaf in leaves_of(value) if isinstance(leaf, torch.Tensor)}
        for path, value in parts.items():
            for sub, _, leaf in leaves_of(value):
                view = views.get((*path, *sub))
                if isinstance(leaf, torch.Tensor) and view is not None \
                        and (view.shape != leaf.shape or view.dtype != leaf.dtype):
                    raise ValueError(f"{(*path, *sub)!r} changed from {tuple(view.shape)} {view.dtype} to "
                                     f"{tuple(leaf.shape)} {leaf.dtype} since the snapshot started")
        copier = _SnapshotCopier(self, set(), views)
        fresh = {path: walk_state(_nested(path, value), copier) for path, value in parts.items()}
        for device in copier.to_host_pairs:  # ordered before the move to the host, on its stream
            self.ops.synchronize(self.ops.mark(device))
        for path, tree in fresh.items():
            _at(snapshot.state, path[:-1])[path[-1]] = _at(tree, path)

    def _prepare_host_memory(self, step: int, live: Mapping[str, Any]) -> tuple[Any, dict[KeyPath, torch.Tensor]]:
        if self.host_memory is None:
            return None, {}
        layout = [(path, tuple(leaf.shape), leaf.dtype)
                  for path, _, leaf in leaves_of(live) if isinstance(leaf, torch.Tensor)]
        return self.host_memory.prepare(step, layout)

    def _launch_device_copies(self, copier: _SnapshotCopier, handle: CopyHandle) -> None:
        devices = list(dict.fromkeys([*copier.device_pairs, *copier.to_host_pairs]))
        marks = {device: self.ops.mark(device) for device in devices}
        for device, pairs in copier.device_pairs.items():
            handle._device_events[device] = self.ops.copy(device, pairs, after=[marks[device]])
        if copier.to_host_pairs:
            ready = {device: handle._device_events.get(device, marks[device]) for device in devices}
            handle._to_host = lambda: self._to_host(copier.to_host_pairs, ready)

    def _to_host(self, pairs_by_device: dict[Any, CopyPairs], ready: dict[Any, Any]) -> None:
        events = [self.ops.copy(device, pairs, after=[ready[device]]) for device, pairs in pairs_by_device.items()]
        for event in events:
            self.ops.synchronize(event)

    def buffer(self, path: KeyPath, like: torch.Tensor, device: Any | None) -> torch.Tensor:
        """The snapshot buffer of ``path``: on ``device``, or on the host (pinned if ``device``)."""
        on_device = device is not None and self.mode == "gpu"
        where = ("device", device) if on_device else ("host", device is not None)  # host: pinned or not
        found = self._buffers.get(path)
        if found is not None and found[1] == where and found[0].shape == like.shape and found[0].dtype == like.dtype:
            return found[0]
        pinned = device is not None
        buffer = self.ops.empty_device(like, device) if on_device else self.ops.empty_host(like, pinned=pinned)
        self._buffers[path] = (buffer, where)
        return buffer

    def host_buffer(self, path: KeyPath, like: torch.Tensor) -> torch.Tensor:
        """The pinned host buffer a GPU-mode snapshot of ``path`` moves to."""
        buffer = self._host_buffers.get(path)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = self.ops.empty_host(like, pinned=True)
            self._host_buffers[path] = buffer
        return buffer

    def close(self) -> None:
        self._host.close()
        self._buffers.clear()
        self._host_buffers.clear()


def _at(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _nested(path: tuple[str, ...], value: Any) -> Any:
    """``value`` under ``path`` in otherwise empty mappings, so its leaves walk with their full paths."""
    for key in reversed(path):
        value = {key: value}
    return value


def _check_mode(mode: str) -> None:
    if mode not in ("cpu", "gpu"):
        raise ValueError(f"mode={mode!r}: expected 'cpu' or 'gpu'")


class _SnapshotCopier(ContainerRebuilder):
    """Builds the snapshot's tree of buffers and collects the copies to run."""

    def __init__(self, owner: Snapshotter, async_keys: set[str], views: dict[KeyPath, torch.Tensor]) -> None:
        self.owner = owner
        self.async_keys = async_keys
        self.views = views
        self.host_pairs: CopyPairs = []
        self.device_pairs: dict[Any, CopyPairs] = {}
        self.to_host_pairs: dict[Any, CopyPairs] = {}
        self.size = 0

    def leaf(self, path: KeyPath, name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(path, value)
        return value.copy() if isinstance(value, np.ndarray) else value

    def _tensor(self, path: KeyPath, src: torch.Tensor) -> torch.Tensor:
        self.size += src.numel() * src.element_size()
        owner = self.owner
        device = owner.ops.device_of(src)
        on_device = device is not None and owner.mode == "gpu"
        dst = owner.buffer(path, src, device) if on_device else self._host_target(path, src, device)
        if not path or path[0] not in self.async_keys:
            with torch.no_grad():
                dst.copy_(src)  # on the current stream, ahead of anything queued later
        elif device is not None:
            self.device_pairs.setdefault(device, []).append((src, dst))
        else:
            self.host_pairs.append((src, dst))
        if not on_device:
            return dst
        host = self._view(path, src) if path in self.views else owner.host_buffer(path, src)
        self.to_host_pairs.setdefault(device, []).append((dst, host))
        return host

    def _host_target(self, path: KeyPath, src: torch.Tensor, device: Any) -> torch.Tensor:
        return self._view(path, src) if path in self.views else self.owner.buffer(path, src, device)

    def _view(self, path: KeyPath, src: torch.Tensor) -> torch.Tensor:
        view = self.views[path]
        if view.shape != src.shape or view.dtype != src.dtype:
            raise ValueError(f"host memory for {path!r}: got {tuple(view.shape)} {view.dtype}, "
                             f"the state has {tuple(src.shape)} {src.dtype}")
        return view

    def scalar(self, path: KeyPath, name: str, value: Any) -> Any:
        return value



def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state, in order."""
    return [leaf for _, _, leaf in leaves_of(value) if isinstance(leaf, torch.Tensor)]
