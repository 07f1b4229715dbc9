"""Byte grouping in numpy: split elements of ``width`` bytes into ``width`` byte streams
and back. The definition of the "bytes" layout (the C kernels in ``_kernels.c`` must match
it) and its fallback when they are not built.

Stream ``j`` holds byte ``j`` (little-endian) of every element, each element first rotated
left by ``rotation`` bits. float16 and float64 rotate by 1: the sign bit leaves the top
byte, which then holds only exponent bits (and, for float16, the top mantissa bits), the
one stream that compresses. Integers are not rotated. Floats with an 8-bit exponent use
the planar split of :mod:`ray_checkfreq.codec.planar` instead.

Format version 2 blobs used another layout (only the sign bit moved, into bit 7 of the
second byte); :func:`merge_into` still reads it (``sign_rotated``).

Speed (numpy, one core): a strided byte column is written at ~3 G items/s whatever the
item size, while shifts on contiguous arrays run at 15-25 GB/s, so the rotation is done
on whole frames as unsigned words, on reusable scratch.
"""

from __future__ import annotations

import threading

import numpy as np

_local = threading.local()
_WORD = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_U64 = np.uint64
_PAIR_BIT7 = _U64(0x0080008000800080)


def scratch(name: str, nbytes: int) -> np.ndarray:
    """A reusable, 8-byte-aligned uint8 work array of at least ``nbytes`` (rounded up to 8)
    for this thread: cache-warm and never a fresh page. Each ``name`` is one buffer."""
    bufs = _local.__dict__.setdefault("bufs", {})
    size = -(-max(nbytes, 8) // 8) * 8
    buf = bufs.get(name)
    if buf is None or buf.size < size:
        buf = bufs[name] = np.empty(size, np.uint8)
    return buf[:size]


def split(frame: np.ndarray, width: int, *, rotation: int = 0) -> list[np.ndarray]:
    """Contiguous byte streams of a uint8 frame holding whole elements of ``width`` bytes,
    each element rotated left by ``rotation`` bits first.

    The streams are new arrays (never views of ``frame``, which may be caller memory).
    """
    if width == 1:
        return [frame]
    source = frame
    if rotation:
        words = frame.view(_WORD[width])
        rotated = scratch("rot", frame.nbytes).view(_WORD[width])[:words.size]
        spill = scratch("tmp", frame.nbytes).view(_WORD[width])[:words.size]
        np.left_shift(words, rotation, out=rotated)
        np.right_shift(words, 8 * width - rotation, out=spill)
        rotated |= spill
        source = rotated.view(np.uint8)
    grid = source.reshape(-1, width)
    return [np.ascontiguousarray(grid[:, j]) for j in range(width)]


def rotated_pair(low: np.ndarray, exp: np.ndarray) -> np.ndarray:
    """Format version 2: the two top bytes of each element as uint16, rebuilt from the
    sign and exponent streams (uint8 arrays of equal length): ``s e7..e0 m6..m0``. A view
    of scratch."""
    n = exp.shape[0]
    pair, tmp = scratch("pair", 2 * n).view(np.uint16), scratch("tmp", 2 * n).view(np.uint16)
    np.copyto(pair[:n], exp, casting="unsafe")  # 00000000 e7..e0
    np.copyto(tmp[:n], low, casting="unsafe")  # 00000000 s m6..m0
    p64, t64 = pair.view(_U64), tmp.view(_U64)  # whole lanes; the padding is ignored
    p64 <<= _U64(7)  # 0 e7..e0 0000000
    p64 ^= t64  # 0 e7..e1 (e0^s) m6..m0
    t64 &= _PAIR_BIT7  # s << 7
    p64 ^= t64  # 0 e7..e0 m6..m0
    t64 <<= _U64(8)
    p64 |= t64  # s e7..e0 m6..m0
    return pair[:n]


def merge_into(streams: list, out: np.ndarray, width: int, *, rotation: int = 0,
               sign_rotated: bool = False) -> None:
    """Inverse of :func:`split`: write the streams (buffers) into the uint8 frame ``out``.

    ``sign_rotated``: the streams use the layout of format version 2 instead.
    """
    arrays = [s if isinstance(s, np.ndarray) else np.frombuffer(s, dtype=np.uint8)
              for s in streams]
    if width == 1:
        out[:] = arrays[0]
        return
    if sign_rotated:
        _merge_sign_rotated(arrays, out, width)
        return
    grid = out.reshape(-1, width)
    for j in range(width):
        grid[:, j] = arrays[j]
    if rotation:
        words = out.view(_WORD[width])
        spill = scratch("tmp", out.nbytes).view(_WORD[width])[:words.size]
        np.left_shift(words, 8 * width - rotation, out=spill)
        words >>= rotation
        words |= spill


def _merge_sign_rotated(arrays: list[np.ndarray], out: np.ndarray, width: int) -> None:
    grid = out.reshape(-1, width)
    for j in range(width - 2):
        grid[:, j] = arrays[j]
    pair = rotated_pair(arrays[-2], arrays[-1])
    if width == 2:
        out.view(np.uint16)[:] = pair
    else:
        out.view(np.uint16).reshape(-1, width // 2)[:, -1] = pair
