"""Writing one part's data files: chunks packed in order into files of about a given
size, each chunk encoded (optionally as an XOR delta of the same chunk of a base), 64-byte
aligned, with its checksums per CRC block so a ranged read checks only what it reads.

Both placements write through here: a replicated save is one part whose chunks are whole
tensors (``CheckpointStore.save``), a sharded save one part per writer (``save_part``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.errors import CorruptCheckpointError
from ray_checkfreq.storage.arrays import leaf_spec
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.backends.direct import BLOCK, leaf_start
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.chunks import Box
from ray_checkfreq.storage.encoding import EncodeOptions, encode_leaf
from ray_checkfreq.storage.manifest import ChunkRecord, PartFile, part_file_name
from ray_checkfreq.storage.parallel import map_on_threads

ALIGN_BYTES = 64
_ZEROS = bytes(BLOCK)
BaseChunks = Mapping[tuple[str, Box, int], Any]  # (key, box, rank) -> the base's array


@dataclass(frozen=True, kw_only=True)
class ChunkSource:
    """One rank's piece of a tensor to save: ``data`` is the box at ``offsets`` of a
    tensor of ``global_shape`` (its sizes are ``data.shape``)."""

    key: str
    data: Any  # a torch.Tensor or numpy.ndarray (contiguous, on the CPU is cheapest)
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    rank: int
    raw_crc32: int | None = None  # the bytes' checksum where known (a slot's seal); kept as given

    @property
    def box(self) -> Box:
        return Box(tuple(self.offsets), tuple(self.data.shape))


@dataclass(frozen=True, kw_only=True)
class PartLayout:
    file_bytes: int  # data files of about this size
    crc_block_bytes: int
    threads: int


def write_part_files(backend: Backend, name: str, first_rank: int, token: str, chunks: Sequence[ChunkSource],
                     options: EncodeOptions, layout: PartLayout, written: list[str],
                     base: BaseChunks | None = None) -> tuple[tuple[PartFile, ...], tuple[ChunkRecord, ...]]:
    """Write the chunks into new data files of directory ``name``; each file's name goes
    into ``written`` before its write (a failed one may leave a partial file)."""
    groups = pack(chunks, layout.file_bytes)
    results = map_on_threads(
        lambda item: _write_file(backend, name, part_file_name(first_rank, token, item[0]), item[1], options,
                                 layout.crc_block_bytes, written, base),
        list(enumerate(groups)), layout.threads, "rcf-part")
    return tuple(f for f, _ in results), tuple(r for _, rs in results for r in rs)


def _write_file(backend: Backend, name: str, file: str, group: Sequence[ChunkSource], options: EncodeOptions,
                block: int, written: list[str], base: BaseChunks | None) -> tuple[PartFile, list[ChunkRecord]]:
    pieces: list[Any] = []
    records = []
    offset = 0
    for chunk in group:
        base_leaf = base.get((chunk.key, chunk.box, chunk.rank)) if base is not None else None
        encoded = encode_leaf(chunk.data, options, base_leaf, raw_crc=chunk.raw_crc32)
        stored = memoryview(encoded.data).cast("B")
        start = leaf_start(offset, stored.nbytes, ALIGN_BYTES)
        if start > offset:
            pieces.append(_ZEROS[:start - offset])
        spec = leaf_spec(chunk.data)
        records.append(ChunkRecord(
            key=chunk.key, kind=spec.kind, dtype=spec.dtype, global_shape=tuple(chunk.global_shape),
            box=chunk.box, rank=chunk.rank, codec=encoded.codec, file=file, offset=start,
            length=stored.nbytes, stored_crc32=encoded.stored_crc32, raw_crc32=encoded.raw_crc32,
            crc_block_bytes=block,
            block_crc32=tuple(crc32(stored[i:i + block]) for i in range(0, stored.nbytes, block)),
            delta=encoded.delta,
        ))
        pieces.append(stored)
        offset = start + stored.nbytes
    if offset % ALIGN_BYTES:
        pieces.append(_ZEROS[:-offset % ALIGN_BYTES])
        offset += -offset % ALIGN_BYTES
    written.append(file)
    backend.write(f"{name}/{file}", pieces)
    return PartFile(name=file, size_bytes=offset), records


def pack(chunks: Sequence[ChunkSource], file_bytes: int) -> list[list[ChunkSource]]:
    """Chunks in order, in groups of about ``file_bytes`` (one group at least)."""
    groups: list[list[ChunkSource]] = [[]]
    size = 0
    for chunk in chunks:
        nbytes = leaf_spec(chunk.data).nbytes
        if groups[-1] and size + nbytes > file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(chunk)
        size = leaf_start(size, nbytes, ALIGN_BYTES) + nbytes
    return groups


def check_padding(data: Any, file: PartFile, chunks: Sequence[ChunkRecord], where: str) -> None:
    """A data file holds what its writer wrote around its chunks: the length its part
    records, and zeros wherever no chunk is (the alignment padding); CorruptCheckpointError
    naming ``where`` if not. The chunks' own bytes are checked by their CRC blocks."""
    view = memoryview(data).cast("B")
    if len(view) != file.size_bytes:
        raise CorruptCheckpointError(where, f"{len(view)} bytes, its part records {file.size_bytes}")
    position = 0
    for chunk in sorted(chunks, key=lambda c: c.offset):
        _zeros(view, position, chunk.offset, where)
        position = chunk.offset + chunk.length
    _zeros(view, position, len(view), where)


def _zeros(view: memoryview, start: int, end: int, where: str) -> None:
    gap = bytes(view[start:end])
    if gap.count(0) != len(gap):
        raise CorruptCheckpointError(where, f"bytes {start}-{end} are alignment padding but not zeros")
