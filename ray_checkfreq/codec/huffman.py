"""Huffman coding of one byte stream: the planar split's exponent stream T
(:mod:`ray_checkfreq.codec.planar`), stored as ``METHOD_HUF`` from blob version 5.

Stored form::

    table log L u8 (12) | 256 code lengths, 4 bits each (symbol 2i in the low nibble of
    byte i; 0: the symbol does not occur) | LANES u32 byte lengths | LANES bit streams

Lane ``j`` codes symbols ``[n*j//LANES, n*(j+1)//LANES)`` of the ``n``-byte stream,
least significant bit first. Codes are canonical (by length, then by symbol), at most
L bits, and complete (Kraft sum exactly 1); a lone symbol is paired with the next one.

Why not zstd's Huffman literals (how T was stored up to version 4): its decoder emits
one symbol per table lookup (about 1 GB/s on one core here) and was the largest cost of
decode. The C decoder here looks up L bits at a time and emits every whole code they
hold (up to 3; about 2.6 for the T streams of trained weights) from 4 independent lanes:
1.2x zstd's speed on MiniLM's T streams (median of 15 alternating runs), and it prefetches
the frame's other streams meanwhile, so that their checksum pass reads them from cache.
Its table is built for every stream (15-20 us here). The ratio is the same (MiniLM T
streams: 13.02 MB against zstd's 13.01 for float32, 13.05 against 13.01 for bfloat16);
encoding runs at 0.8-0.9x zstd's speed. Streams with runs (zero rows, XOR deltas) stay
with zstd, whose matches code them in far less than one bit per byte (the C encoder
returns None for them).

The C kernels encode and decode; :func:`reference_decode` defines the format in Python
for the tests and decodes when the kernels are not built (slowly).
"""

from __future__ import annotations

import struct

import numpy as np

from ray_checkfreq.codec import layout
from ray_checkfreq.codec.errors import CorruptBlobError

TABLE_LOG = 12
LANES = 4
HEADER_BYTES = 1 + 128 + 4 * LANES
MIN_BYTES = 16384  # below this zstd's smaller table description wins


def available() -> bool:
    """Whether the C kernels are built: without them streams are not Huffman-coded."""
    return layout._kernels is not None


def encode(stream) -> bytes | None:
    """The stored form of a byte stream, or None when zstd suits it better (runs)."""
    return layout._kernels.huf_encode(stream) if available() else None


def decode_into(stored, out: np.ndarray, frame: int, ahead=None) -> None:
    """Decode ``stored`` into the uint8 array ``out`` (its length is the symbol count).

    ``ahead``: a buffer the caller reads next, prefetched while decoding (a hint)."""
    if available():
        try:
            if ahead is None:
                layout._kernels.huf_decode(stored, out)
            else:
                layout._kernels.huf_decode(stored, out, ahead)
        except ValueError:
            raise CorruptBlobError(f"codec blob frame {frame} has a malformed Huffman "
                                   "stream") from None
        return
    try:
        out[:] = np.frombuffer(reference_decode(bytes(stored), out.size), np.uint8)
    except ValueError as exc:
        raise CorruptBlobError(f"codec blob frame {frame}: {exc}") from None


def code_lengths(stored: bytes) -> list[int]:
    if len(stored) < HEADER_BYTES or stored[0] != TABLE_LOG:
        raise ValueError("malformed Huffman stream header")
    lengths = []
    for byte in stored[1:129]:
        lengths += [byte & 15, byte >> 4]
    return lengths


def canonical_codes(lengths: list[int]) -> dict[tuple[int, int], int]:
    """{(length, code read first bit first): symbol}; checks that the code is complete."""
    if sum(2 ** (TABLE_LOG - n) for n in lengths if n) != 2 ** TABLE_LOG:
        raise ValueError("Huffman code lengths do not form a complete code")
    codes, code, prev = {}, 0, 0
    for length, symbol in sorted((n, s) for s, n in enumerate(lengths) if n):
        code <<= length - prev
        codes[(length, code)] = symbol
        code, prev = code + 1, length
    return codes


def reference_decode(stored: bytes, n: int) -> bytes:
    """The ``n`` symbols of a stored stream, one bit at a time (the format's definition)."""
    codes = canonical_codes(code_lengths(stored))
    sizes = struct.unpack_from(f"<{LANES}I", stored, 1 + 128)
    if HEADER_BYTES + sum(sizes) != len(stored):
        raise ValueError("Huffman lane lengths do not match the stream")
    out, start = bytearray(), HEADER_BYTES
    for j, size in enumerate(sizes):
        bits = int.from_bytes(stored[start:start + size], "little")
        pos = 0
        for _ in range(n * j // LANES, n * (j + 1) // LANES):
            code, length = 0, 0
            while (length, code) not in codes:
                if length >= TABLE_LOG or pos >= 8 * size:
                    raise ValueError("Huffman lane ends inside a code")
                code = code << 1 | (bits >> pos) & 1
                pos, length = pos + 1, length + 1
            out.append(codes[(length, code)])
        if (pos + 7) // 8 != size:
            raise ValueError("Huffman lane holds bytes beyond its codes")
        start += size
    return bytes(out)
