"""Encoding and decoding of one independent frame (a run of whole elements)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from ray_checkfreq.codec import huffman, nearlossless, zstdparams
from ray_checkfreq.codec.blob import (
    METHOD_FILL,
    METHOD_HUF,
    METHOD_NAMES,
    METHOD_RAW,
    METHOD_ZSTD,
    VERSION,
    VERSION_HUF,
    FrameEntry,
)
from ray_checkfreq.codec.dtypes import DtypeInfo
from ray_checkfreq.codec.errors import BaseMismatchError, CorruptBlobError
from ray_checkfreq.codec.grouping import scratch
from ray_checkfreq.codec.layout import E8, SINGLE, Layout, crc32

RAW_BELOW_SHIFT = 12  # zstd must save more than 1/2**12 of a stream
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True, kw_only=True)
class FramePlan:
    """What every frame of one blob shares."""

    info: DtypeInfo
    layout: Layout
    frame_bytes: int
    nbytes: int
    level: int | None  # None: tuned per stream role
    precision_bits: int | None

    @property
    def width(self) -> int:
        """Streams per frame."""
        return self.layout.nstreams

    @property
    def nframes(self) -> int:
        return -(-self.nbytes // self.frame_bytes)

    def bounds(self, i: int) -> tuple[int, int]:
        lo = i * self.frame_bytes
        return lo, min(lo + self.frame_bytes, self.nbytes)

    def stream_key(self, j: int) -> object:
        if self.level is not None:
            return self.level
        if self.layout.kind == SINGLE:
            return zstdparams.SMALL_LEVEL if self.nframes == 1 else zstdparams.OTHER_LEVEL
        return "exp" if self.layout.holds_exponent(j) else zstdparams.OTHER_LEVEL

    def huffman_coded(self, j: int, nbytes: int) -> bool:
        """Whether stream ``j`` is offered to the Huffman coder (huffman.py) first."""
        return (self.level is None and self.layout.kind == E8 and j == 0
                and nbytes >= huffman.MIN_BYTES and huffman.available())

    def may_fill(self, j: int, nbytes: int) -> bool:
        """Whether stream ``j`` may be stored as a fill: stream K of the frames whose
        stream T is offered to the Huffman coder (K holds a byte per 4 elements)."""
        return j == 1 and self.huffman_coded(0, 4 * (nbytes - 1))


def _xor(a: np.ndarray, b: np.ndarray, unit: int) -> np.ndarray:
    utype = _UNSIGNED[unit]
    return np.bitwise_xor(a.view(utype), b.view(utype)).view(np.uint8)


def encode_frame(plan: FramePlan, src: np.ndarray, base: np.ndarray | None,
                 i: int) -> tuple[FrameEntry, list]:
    lo, hi = plan.bounds(i)
    data = src[lo:hi]
    if plan.precision_bits is not None:
        data = nearlossless.round_frame(data, plan.info, plan.precision_bits)
    base_crc = 0
    if base is not None:
        base_crc = crc32(base[lo:hi].data)
        data = _xor(data, base[lo:hi], plan.info.unit_bytes)
    streams = plan.layout.split(data)
    stored, table, crc, raw_crc = [], [], 0, 0
    for j, stream in enumerate(streams):
        item, method = _pack_stream(plan, j, stream)
        if method != METHOD_ZSTD:
            # zstd's checksum covers its streams; the others need the frame's own.
            raw_crc = crc32(item, raw_crc)
        crc = crc32(item, crc)
        stored.append(item)
        table.append((method, len(memoryview(item).cast("B"))))
    entry = FrameEntry(raw_crc=raw_crc, stored_crc=crc, base_crc=base_crc, streams=tuple(table))
    return entry, stored


def _fill_of(stream: Any) -> bytes | None:
    """The 2 stored bytes of ``stream`` as a fill (a byte, then one byte repeated), or None."""
    values = np.asarray(stream)
    if values.size < 64 or not (values[1:] == values[1]).all():
        return None
    return bytes(values[:2])


def _pack_stream(plan: FramePlan, j: int, stream: Any) -> tuple[Any, int]:
    """(stored bytes, method) of stream ``j`` of a frame."""
    packed = None
    # Stream K (two exponent bits per element) is one value for most frames: as a fill it
    # is rebuilt by a memset, where its zstd frame cost a decompression call and XXH64.
    if plan.may_fill(j, stream.nbytes):
        fill = _fill_of(stream)
        if fill is not None:
            return fill, METHOD_FILL
    if plan.huffman_coded(j, stream.nbytes):
        packed = huffman.encode(stream)
    method = METHOD_ZSTD if packed is None else METHOD_HUF
    if packed is None:
        packed = zstdparams.compressor(plan.stream_key(j)).compress(stream)
    # A stream that its coder shrinks by less than 1/4096 is stored raw: decoding reads it
    # in place, checked by one crc32 pass (carry-less multiply), where its zstd frame
    # (stored blocks) cost a copy plus XXH64; measured 7-10 % faster whole-tensor
    # decode on MiniLM, and the blob no larger.
    if len(packed) < stream.nbytes - (stream.nbytes >> RAW_BELOW_SHIFT):
        return packed, method
    # A copy: split() may return views of memory that the next frame reuses.
    return bytes(stream), METHOD_RAW


def check_stream_sizes(plan: FramePlan, frames: tuple[FrameEntry, ...], payload: memoryview, start: int,
                       version: int) -> None:
    """Before any output is allocated: every stream of every frame must be able to hold
    exactly the bytes its frame needs (a raw stream is that long, a zstd stream's header
    declares that size, a Huffman stream codes at least one bit per byte, a fill is 2
    bytes). A header forged to declare more than its streams hold is refused here."""
    pos = start
    for i, entry in enumerate(frames):
        lo, hi = plan.bounds(i)
        for (method, n), need in zip(entry.streams, plan.layout.stream_lengths(hi - lo), strict=True):
            if method not in (METHOD_RAW, METHOD_ZSTD) and version < VERSION_HUF:
                raise CorruptBlobError(f"codec blob frame {i} has an invalid stream entry")
            if not _can_hold(method, payload[pos:pos + n], need, version):
                raise CorruptBlobError(f"codec blob frame {i}: a {METHOD_NAMES.get(method, '?')} stream of "
                                       f"{n} stored bytes cannot hold the {need} bytes its header declares")
            pos += n


def _can_hold(method: int, chunk: memoryview, need: int, version: int) -> bool:
    if method == METHOD_RAW:
        return len(chunk) == need
    if method == METHOD_ZSTD:
        try:
            return bool(zstandard.get_frame_parameters(chunk).content_size == need)
        except zstandard.ZstdError:
            return False
    if version >= VERSION_HUF and method == METHOD_FILL:
        return len(chunk) == 2
    if version >= VERSION_HUF and method == METHOD_HUF:
        return need <= 8 * (len(chunk) - huffman.HEADER_BYTES)
    return False


def decode_frame(plan: FramePlan, entry: FrameEntry, payload: memoryview, offset: int,
                 out: np.ndarray, base: np.ndarray | None, i: int, version: int = VERSION) -> None:
    """Decode frame ``i`` (stored at ``payload[offset:]``) into ``out``; verify it.

    Format versions 2 to 5: zstd checks each compressed stream's content checksum while it
    decompresses, and the streams stored raw (version 5: or Huffman-coded, or as a fill)
    are checked against ``raw_crc`` here, so no pass over the decoded frame is needed.
    Version 1: ``raw_crc`` covers the decoded frame. The stored crc is left to verify():
    the content checks already reject any damage.
    """
    lo, hi = plan.bounds(i)
    if base is not None and crc32(base[lo:hi].data) != entry.base_crc:
        raise BaseMismatchError(
            "decode was given a different base than the one this delta blob was encoded "
            f"against (base checksum mismatch in frame {i}); pass the exact tensor that "
            "was given as base= to encode")
    stored = payload[offset:offset + entry.stored_len]
    target = out[lo:hi]
    lengths = plan.layout.stream_lengths(hi - lo)
    streams: list[Any] = []
    ends: list[int] = []
    pos = 0
    for _, n in entry.streams:
        streams.append(stored[pos:pos + n])
        pos += n
        ends.append(pos)
    # Huffman streams are decoded first, prefetching the rest of the frame meanwhile (the
    # checksum pass then reads it from cache); the decoder is safe on damaged input, and
    # damage is reported by the checksum check below before any error of the decoder.
    malformed: CorruptBlobError | None = None
    raw_crc = 0
    unchecked = 0  # start of the stored bytes not yet in raw_crc: runs of streams that
    # raw_crc covers are contiguous, and one crc32 call per run costs less than several
    for j, ((method, n), stream_len) in enumerate(zip(entry.streams, lengths, strict=True)):
        chunk: Any = streams[j]
        if method == METHOD_ZSTD:
            # One-shot decompression writes straight into a new bytes object, which the
            # allocator reuses frame after frame; a stream reader's readinto() would copy
            # every stream once more through zstd's window buffer (measured slower).
            streams[j] = _decompress(chunk, stream_len, i, version)
            if version >= 2:
                raw_crc = crc32(stored[unchecked:ends[j] - n], raw_crc)
            unchecked = ends[j]
            continue
        if version >= VERSION_HUF and method == METHOD_HUF:
            decoded = scratch(f"huf{j}", stream_len)[:stream_len]
            try:
                huffman.decode_into(chunk, decoded, i, ahead=stored[ends[j]:])
            except CorruptBlobError as exc:
                malformed = exc
            streams[j] = decoded
        elif version >= VERSION_HUF and method == METHOD_FILL and n == 2:
            filled = scratch(f"fill{j}", stream_len)[:stream_len]
            filled.fill(chunk[1])
            filled[:1] = chunk[0]
            streams[j] = filled
        elif method != METHOD_RAW or n != stream_len:
            raise CorruptBlobError(f"codec blob frame {i} has an invalid stream entry")
    if version >= 2:
        raw_crc = crc32(stored[unchecked:], raw_crc)
    if version >= 2 and raw_crc != entry.raw_crc:
        raise CorruptBlobError(f"codec blob frame {i} is corrupted (checksum mismatch in a "
                               "stream stored raw or Huffman-coded)")
    if malformed is not None:
        raise malformed
    plan.layout.merge(streams, target)
    if base is not None:
        utype = _UNSIGNED[plan.info.unit_bytes]
        np.bitwise_xor(target.view(utype), base[lo:hi].view(utype), out=target.view(utype))
    if version < 2 and crc32(target.data) != entry.raw_crc:
        raise CorruptBlobError(f"codec blob frame {i} decoded to wrong bytes "
                               "(content checksum mismatch)")


def _decompress(chunk: memoryview, expected: int, i: int, version: int) -> bytes:
    try:
        params = zstandard.get_frame_parameters(chunk)
        if params.content_size != expected:
            raise CorruptBlobError(f"codec blob frame {i} has a stream of the wrong size")
        if version >= 2 and not params.has_checksum:
            raise CorruptBlobError(f"codec blob frame {i} has a stream without checksum")
        # allow_extra_data=False: a damaged header must not hide the trailing checksum.
        data = zstdparams.decompressor().decompress(chunk, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptBlobError(f"codec blob frame {i} does not decompress: {exc}") from None
    if len(data) != expected:
        raise CorruptBlobError(f"codec blob frame {i} has a stream of the wrong size")
    return data
