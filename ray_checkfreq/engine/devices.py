"""The device operations a snapshot needs, behind one seam so the logic runs without a GPU.

``CudaOps`` is the real one. Every copy it issues runs on one dedicated stream per device,
created at the lowest priority CUDA offers, never on the stream training runs on: the
copies then wait for the work queued before them (through an event), not for training
kernels queued after them, and those kernels never wait for the copies. CUDA stream
priorities only order compute kernels; copy-engine transfers (device to pinned host) run
beside them anyway, which is the point of the separate stream.

Each source is ``record_stream``-ed on the copy stream: a tensor that ``state_dict()``
created and nobody references after the snapshot returns would otherwise go back to the
caching allocator and be reused by the training stream while the copy still reads it.
"""

from __future__ import annotations

import mmap
import threading
from typing import Any, Protocol

import torch

from ray_checkfreq.storage.backends.direct import LARGE_LEAF_BYTES


def page_aligned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor starting on a page, so a local store writes it around the
    page cache without a staging copy (``torch.empty`` aligns to 64 bytes only)."""
    nbytes = shape.numel() * dtype.itemsize
    pages = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class DeviceOps(Protocol):
    """What ``Snapshotter`` asks of the devices that hold state."""

    def device_of(self, tensor: torch.Tensor) -> Any | None:
        """The accelerator holding ``tensor``; None for host memory."""

    def empty_host(self, like: torch.Tensor, *, pinned: bool) -> torch.Tensor: ...

    def empty_device(self, like: torch.Tensor, device: Any) -> torch.Tensor: ...

    def mark(self, device: Any) -> Any:
        """An event after the work queued so far on ``device``'s current stream."""

    def copy(self, device: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: list[Any]) -> Any:
        """``dst.copy_(src)`` for each pair on the device's copy stream, once ``after`` are done.

        Returns an event that completes with the copies.
        """

    def fence(self, device: Any, event: Any) -> None:
        """Work queued later on ``device``'s current stream waits for ``event`` (no host wait)."""

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` completed."""


class CudaOps:
    """``DeviceOps`` for CUDA; ``cuda`` is the ``torch.cuda`` module (a fake in tests)."""

    def __init__(self, cuda: Any = torch.cuda) -> None:
        self._cuda = cuda
        self._streams: dict[Any, Any] = {}
        self._lock = threading.Lock()  # the training and the persist thread both ask for streams

    def device_of(self, tensor: torch.Tensor) -> Any | None:
        return tensor.device if tensor.is_cuda else None

    def empty_host(self, like: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if pinned or nbytes < LARGE_LEAF_BYTES:
            return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)
        return page_aligned_empty(like.shape, like.dtype)

    def empty_device(self, like: torch.Tensor, device: Any) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=device)

    def copy_stream(self, device: Any) -> Any:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._cuda.Stream(device=device, priority=self._least_priority())
                self._streams[device] = stream
            return stream

    def _least_priority(self) -> int:
        # (least, greatest); lower numbers are higher priorities and 0 is the default
        least, _greatest = self._cuda.Stream.priority_range()
        return int(least)

    def mark(self, device: Any) -> Any:
        event = self._cuda.Event()
        event.record(self._cuda.current_stream(device))
        return event

    def copy(self, device: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: list[Any]) -> Any:
        stream = self.copy_stream(device)
        for event in after:
            stream.wait_event(event)
        with self._cuda.stream(stream), torch.no_grad():
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                for tensor in (src, dst):
                    if tensor.is_cuda:
                        tensor.record_stream(stream)
            done = self._cuda.Event()
            done.record(stream)
        return done

    def fence(self, device: Any, event: Any) -> None:
        self._cuda.current_stream(device).wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()
