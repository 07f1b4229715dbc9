"""Phase 1 of a checkpoint: an in-memory snapshot taken off the critical path.

Invariant: parameters and optimizer state change only inside ``optimizer.step()``. Their
copies therefore run asynchronously (a CUDA side stream, or a host thread on a CPU-only
machine) while the next forward/backward runs, and the fence before the next
``optimizer.step()`` waits for them. Everything else (module buffers such as BatchNorm
statistics, which forward passes update, scheduler, data iterator and RNG states) is
copied synchronously when the snapshot starts. A snapshot is therefore never a mix of
two iterations.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


class CopyHandle:
    """Completion of one snapshot's asynchronous copies."""

    def __init__(self) -> None:
        self._host_done = threading.Event()
        self._cuda_event: Any = None
        self.error: BaseException | None = None

    def fence(self) -> None:
        """Called before the next weight update: after it, the update may overwrite sources."""
        if self._cuda_event is not None:
            torch.cuda.current_stream().wait_event(self._cuda_event)  # GPU-side, no host wait
        self._host_done.wait()

    def wait(self) -> None:
        """Block until the snapshot's bytes are in their buffers (for the persist phase)."""
        self._host_done.wait()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        if self.error is not None:
            raise self.error


class HostCopier:
    """One long-lived thread that runs host-to-host copies in the background."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rcf-snapshot", daemon=True)
        self._thread.start()

    def submit(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], handle: CopyHandle) -> None:
        self._jobs.put((pairs, handle))

    def _run(self) -> None:
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


class Snapshotter:
    """Takes snapshots into preallocated buffers, reused from one snapshot to the next.

    ``mode`` "cpu" copies into (pinned, for CUDA sources) host memory; "gpu" into spare
    memory on the source's device. One snapshot may be in flight: the caller must not
    take the next before the persist phase of the previous one has finished.
    """

    def __init__(self, mode: str = "cpu") -> None:
        if mode not in ("cpu", "gpu"):
            raise ValueError(f"mode={mode!r}: expected 'cpu' or 'gpu'")
        self.mode = mode
        self._buffers: dict[str, torch.Tensor] = {}
        self._host = HostCopier()
        self._stream: Any = None

    def set_mode(self, mode: str) -> None:
        if mode != self.mode:
            self.mode = mode
            self._buffers.clear()

    def take(self, step: int, live: Mapping[str, Any], async_keys: set[str], *, epoch_boundary: bool = False) -> Snapshot:
        """Snapshot ``live``: top-level entries in ``async_keys`` copy in the background."""
        host_pairs: list = []
        cuda_pairs: list = []
        state: dict = {}
        size = [0]
        for name, value in live.items():
            asynchronous = name in async_keys
            state[name] = self._copy_tree(value, name, asynchronous, host_pairs, cuda_pairs, size)
        handle = CopyHandle()
        self._launch_cuda(cuda_pairs, handle)
        if host_pairs:
            self._host.submit(host_pairs, handle)
        else:
            handle._host_done.set()
        return Snapshot(step=step, state=state, epoch_boundary=epoch_boundary, copies=handle, size_bytes=size[0])

    def _copy_tree(self, value: Any, path: str, asynchronous: bool, host_pairs: list, cuda_pairs: list,
                   size: list) -> Any:
        if isinstance(value, torch.Tensor):
            size[0] += value.numel() * value.element_size()
            dst = self._buffer(path, value)
            if not asynchronous:
                with torch.no_grad():
                    dst.copy_(value)
            elif value.is_cuda:
                cuda_pairs.append((value.detach(), dst))
            else:
                host_pairs.append((value.detach(), dst))
            return dst
        if isinstance(value, Mapping):
            copied = {k: self._copy_tree(v, f"{path}/{k}", asynchronous, host_pairs, cuda_pairs, size)
                      for k, v in value.items()}
            if hasattr(value, "_metadata"):
                from collections import OrderedDict

                ordered = OrderedDict(copied)
                ordered._metadata = _plain_copy(value._metadata)  # type: ignore[attr-defined]
                return ordered
            return copied
        if isinstance(value, (list, tuple)):
            items = [self._copy_tree(v, f"{path}/{i}", asynchronous, host_pairs, cuda_pairs, size)
                     for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        return _plain_copy(value)

    def _buffer(self, path: str, src: torch.Tensor) -> torch.Tensor:
        device = src.device if (self.mode == "gpu" and src.is_cuda) else torch.device("cpu")
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != src.shape or buffer.dtype != src.dtype or buffer.device != device:
            pin = src.is_cuda and device.type == "cpu"
            buffer = torch.empty(src.shape, dtype=src.dtype, device=device, pin_memory=pin)
            self._buffers[path] = buffer
        return buffer

    def _launch_cuda(self, pairs: list, handle: CopyHandle) -> None:
        if not pairs:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        # The side stream starts after the weight update already queued on the main stream.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream), torch.no_grad():
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        handle._cuda_event = event

    def close(self) -> None:
        self._host.close()
        self._buffers.clear()


def _plain_copy(value: Any) -> Any:
    """Copies of the small, non-tensor parts of a state (they may change after return)."""
    if isinstance(value, Mapping):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_copy(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if hasattr(value, "copy") and type(value).__module__ == "numpy":
        return value.copy()
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []
