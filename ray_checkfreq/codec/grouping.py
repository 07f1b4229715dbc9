"""Byte grouping: split elements of ``width`` bytes into ``width`` byte streams and back.

Stream ``j`` holds byte ``j`` (little-endian) of every element. With ``rotate`` the sign
bit of a float moves next to the mantissa: the top stream then holds the high exponent
bits only (the pure exponent byte for bfloat16 and float32), which is the one stream that
compresses well.
"""

from __future__ import annotations

import numpy as np


def split(frame: np.ndarray, width: int, *, rotate: bool) -> list[np.ndarray]:
    """Contiguous byte streams of a uint8 frame holding whole elements of ``width`` bytes."""
    if width == 1:
        return [frame]
    grid = frame.reshape(-1, width)
    streams = [np.ascontiguousarray(grid[:, j]) for j in range(width)]
    if rotate:
        top, nxt = streams[-1], streams[-2]
        # top' = 7 high exponent bits + exponent bit 0; nxt' = sign + 7 mantissa bits
        # New arrays only: a stream may be a view of the caller's memory.
        new_top = np.left_shift(top, 1)
        new_top |= nxt >> 7
        new_nxt = np.bitwise_and(nxt, 0x7F)
        new_nxt |= top & 0x80
        streams[-2], streams[-1] = new_nxt, new_top
    return streams


def merge_into(streams: list, out: np.ndarray, width: int, *, rotate: bool) -> None:
    """Inverse of :func:`split`: write the streams (buffers) into the uint8 frame ``out``."""
    if width == 1:
        out[:] = np.frombuffer(streams[0], dtype=np.uint8)
        return
    grid = out.reshape(-1, width)
    arrays = [np.frombuffer(s, dtype=np.uint8) for s in streams]
    last = width - 2 if rotate else width
    for j in range(last):
        grid[:, j] = arrays[j]
    if rotate:
        top, nxt = arrays[-1], arrays[-2]
        orig_top = top >> 1
        orig_top |= nxt & 0x80
        orig_nxt = nxt & 0x7F
        orig_nxt |= np.left_shift(top & 1, 7)
        grid[:, -2] = orig_nxt
        grid[:, -1] = orig_top
