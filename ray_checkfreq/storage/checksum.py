"""crc32 (zlib's polynomial, zlib's values) of a buffer, with less CPU than zlib's.

A persist checksums every byte it writes, beside training, so this pass should cost as
little CPU as possible: the codec's compiled kernel folds with carry-less multiply where
the CPU has it (about 3x zlib's speed), without the GIL; elsewhere it is ``zlib.crc32``.
"""

from __future__ import annotations

from ray_checkfreq.codec.layout import crc32, crc32_accelerated

__all__ = ["accelerated", "crc32"]


def accelerated() -> bool:
    """Whether the carry-less-multiply kernel is in use."""
    return crc32_accelerated()
