"""Byte grouping: split elements of ``width`` bytes into ``width`` byte streams and back.

Stream ``j`` holds byte ``j`` (little-endian) of every element. With ``rotate`` the sign
bit of a float moves next to the mantissa: the top stream then holds the high exponent
bits only (the pure exponent byte for bfloat16 and float32), which is the one stream that
compresses well::

    top byte  s e7 e6 e5 e4 e3 e2 e1   ->   e7 e6 e5 e4 e3 e2 e1 e0   (exponent stream)
    next byte e0 m  m  m  m  m  m  m   ->   s  m  m  m  m  m  m  m    (sign stream)

Speed (measured, one core): numpy writes a strided byte column at ~3 G items/s whatever
the item size, while casts and bit operations on contiguous arrays run at 15-25 GB/s, and
numpy's uint8 left shift is not vectorized (~1.7 GB/s). So the rotation is done with
uint64-lane operations on contiguous scratch (8 elements per lane operation), and on decode
the rotated pair is rebuilt as one uint16 per element (two casts, six lane operations),
written with a single copy (16-bit dtypes) or one strided uint16 write (wider ones) instead
of two strided byte writes. Every call works on a whole frame and releases the GIL, so
frames group and ungroup in parallel threads.
"""

from __future__ import annotations

import threading

import numpy as np

_local = threading.local()
_U64 = np.uint64
_LOW7 = _U64(0x7F7F7F7F7F7F7F7F)
_TOP1 = _U64(0x8080808080808080)
_NOT_BIT0 = _U64(0xFEFEFEFEFEFEFEFE)
_BIT0 = _U64(0x0101010101010101)
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


def split(frame: np.ndarray, width: int, *, rotate: bool) -> list[np.ndarray]:
    """Contiguous byte streams of a uint8 frame holding whole elements of ``width`` bytes.

    The streams are new arrays (never views of ``frame``, which may be caller memory).
    """
    if width == 1:
        return [frame]
    grid = frame.reshape(-1, width)
    n = grid.shape[0]
    plain = width - 2 if rotate else width
    streams = [np.ascontiguousarray(grid[:, j]) for j in range(plain)]
    if rotate:
        padded = -(-n // 8) * 8
        top, nxt = scratch("top", padded), scratch("nxt", padded)
        top[:n] = grid[:, -1]
        nxt[:n] = grid[:, -2]
        exp, low = np.empty(padded, np.uint8), np.empty(padded, np.uint8)
        t64, n64, e64, l64 = (a.view(_U64) for a in (top, nxt, exp, low))
        tmp = scratch("tmp", padded).view(_U64)
        # exp = top << 1 | nxt >> 7, low = nxt & 0x7F | top & 0x80, per byte of each lane
        np.left_shift(t64, _U64(1), out=e64)
        e64 &= _NOT_BIT0
        np.right_shift(n64, _U64(7), out=tmp)
        tmp &= _BIT0
        e64 |= tmp
        np.bitwise_and(n64, _LOW7, out=l64)
        np.bitwise_and(t64, _TOP1, out=tmp)
        l64 |= tmp
        streams += [low[:n], exp[:n]]
    return streams


def rotated_pair(low: np.ndarray, exp: np.ndarray) -> np.ndarray:
    """The two top bytes of each element as uint16, rebuilt from the sign and exponent
    streams (uint8 arrays of equal length): ``s e7..e0 m6..m0``. A view of scratch."""
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


def merge_into(streams: list, out: np.ndarray, width: int, *, rotate: bool) -> None:
    """Inverse of :func:`split`: write the streams (buffers) into the uint8 frame ``out``."""
    arrays = [s if isinstance(s, np.ndarray) else np.frombuffer(s, dtype=np.uint8)
              for s in streams]
    if width == 1:
        out[:] = arrays[0]
        return
    grid = out.reshape(-1, width)
    plain = width - 2 if rotate else width
    for j in range(plain):
        grid[:, j] = arrays[j]
    if rotate:
        pair = rotated_pair(arrays[-2], arrays[-1])
        if width == 2:
            out.view(np.uint16)[:] = pair
        else:
            out.view(np.uint16).reshape(-1, width // 2)[:, -1] = pair
