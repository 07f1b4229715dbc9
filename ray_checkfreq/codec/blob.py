"""The self-describing blob: a header, a frame table and the stored streams.

Layout (little-endian)::

    magic "RCFZ" | version u8 | flags u8 | dtype name (u8 length + ASCII)
    | ndim u8 | shape u64 * ndim | precision_bits u8 (255: lossless)
    | width u8 (streams per frame) | [rotation u8, version >= 3]
    | [precision_factor_log2 u8, version >= 4] | frame_elems u64
    | nframes u32
    | per frame: raw_crc u32 | stored_crc u32 | [base_crc u32 if DELTA]
    |            per stream: method u8 | stored_len u32
    | header_crc u32 (crc32 of every header byte before it)
    | payload: for each frame, its streams in order

``rotation``: with ``FLAG_GROUPED``, the bits each element (each scalar unit of a complex
dtype) was rotated left before its bytes were grouped (:mod:`ray_checkfreq.codec.grouping`).
``FLAG_PLANAR_E8`` names the planar exponent split (:mod:`ray_checkfreq.codec.planar`)
instead. Version 2 blobs set ``FLAG_ROTATE`` with ``FLAG_GROUPED`` for their own layout
(the float sign bit moved next to the mantissa).

``precision_factor_log2``: the blob was encoded with ``precision_factor=2**that``
(:mod:`ray_checkfreq.codec.nearlossless`); ``FLAG_FACTOR_ROUNDED`` says the rounding was
applied (every finite value lay in [-1, 1]), its absence that the tensor is stored exactly.
Only such blobs are written as version 4; all others are still written as version 3, so a
reader from before version 4 reads every blob it can represent. Version 5 has the layout
of version 4 (``precision_factor_log2`` is 255 without a factor) and is written exactly
when a stream is stored Huffman-coded (``METHOD_HUF``, :mod:`ray_checkfreq.codec.huffman`)
or as a fill (``METHOD_FILL``: a byte, then one byte repeated, as the planar split's
stream K of a frame whose exponents all lie in the offset's window), which readers before
it cannot decode.

``stored_crc`` is the crc32 of the frame's stored streams (what :func:`verify` checks),
``base_crc`` of the frame's bytes of the delta base. ``raw_crc`` depends on the version:

- version 5: as versions 2-4, and ``raw_crc`` also covers the stored bytes of the
  Huffman-coded and fill streams (with the raw ones, in stream order).
- versions 2 to 4: every zstd stream carries zstd's own content checksum (XXH64,
  checked by zstd while it decompresses) and ``raw_crc`` is the crc32 of the streams
  stored raw, in order (0 when there are none). Every stored byte is thus covered by a
  content check, and decode never needs a second pass over the whole output.
- version 1 (still read): ``raw_crc`` is the crc32 of the frame's bytes of the decoded
  tensor.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from ray_checkfreq.codec.errors import CorruptBlobError

MAGIC = b"RCFZ"
VERSION = 3  # written for every blob without precision_factor
VERSION_FACTOR = 4  # written for blobs encoded with precision_factor
VERSION_HUF = 5  # written for blobs with a Huffman-coded stream (with or without a factor)
READABLE_VERSIONS = (1, 2, 3, 4, 5)

FLAG_DELTA = 1  # stored bytes are x XOR base
FLAG_ROTATE = 2  # versions 1-2: float sign bit moved next to the mantissa before grouping
FLAG_GROUPED = 4  # element bytes split into `width` streams, one per byte position
FLAG_PLANAR_E8 = 8  # version >= 3: planar exponent split into `width` streams (planar.py)
FLAG_FACTOR_ROUNDED = 16  # version >= 4: values rounded to multiples of 2^-precision_factor_log2

METHOD_RAW = 0
METHOD_ZSTD = 1
METHOD_HUF = 2  # version >= 5: huffman.py's coding of one byte stream
METHOD_FILL = 3  # version >= 5: 2 stored bytes: the stream's first byte, then every other one
METHOD_NAMES = {METHOD_RAW: "raw", METHOD_ZSTD: "zstd", METHOD_HUF: "huffman",
                METHOD_FILL: "fill"}
METHODS_OF_VERSION_5 = (METHOD_HUF, METHOD_FILL)
NO_PRECISION = 255


@dataclass(frozen=True, kw_only=True)
class FrameEntry:
    raw_crc: int
    stored_crc: int
    base_crc: int  # 0 unless the blob is a delta
    streams: tuple[tuple[int, int], ...]  # (method, stored_len) per stream

    @property
    def stored_len(self) -> int:
        return sum(n for _, n in self.streams)


@dataclass(frozen=True, kw_only=True)
class Header:
    flags: int
    dtype: str
    shape: tuple[int, ...]
    precision_bits: int | None
    width: int
    frame_elems: int
    frames: tuple[FrameEntry, ...]
    rotation: int = 0
    precision_factor_log2: int | None = None
    version: int = VERSION  # pack() writes the version that the header needs (_written_version)

    @property
    def factor_rounded(self) -> bool:
        return bool(self.flags & FLAG_FACTOR_ROUNDED)

    @property
    def is_delta(self) -> bool:
        return bool(self.flags & FLAG_DELTA)


def _written_version(h: Header) -> int:
    """The oldest version that can hold ``h``: older readers keep reading what they can."""
    if any(method in METHODS_OF_VERSION_5 for f in h.frames for method, _ in f.streams):
        return VERSION_HUF
    return VERSION if h.precision_factor_log2 is None else VERSION_FACTOR


def pack(h: Header) -> bytes:
    name = h.dtype.encode("ascii")
    factor = h.precision_factor_log2
    version = _written_version(h)
    precision = NO_PRECISION if h.precision_bits is None else h.precision_bits
    parts = [MAGIC, struct.pack("<BBB", version, h.flags, len(name)), name,
             struct.pack(f"<B{len(h.shape)}Q", len(h.shape), *h.shape),
             struct.pack("<BBB", precision, h.width, h.rotation),
             b"" if version < VERSION_FACTOR else struct.pack(
                 "<B", NO_PRECISION if factor is None else factor),
             struct.pack("<QI", h.frame_elems, len(h.frames))]
    for f in h.frames:
        parts.append(struct.pack("<II", f.raw_crc, f.stored_crc))
        if h.is_delta:
            parts.append(struct.pack("<I", f.base_crc))
        for method, n in f.streams:
            parts.append(struct.pack("<BI", method, n))
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


class _Reader:
    def __init__(self, blob: memoryview) -> None:
        self.blob = blob
        self.pos = 0

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.blob):
            raise CorruptBlobError("codec blob is truncated inside its header")
        out = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += size
        return out


def unpack(blob) -> tuple[Header, int]:
    """The header of ``blob`` and the offset where its payload starts; checks lengths and crc."""
    view = memoryview(blob).cast("B")
    if bytes(view[:4]) != MAGIC:
        raise CorruptBlobError("not a ray_checkfreq codec blob (bad magic)")
    r = _Reader(view)
    r.pos = 4
    version, flags, name_len = r.take("<BBB")
    if version not in READABLE_VERSIONS:
        raise CorruptBlobError(f"codec blob format version {version} is not supported "
                               f"(this build reads versions {READABLE_VERSIONS})")
    (name,) = r.take(f"<{name_len}s")
    (ndim,) = r.take("<B")
    shape = r.take(f"<{ndim}Q")
    precision, width = r.take("<BB")
    rotation = r.take("<B")[0] if version >= 3 else 0
    factor = r.take("<B")[0] if version >= 4 else NO_PRECISION
    if ((factor == NO_PRECISION and version == VERSION_FACTOR)
            or (factor != NO_PRECISION and version < VERSION_FACTOR)
            or (flags & FLAG_FACTOR_ROUNDED and factor == NO_PRECISION)):
        raise CorruptBlobError("codec blob header has an invalid precision_factor field")
    frame_elems, nframes = r.take("<QI")
    per_frame = 8 + (4 if flags & FLAG_DELTA else 0) + 5 * width
    if width == 0 or r.pos + nframes * per_frame + 4 > len(view):
        raise CorruptBlobError("codec blob is truncated inside its frame table")
    frames = []
    for _ in range(nframes):
        raw_crc, stored_crc = r.take("<II")
        base_crc = r.take("<I")[0] if flags & FLAG_DELTA else 0
        streams = tuple(r.take("<BI") for _ in range(width))
        frames.append(FrameEntry(raw_crc=raw_crc, stored_crc=stored_crc, base_crc=base_crc,
                                 streams=streams))
    (header_crc,) = r.take("<I")
    if zlib.crc32(view[:r.pos - 4]) != header_crc:
        raise CorruptBlobError("codec blob header checksum mismatch (corrupted header)")
    try:
        dtype = name.decode("ascii")
    except UnicodeDecodeError:
        raise CorruptBlobError("codec blob names an unreadable dtype") from None
    header = Header(flags=flags, dtype=dtype, shape=tuple(shape),
                    precision_bits=None if precision == NO_PRECISION else precision,
                    width=width, frame_elems=frame_elems, frames=tuple(frames),
                    rotation=rotation, version=version,
                    precision_factor_log2=None if factor == NO_PRECISION else factor)
    payload = sum(f.stored_len for f in frames)
    if r.pos + payload != len(view):
        raise CorruptBlobError(f"codec blob holds {len(view) - r.pos} payload bytes, its "
                               f"header describes {payload} (truncated or padded)")
    return header, r.pos
