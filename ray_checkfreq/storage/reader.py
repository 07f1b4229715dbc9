"""Reading boxes of sharded tensors from a committed checkpoint with ranged reads.

For each target box the overlap planner (``chunks.plan_copies``) names the saved chunks
it overlaps; only those are read. A ``raw`` chunk is read over the byte span of the
overlap (``chunks.byte_span``: exactly the overlap when it differs from the chunk in the
leading dimension only), widened to the chunk's CRC blocks (``crc_block_bytes``) so every
block read is checked against its CRC32 before a byte of it is used. An ``rcfz`` chunk is
read and decoded whole (its frames are not addressable from outside the codec), checked
by the codec and against ``raw_crc32``; it is decoded once per ``load_boxes`` call. A
delta chunk (format 4) is decoded against the same chunk (key, box, rank) of its part's
delta base, a full chunk of another committed directory, read the same way.
A target element no saved chunk covers is an error, never left uninitialised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ray_checkfreq.errors import CorruptCheckpointError
from ray_checkfreq.storage.arrays import LeafSpec, leaf_bytes, leaf_from_buffer
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.chunks import Box, ChunkLayoutError, CopyStep, byte_span, fill, plan_copies, span_view
from ray_checkfreq.storage.encoding import LeafDecodeError, decode_leaf
from ray_checkfreq.storage.manifest import (
    ChunkRecord,
    GlobalManifest,
    ManifestError,
    PartEntry,
    PartManifest,
    TensorIndex,
    decode_part,
    replicated_skeleton,
)
from ray_checkfreq.storage.parallel import map_on_threads


class BoxReader:
    """Reads target boxes of one checkpoint directory (``dir_name``) described by ``manifest``."""

    def __init__(self, backend: Backend, dir_name: str, manifest: GlobalManifest, *,
                 codec_threads: int | None = None,
                 base_manifest: Callable[[str], GlobalManifest] | None = None, verify: bool = False) -> None:
        self.backend = backend
        self.dir_name = dir_name
        self.manifest = manifest
        self.codec_threads = codec_threads
        self.verify = verify  # check every stored byte, even those the codec checks itself
        self._files: dict[str, np.ndarray] = {}  # data files read whole (read_whole_chunks)
        self._base_manifest = base_manifest  # a delta base's global manifest, by directory name
        self._bases: dict[str, BoxReader] = {}
        self._decoded: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
        self.bytes_read = 0

    def load_boxes(self, wanted: Mapping[str, Sequence[Box]], *,
                   into: Mapping[str, np.ndarray] | None = None) -> dict[str, list[Any]]:
        """``{key: [box, ...]}`` -> ``{key: [tensor or ndarray of that box, ...]}`` (stored dtype).

        ``into``: where to put a key's single box instead of new memory (a writable C-order
        uint8 array of the box's sizes + (item size,): say a restore target's own bytes);
        what is returned for it is a view of that memory."""
        out: dict[str, list[Any]] = {}
        for key, boxes in wanted.items():
            tensor = self.manifest.tensor(key)
            if tensor is None:
                raise KeyError(f"{self.backend.uri(self.dir_name)}: no tensor {key!r} in this checkpoint")
            destination = (into or {}).get(key)
            out[key] = [self._load_box(tensor, box, destination if len(boxes) == 1 else None) for box in boxes]
        self._decoded.clear()
        self._bases.clear()
        return out

    def _load_box(self, tensor: TensorIndex, target: Box, destination: np.ndarray | None = None) -> Any:
        if not target.fits(tensor.global_shape):
            raise ValueError(f"tensor {tensor.key!r}: box at {target.offsets} of sizes {target.sizes} lies outside "
                             f"its global shape {tensor.global_shape}")
        spec = LeafSpec(kind=tensor.kind, dtype=tensor.dtype, shape=target.sizes)
        shape = target.sizes + (spec.itemsize,)
        if destination is not None and (destination.shape != shape or destination.dtype != np.uint8
                                        or not destination.flags.c_contiguous or not destination.flags.writeable):
            raise ValueError(f"tensor {tensor.key!r}: a destination of {destination.shape} {destination.dtype} "
                             f"for a box of {shape} bytes")
        out = np.empty(shape, np.uint8) if destination is None else destination
        steps = plan_copies([c.box for c in tensor.chunks], target)
        try:
            copied = fill(out, steps, lambda step: self._source(tensor, step, spec.itemsize))
        except ChunkLayoutError as err:
            raise CorruptCheckpointError(self._manifest_uri(), f"tensor {tensor.key!r}: {err}") from None
        if copied != target.volume:
            raise CorruptCheckpointError(self._manifest_uri(), f"tensor {tensor.key!r}: saved chunks cover {copied} "
                                         f"of the {target.volume} elements of box {target.offsets}+{target.sizes}")
        return leaf_from_buffer(spec, out.reshape(-1), 0)

    def _source(self, tensor: TensorIndex, step: CopyStep, itemsize: int) -> np.ndarray:
        chunk = tensor.chunks[step.source]
        if chunk.codec == "raw":
            start, stop = byte_span(chunk.box.sizes, step.source_box, itemsize)
            span = self._read_checked(chunk, start, stop)
            return span_view(span, chunk.box.sizes, step.source_box, itemsize)
        return self._decode_whole(chunk)[step.source_box.slices()]

    def _decode_whole(self, chunk: ChunkRecord) -> np.ndarray:
        cache_key = (chunk.key, chunk.box.offsets)
        if cache_key not in self._decoded:
            leaf = self.decoded_leaf(chunk)
            raw = np.frombuffer(leaf_bytes(leaf), np.uint8)
            self._decoded[cache_key] = raw.reshape(chunk.box.sizes + (chunk.spec.itemsize,))
        return self._decoded[cache_key]

    def read_whole_chunks(self, chunks: Sequence[ChunkRecord], threads: int) -> list[Any]:
        """Each chunk whole, in order: every data file they lie in read once, files in
        parallel, each file's chunks decoded in its thread."""
        by_file: dict[str, list[int]] = {}
        for index, chunk in enumerate(chunks):
            by_file.setdefault(chunk.file, []).append(index)
        sizes = {f.name: f.size_bytes for p in self.manifest.parts for f in p.files}
        out: list[Any] = [None] * len(chunks)

        def read_file(item: tuple[str, list[int]]) -> None:
            file, indices = item
            location = self.backend.uri(f"{self.dir_name}/{file}")
            try:
                data = np.frombuffer(self.backend.read(f"{self.dir_name}/{file}"), np.uint8)
            except FileNotFoundError:
                raise CorruptCheckpointError(location, "data file is missing") from None
            if data.size != sizes.get(file):
                raise CorruptCheckpointError(location, f"{data.size} bytes where the manifest says "
                                             f"{sizes.get(file)} (truncated?)")
            self._files[file] = data
            for index in indices:
                out[index] = self.decoded_leaf(chunks[index])
            del self._files[file]

        map_on_threads(read_file, list(by_file.items()), threads, "rcf-read")
        return out

    def decoded_leaf(self, chunk: ChunkRecord) -> Any:
        """The chunk whole (a tensor or ndarray of its box), every byte checked."""
        base = self._base_leaf(chunk) if chunk.delta else None
        stored = self._read_checked(chunk, 0, chunk.length)
        try:
            return decode_leaf(chunk.spec, chunk.codec, stored, 0, chunk.length, chunk.raw_crc32, base=base,
                               threads=self.codec_threads)
        except LeafDecodeError as err:
            raise CorruptCheckpointError(self._file_uri(chunk), f"tensor {chunk.key!r}: {err}") from None

    def skeletons(self, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """The non-tensor state of ``ranks`` (all when None), each part checked against the
        size and CRC32 the global manifest records for it."""
        wanted = set(range(self.manifest.world_size)) if ranks is None else set(ranks)
        out: dict[int, Any] = {}
        for entry in self.manifest.parts:
            if wanted & set(entry.ranks):
                part = self._part(entry)
                out.update({r: part.skeletons[r] for r in part.ranks if r in wanted})
        unknown = wanted - set(out)
        if unknown:
            raise KeyError(f"{self.backend.uri(self.dir_name)}: ranks {sorted(unknown)} are not in a world of "
                           f"{self.manifest.world_size}")
        return out

    def whole_state(self) -> tuple[Any, list[str], list[ChunkRecord]]:
        """The state skeleton, leaf keys and whole chunks of a replicated checkpoint, its one
        part checked against what the global manifest records (``replicated_skeleton``)."""
        (entry,) = self.manifest.parts
        try:
            skeleton, keys = replicated_skeleton(self._part(entry), self.manifest)
        except ManifestError as err:
            raise CorruptCheckpointError(self.backend.uri(f"{self.dir_name}/{entry.name}"), str(err)) from None
        return skeleton, keys, [self.manifest.tensor(key).chunks[0] for key in keys]  # type: ignore[union-attr]

    def _part(self, entry: PartEntry) -> PartManifest:
        path = f"{self.dir_name}/{entry.name}"
        try:
            data = self.backend.read_small(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(self.backend.uri(path), "part manifest is missing") from None
        if len(data) != entry.size_bytes or crc32(data) != entry.crc32:
            raise CorruptCheckpointError(self.backend.uri(path), "part manifest differs from what the global "
                                         "manifest records")
        try:
            return decode_part(data, name=entry.name)
        except ManifestError as err:
            raise CorruptCheckpointError(self.backend.uri(path), str(err)) from None

    def _base_leaf(self, chunk: ChunkRecord) -> Any:
        """The full chunk a delta chunk refers to: same key, box and rank, in its part's base."""
        name = self.manifest.delta_base_of(chunk)
        where = f"tensor {chunk.key!r} (chunk at {list(chunk.box.offsets)})"
        if name is None or self._base_manifest is None:
            raise CorruptCheckpointError(self._manifest_uri(), f"{where}: a delta with no base to read")
        try:
            base = self._bases.get(name)
            if base is None:
                base = BoxReader(self.backend, name, self._base_manifest(name), codec_threads=self.codec_threads)
                self._bases[name] = base
            tensor = base.manifest.tensor(chunk.key)
            match = [c for c in tensor.chunks if (c.box, c.rank) == (chunk.box, chunk.rank)] if tensor else []
            if not match or match[0].delta or (match[0].kind, match[0].dtype) != (chunk.kind, chunk.dtype):
                raise CorruptCheckpointError(base._manifest_uri(), f"no full chunk for {where} of this delta")
            return base.decoded_leaf(match[0])
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(self._manifest_uri(), f"{where}: its delta base is unusable ({name}): "
                                         f"{err}") from None

    def _read_checked(self, chunk: ChunkRecord, start: int, stop: int) -> np.ndarray:
        """Bytes [start, stop) of the chunk's stored bytes, every CRC block they touch checked."""
        if stop <= start:
            return np.empty(0, np.uint8)
        block = chunk.crc_block_bytes
        first, last = start // block, -(-stop // block)
        low, high = first * block, min(last * block, chunk.length)
        location = self._file_uri(chunk)
        data = self._stored_bytes(chunk, low, high)
        if data.size != high - low:
            raise CorruptCheckpointError(location, f"tensor {chunk.key!r}: {data.size} bytes where {high - low} "
                                         "were expected (truncated?)")
        whole = low == 0 and high == chunk.length
        # A whole chunk takes one pass: the stored checksum of a raw chunk (the blocks are
        # checked only to name the damaged one); a codec blob checks its own frames and then
        # raw_crc32 as it is decoded.
        if whole and not self.verify and (chunk.codec != "raw" or crc32(data.data) == chunk.stored_crc32):
            return data[start:stop]
        for index in range(first, last):
            piece = data[index * block - low:min((index + 1) * block, chunk.length) - low]
            if crc32(piece.data) != chunk.block_crc32[index]:
                raise CorruptCheckpointError(location, f"checksum mismatch in tensor {chunk.key!r} "
                                             f"(chunk at {list(chunk.box.offsets)}, block {index})")
        if low == 0 and high == chunk.length and crc32(data.data) != chunk.stored_crc32:
            raise CorruptCheckpointError(location, f"checksum mismatch in tensor {chunk.key!r}")
        return data[start - low:stop - low]

    def _stored_bytes(self, chunk: ChunkRecord, low: int, high: int) -> np.ndarray:
        whole_file = self._files.get(chunk.file)
        if whole_file is not None:
            return whole_file[chunk.offset + low:chunk.offset + high]
        try:
            data = np.asarray(self.backend.read_range(f"{self.dir_name}/{chunk.file}", chunk.offset + low, high - low),
                              dtype=np.uint8).reshape(-1)
        except FileNotFoundError:
            raise CorruptCheckpointError(self._file_uri(chunk), "data file is missing") from None
        self.bytes_read += data.size
        return data

    def _file_uri(self, chunk: ChunkRecord) -> str:
        return self.backend.uri(f"{self.dir_name}/{chunk.file}")

    def _manifest_uri(self) -> str:
        return self.backend.uri(f"{self.dir_name}/manifest.json")


def full_box(tensor: TensorIndex) -> Box:
    return Box((0,) * len(tensor.global_shape), tensor.global_shape)


__all__ = ["BoxReader", "full_box"]
