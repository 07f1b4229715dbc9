"""How the bytes of a frame become streams and back, for each layout a blob can name.

The work is done by the C kernels (``_kernels.c``) when they are built, else by the numpy
implementations (:mod:`.grouping`, :mod:`.planar`), which define the layouts and which
the kernels are tested against. Both produce identical streams.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ray_checkfreq.codec import grouping, planar

try:
    from ray_checkfreq.codec import _kernels  # type: ignore[attr-defined]
except ImportError:  # a source tree without a build: correct, several times slower
    _kernels = None

SINGLE = "single"  # one stream: the bytes as they are
BYTES = "bytes"  # byte j of every element (rotated left by `rotation` bits first)
E8 = "e8"  # planar exponent split of 8-bit-exponent floats (see planar.py)
SIGN_ROTATED = "sign-rotated"  # format version 2 byte grouping; decoded, never written

_warned = False

# zlib.crc32's result, about 3x faster where the kernels have carry-less multiply.
crc32: Callable[..., int] = (
    _kernels.crc32 if getattr(_kernels, "clmul", 0) else zlib.crc32)


def crc32_accelerated() -> bool:
    return crc32 is not zlib.crc32


def kernels_available() -> bool:
    return _kernels is not None


@dataclass(frozen=True, kw_only=True)
class Layout:
    kind: str
    unit: int  # bytes per element (per scalar unit of a complex dtype)
    rotation: int = 0

    @property
    def nstreams(self) -> int:
        if self.kind == SINGLE:
            return 1
        if self.kind == E8:
            return len(planar.stream_lengths(0, self.unit))
        return self.unit

    def stream_lengths(self, nbytes: int) -> list[int]:
        if self.kind == SINGLE:
            return [nbytes]
        if self.kind == E8:
            return planar.stream_lengths(nbytes, self.unit)
        return [nbytes // self.unit] * self.unit

    def holds_exponent(self, j: int) -> bool:
        """Whether stream ``j`` holds exponent bits (coded with the exponent's zstd settings)."""
        if self.kind == E8:
            return j < 2
        rotated = self.kind == SIGN_ROTATED or (self.kind == BYTES and self.rotation > 0)
        return rotated and j == self.unit - 1

    def split(self, frame: np.ndarray) -> list:
        """The streams of a uint8 frame; they stay valid until this thread's next split."""
        if self.kind == SINGLE:
            return [frame]
        if _kernels is None:
            _warn_slow()
            if self.kind == E8:
                return planar.split(frame, self.unit)
            return grouping.split(frame, self.unit, rotation=self.rotation)
        lengths = self.stream_lengths(frame.nbytes)
        out = grouping.scratch("split", sum(lengths))[:sum(lengths)]
        if self.kind == E8:
            _kernels.e8_split(frame, self.unit, out)
        else:
            _kernels.group_split(frame, self.unit, self.rotation, out)
        return _cut(out, lengths)

    def merge(self, streams: list, out: np.ndarray) -> None:
        """Write the streams (buffers of :meth:`stream_lengths`) into the uint8 frame ``out``."""
        if self.kind == SINGLE:
            out[:] = np.frombuffer(streams[0], np.uint8)
        elif self.kind == SIGN_ROTATED:
            grouping.merge_into(streams, out, self.unit, sign_rotated=True)
        elif _kernels is None:
            _warn_slow()
            if self.kind == E8:
                planar.merge_into(streams, out, self.unit)
            else:
                grouping.merge_into(streams, out, self.unit, rotation=self.rotation)
        elif self.kind == E8:
            _kernels.e8_merge(streams, self.unit, out)
        else:
            _kernels.group_merge(streams, self.unit, self.rotation, out)


def _cut(buf: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    parts, pos = [], 0
    for n in lengths:
        parts.append(buf[pos:pos + n])
        pos += n
    return parts


def _warn_slow() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("ray_checkfreq.codec: the C kernels are not built (reinstall the "
                      "package with a C compiler); using the numpy fallback, several "
                      "times slower", RuntimeWarning, stacklevel=3)
