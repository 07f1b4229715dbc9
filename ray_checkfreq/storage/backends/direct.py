"""Writing a large file around the page cache (``O_DIRECT``), with the same bytes on disk.

A buffered ``write`` copies every byte into the page cache in the kernel: for a 96 MiB
shard about 40 ms of system CPU, which a persist takes from training on a busy node
(``O_DIRECT`` here: about 5 ms). With ``O_DIRECT`` the device reads the caller's pages.

The kernel takes a direct write only when the buffer's address, the file offset and the
length are multiples of the block size. Chunks that qualify (a slot's leaf: page-aligned
in the slot, and the store starts large leaves at a ``BLOCK``-aligned offset) are written
in place; other bytes pass through an aligned staging buffer (one user-space copy, as many
as the kernel's). The last partial block is written buffered, so the file has exactly the
bytes given. A filesystem without ``O_DIRECT`` (tmpfs on older kernels), or one that
refuses a write, gets plain buffered writes from that point on; the caller's ``fsync``
makes either durable.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

BLOCK = 4096
# Leaves at least this large start on a BLOCK boundary (in store shards and in Ray slots),
# so they can be written in place; smaller ones are cheap to stage.
LARGE_LEAF_BYTES = 64 * 1024
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0: the platform has none (macOS)
STAGING_BYTES = 4 << 20


def leaf_start(offset: int, nbytes: int, align: int) -> int:
    """Where a leaf of ``nbytes`` goes after ``offset`` in a layout aligned to ``align``: a
    large leaf on a BLOCK boundary, so it can be written in place."""
    unit = BLOCK if nbytes >= LARGE_LEAF_BYTES else align
    return offset + -offset % unit


def address_of(view: memoryview) -> int:
    """Where the bytes of ``view`` start in memory (read-only buffers too)."""
    if not view.nbytes:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def enable_direct(fd: int) -> bool:
    """Turn ``O_DIRECT`` on for ``fd``; False (nothing changed) where the filesystem has none."""
    if not O_DIRECT:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    return True


class DirectWriter:
    """Appends chunks to ``fd`` (opened for writing at offset 0, ``O_DIRECT`` already on)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.direct = True
        self.offset = 0  # bytes written to the file so far
        self.direct_bytes = 0  # of them, written from the caller's memory without a copy
        self._staging = mmap.mmap(-1, STAGING_BYTES)  # page-aligned
        self._staged = memoryview(self._staging)
        self._fill = 0

    def write_all(self, chunks: Sequence[Any]) -> None:
        try:
            for chunk in chunks:
                self._write(memoryview(chunk).cast("B"))
            self._finish()
        finally:
            try:
                self._staged.release()
                self._staging.close()
            except BufferError:  # a failed write's traceback still holds a slice: freed with it
                pass

    def _write(self, view: memoryview) -> None:
        while view.nbytes:
            if self._can_write_in_place(view):
                self._flush_staging()
                length = view.nbytes - view.nbytes % BLOCK
                written = self._raw_write(view[:length])
                self.direct_bytes += written if self.direct else 0
                view = view[written:]
            else:
                take = min(STAGING_BYTES - self._fill, view.nbytes)
                self._staged[self._fill:self._fill + take] = view[:take]
                self._fill += take
                view = view[take:]
                if self._fill == STAGING_BYTES:
                    self._flush_staging()

    def _can_write_in_place(self, view: memoryview) -> bool:
        # The staged bytes are flushed first, so they must end on a block boundary too.
        return (self.direct and view.nbytes >= BLOCK and self._fill % BLOCK == 0
                and (self.offset + self._fill) % BLOCK == 0 and address_of(view) % BLOCK == 0)

    def _flush_staging(self) -> None:
        done = 0
        while done < self._fill:
            done += self._raw_write(self._staged[done:self._fill])
        self._fill = 0

    def _finish(self) -> None:
        """The staged rest: whole blocks direct, the partial last block buffered."""
        whole = self._fill - self._fill % BLOCK
        done = 0
        while done < whole:
            done += self._raw_write(self._staged[done:whole])
        self._go_buffered()
        while done < self._fill:
            done += self._raw_write(self._staged[done:self._fill])
        self._fill = 0

    def _raw_write(self, view: memoryview) -> int:
        """One ``write``; a direct write the filesystem refuses is retried buffered."""
        try:
            written = os.write(self.fd, view)
        except OSError as err:
            if not (self.direct and err.errno == errno.EINVAL):
                raise
            self._go_buffered()
            written = os.write(self.fd, view)
        self.offset += written
        return written

    def _go_buffered(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
            self.direct = False
