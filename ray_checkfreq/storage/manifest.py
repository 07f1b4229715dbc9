"""Manifests of sharded checkpoints (format version 4; 3 is read): a *part* per writer, one *global* one.

Pure logic, no I/O. A sharded checkpoint directory holds, per writer (a node agent), data
files ``part-r<first rank>-<n>.bin`` and then ``part-r<first rank>.json``: the part
manifest, listing the ranks it covers, each owned chunk (a box of a global tensor, see
``chunks``) with its bytes' place and checksums, and each covered rank's non-tensor
skeleton (JSON). The checkpoint is committed by ``manifest.json``, the global manifest:
every part with its JSON's size and CRC32 and its data files' sizes, and the merged chunk
index, so a restoring rank reads one JSON. The conventions of ``manifest.py`` hold: one
bounded parser (``stored_json``), a ``manifest_crc32`` over the canonical form, bytes
equal to their own re-encoding, every field checked before any data file is touched, and
a bad file refused with the reason (the caller names the file). Nothing is unpickled.

A part is refused unless its name matches its first rank and every data file it lists
carries that rank; a global manifest unless its parts cover ranks ``0..world_size-1``
exactly once and each tensor's chunks cover the tensor exactly once (``check_tiling``).

Format 4 adds XOR deltas: a chunk marked ``delta`` is an ``rcfz`` blob of its bytes XOR
the same chunk (same key, box and rank) of the full checkpoint its part names as
``delta_base``. A part with no delta chunk has no base; a base is never itself a delta
(the reader refuses one). Format 3 is format 4 without deltas.
"""

from __future__ import annotations

import functools
import json
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_checkfreq.codec import MAX_EXPANSION
from ray_checkfreq.codec.nearlossless import MAX_FACTOR_LOG2
from ray_checkfreq.storage.arrays import LeafSpec, numpy_dtype, torch_dtype
from ray_checkfreq.storage.canonical_json import dumps_indented
from ray_checkfreq.storage.chunks import Box, ChunkLayoutError, check_tiling, whole
from ray_checkfreq.storage.names import CHECKPOINT_DIR, MAX_GENERATION, MAX_STEP, parse_checkpoint_dir
from ray_checkfreq.storage.stored_json import StoredJsonError, is_int, parse_stored_json
from ray_checkfreq.storage.tree import SkeletonError, skeleton_leaf_refs

FORMAT_NAME = "ray_checkfreq.checkpoint"
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "crc32"
LEAF_TAGS = {"torch": ("tensor",), "numpy": ("ndarray", "npscalar")}
# Limits a manifest must keep (docs/format.md); past them it is corrupt. Every size and
# offset is a Python int, so nothing overflows while they are checked.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_SIZE_BYTES = 1 << 50  # a data file, a chunk's stored length or its decoded size
MAX_NDIM = 64
MAX_INT_FIELD = (1 << 64) - 1
MAX_CRC32 = (1 << 32) - 1
# "raw": the leaf's bytes as they are; "rcfz": a ray_checkfreq.codec blob (self-describing).
CODECS = frozenset({"raw", "rcfz"})


class ManifestError(ValueError):
    """The manifest is malformed; the message says what is wrong."""


def body_checksum(body: dict) -> int:
    """The ``manifest_crc32`` of a manifest body: CRC32 of its canonical JSON without it."""
    unsigned = {k: v for k, v in body.items() if k != "manifest_crc32"}
    canonical = json.dumps(unsigned, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return zlib.crc32(canonical.encode("utf-8"))


def parse_history_trim(value: Any) -> dict:
    """A history copy's ``history_trim`` record, checked; raises ManifestError."""
    if not isinstance(value, dict) or not isinstance(value.get("source"), str) \
            or not CHECKPOINT_DIR.match(value["source"]):
        raise ManifestError(f"history_trim {value!r:.200}: expected an object naming its source checkpoint")
    factor, bits = value.get("precision_factor"), value.get("precision_bits")
    if (factor is None) == (bits is None):
        raise ManifestError(f"history_trim {value!r:.200}: expected precision_factor or precision_bits")
    # Range first, then the power of two: nothing is computed from an unchecked number.
    if factor is not None and not (is_int(factor) and 1 <= factor.bit_length() <= MAX_FACTOR_LOG2 + 1
                                   and factor & (factor - 1) == 0):
        raise ManifestError(f"history_trim precision_factor {factor!r:.60}: not a power of two "
                            f"from 1 to 2**{MAX_FACTOR_LOG2}")
    if bits is not None and not (is_int(bits) and 0 <= bits <= 64):
        raise ManifestError(f"history_trim precision_bits {bits!r:.60}: not an int from 0 to 64")
    return value



FORMAT_VERSION_SHARDED = 4
READABLE_SHARDED_VERSIONS = (3, FORMAT_VERSION_SHARDED)
KIND_PART = "part"
KIND_SHARDED = "sharded"
MAX_WORLD_SIZE = 1 << 20
MAX_KEY_CHARS = 1 << 16
# "replicated": one part whose rank-0 skeleton is the whole state (``CheckpointStore.save``):
# ``{"state": skeleton, "keys": [tensor key of leaf i, ...]}``; "sharded": a skeleton per
# rank, the engine's (FSDP2 / HSDP). Format 3 checkpoints are all "sharded".
PLACEMENTS = ("replicated", "sharded")
MIN_CRC_BLOCK = 4096
MAX_CRC_BLOCK = 1 << 30
PART_MANIFEST = re.compile(r"^part-r(?P<rank>[0-9]{5,7})\.json$")
# The token (8 hex, random per save_part) keeps two writers that claim the same ranks
# (a protocol fault) from overwriting each other's data files on storage without O_EXCL.
PART_FILE = re.compile(r"^part-r(?P<rank>[0-9]{5,7})-(?P<token>[0-9a-f]{8})-(?P<index>[0-9]{5})\.bin$")


def part_manifest_name(first_rank: int) -> str:
    return f"part-r{first_rank:05d}.json"


def part_file_name(first_rank: int, token: str, index: int) -> str:
    return f"part-r{first_rank:05d}-{token}-{index:05d}.bin"


@dataclass(frozen=True)
class ChunkRecord:
    """One stored chunk: a box of tensor ``key`` and where its bytes are."""

    key: str
    kind: str  # "torch" or "numpy", as a LeafSpec's
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    rank: int  # the rank whose piece it is
    codec: str
    file: str
    offset: int
    length: int
    stored_crc32: int  # of the stored bytes (the codec blob, or the raw bytes)
    raw_crc32: int  # of the chunk's raw bytes (a slot's seal)
    crc_block_bytes: int  # the stored bytes' CRC32 per block of this many bytes ...
    block_crc32: tuple[int, ...]  # ... so a ranged read checks only the blocks it reads
    delta: bool = False  # an XOR delta against the same chunk of its part's delta base

    @property
    def spec(self) -> LeafSpec:
        return LeafSpec(kind=self.kind, dtype=self.dtype, shape=self.box.sizes)


@dataclass(frozen=True)
class CheckpointAttributes:
    """What a checkpoint is, beside its data: the same in every part and in the global manifest."""

    placement: str = "sharded"
    meta: Mapping[str, Any] = field(default_factory=dict)  # the user's JSON (``save(meta=)``)
    # A near-lossless history copy (storage/history.py): {"source": the directory it was
    # made from, "precision_factor" or "precision_bits": the setting}; None: exact.
    history_trim: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PartFile:
    name: str
    size_bytes: int


@dataclass(frozen=True)
class PartManifest:
    step: int
    writer_generation: int
    world_size: int
    ranks: tuple[int, ...]
    epoch_boundary: bool
    created_unix_ns: int
    files: tuple[PartFile, ...]
    chunks: tuple[ChunkRecord, ...]
    skeletons: Mapping[int, Any] = field(default_factory=dict)  # rank -> JSON
    delta_base: str | None = None  # the checkpoint directory its delta chunks refer to
    attributes: CheckpointAttributes = field(default_factory=lambda: CheckpointAttributes())

    @property
    def name(self) -> str:
        return part_manifest_name(self.ranks[0])


@dataclass(frozen=True)
class PartEntry:
    """A part as the global manifest records it."""

    name: str
    ranks: tuple[int, ...]
    size_bytes: int  # of the part manifest
    crc32: int  # of the part manifest's bytes
    files: tuple[PartFile, ...]
    delta_base: str | None = None


@dataclass(frozen=True)
class TensorIndex:
    key: str
    kind: str
    dtype: str
    global_shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]


@dataclass(frozen=True)
class GlobalManifest:
    step: int
    writer_generation: int
    world_size: int
    epoch_boundary: bool
    created_unix_ns: int
    parts: tuple[PartEntry, ...]
    tensors: tuple[TensorIndex, ...]
    attributes: CheckpointAttributes = field(default_factory=lambda: CheckpointAttributes())
    format_version: int = FORMAT_VERSION_SHARDED  # as read (3: written before deltas)

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.attributes.meta

    @property
    def history_trim(self) -> Mapping[str, Any] | None:
        return self.attributes.history_trim

    def expected_files(self) -> dict[str, int]:
        """Every file of the checkpoint (part manifests and data files) with its size."""
        expected = {p.name: p.size_bytes for p in self.parts}
        expected.update((f.name, f.size_bytes) for p in self.parts for f in p.files)
        return expected

    @property
    def size_bytes(self) -> int:
        return sum(p.size_bytes + sum(f.size_bytes for f in p.files) for p in self.parts)

    def tensor(self, key: str) -> TensorIndex | None:
        return self._by_key.get(key)

    def delta_base_of(self, chunk: ChunkRecord) -> str | None:
        """The directory a delta chunk refers to (its part's base); None for a full chunk."""
        return self._base_by_file.get(chunk.file) if chunk.delta else None

    @property
    def delta_bases(self) -> frozenset[str]:
        return frozenset(p.delta_base for p in self.parts if p.delta_base is not None)

    @functools.cached_property
    def _base_by_file(self) -> dict[str, str | None]:
        return {f.name: p.delta_base for p in self.parts for f in p.files}

    @functools.cached_property
    def _by_key(self) -> dict[str, TensorIndex]:
        """Keys are unique (checked when a manifest is built or decoded): one dict, not a scan per lookup."""
        return {t.key: t for t in self.tensors}


# ------------------------------------------------------------------ encoding
def encode_part(part: PartManifest) -> bytes:
    body = _header(KIND_PART, part.step, part.writer_generation, part.world_size, part.epoch_boundary,
                   part.created_unix_ns)
    body["ranks"] = list(part.ranks)
    body["files"] = [_file_json(f) for f in part.files]
    body["chunks"] = [dict(key=c.key, kind=c.kind, dtype=c.dtype, global_shape=list(c.global_shape),
                           **_chunk_place_json(c)) for c in part.chunks]
    body["skeletons"] = {str(rank): part.skeletons[rank] for rank in part.ranks}
    body["delta_base"] = part.delta_base
    _put_attributes(body, part.attributes)
    return _signed(body)


def encode_global(manifest: GlobalManifest) -> bytes:
    body = _header(KIND_SHARDED, manifest.step, manifest.writer_generation, manifest.world_size,
                   manifest.epoch_boundary, manifest.created_unix_ns)
    body["parts"] = [{"name": p.name, "ranks": list(p.ranks), "size_bytes": p.size_bytes, "crc32": p.crc32,
                      "files": [_file_json(f) for f in p.files], "delta_base": p.delta_base}
                     for p in manifest.parts]
    body["tensors"] = [{"key": t.key, "kind": t.kind, "dtype": t.dtype, "global_shape": list(t.global_shape),
                        "chunks": [_chunk_place_json(c) for c in t.chunks]} for t in manifest.tensors]
    _put_attributes(body, manifest.attributes)
    return _signed(body)


def _put_attributes(body: dict, attributes: CheckpointAttributes) -> None:
    body["placement"] = attributes.placement
    body["meta"] = dict(attributes.meta)
    body["history_trim"] = None if attributes.history_trim is None else dict(attributes.history_trim)


def merge_parts(step: int, writer_generation: int, world_size: int, created_unix_ns: int,
                parts: Sequence[tuple[PartManifest, int, int]]) -> GlobalManifest:
    """The global manifest of ``parts`` (each with its JSON's size and CRC32), checked as a
    reader checks it: raises ManifestError when the parts do not make one checkpoint."""
    ordered = sorted(parts, key=lambda item: item[0].ranks[0])
    for part, _, _ in ordered:
        if (part.step, part.writer_generation, part.world_size) != (step, writer_generation, world_size):
            raise ManifestError(f"{part.name}: step {part.step}, generation {part.writer_generation}, world size "
                                f"{part.world_size} where the checkpoint has {step}, {writer_generation}, {world_size}")
    entries = tuple(PartEntry(name=p.name, ranks=p.ranks, size_bytes=size, crc32=crc, files=p.files,
                              delta_base=p.delta_base) for p, size, crc in ordered)
    by_key: dict[str, list[ChunkRecord]] = {}
    for part, _, _ in ordered:
        for chunk in part.chunks:
            by_key.setdefault(chunk.key, []).append(chunk)
    tensors = tuple(TensorIndex(key=key, kind=chunks[0].kind, dtype=chunks[0].dtype,
                                global_shape=chunks[0].global_shape,
                                chunks=tuple(sorted(chunks, key=lambda c: c.box.offsets)))
                    for key, chunks in sorted(by_key.items()))
    epochs = {p.epoch_boundary for p, _, _ in ordered}
    if len(epochs) > 1:
        raise ManifestError("parts disagree on whether the step is an epoch boundary")
    attributes = ordered[0][0].attributes if ordered else CheckpointAttributes()
    if any(p.attributes != attributes for p, _, _ in ordered):
        raise ManifestError("parts disagree on the checkpoint's placement, meta or history_trim")
    manifest = GlobalManifest(step=step, writer_generation=writer_generation, world_size=world_size,
                               epoch_boundary=epochs.pop() if epochs else False, created_unix_ns=created_unix_ns,
                               parts=entries, tensors=tensors, attributes=attributes)
    _check_global(manifest)
    return manifest


def _header(kind: str, step: int, generation: int, world_size: int, epoch_boundary: bool, created: int) -> dict:
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION_SHARDED, "kind": kind,
            "checksum_algorithm": CHECKSUM_ALGORITHM, "step": step, "writer_generation": generation,
            "world_size": world_size, "epoch_boundary": epoch_boundary, "created_unix_ns": created}


def _file_json(f: PartFile) -> dict:
    return {"name": f.name, "size_bytes": f.size_bytes}


def _chunk_place_json(c: ChunkRecord) -> dict:
    return {"offsets": list(c.box.offsets), "sizes": list(c.box.sizes), "rank": c.rank, "codec": c.codec,
            "file": c.file, "offset": c.offset, "length": c.length, "stored_crc32": c.stored_crc32,
            "raw_crc32": c.raw_crc32, "crc_block_bytes": c.crc_block_bytes, "block_crc32": list(c.block_crc32),
            "delta": c.delta}


def _signed(body: dict) -> bytes:
    body["manifest_crc32"] = body_checksum(body)
    return _dump(body)


def _dump(body: dict) -> bytes:
    return dumps_indented(body)


# ------------------------------------------------------------------ decoding
def decode_part(data: bytes, *, name: str | None = None) -> PartManifest:
    """Parse and check a part manifest (``name``: the file it was read from, checked
    against its first rank); raises ManifestError with the reason."""
    body = _checked_body(data, KIND_PART)
    world_size, generation = _world_size(body), _generation(body)
    ranks = _ranks(body.get("ranks"), world_size)
    if name is not None and name != part_manifest_name(ranks[0]):
        raise ManifestError(f"a part for ranks starting at {ranks[0]} stored as {name!r}")
    files = _files(body.get("files"), ranks[0])
    sizes = {f.name: f.size_bytes for f in files}
    chunks = tuple(_part_chunk(raw, sizes, set(ranks)) for raw in _list(body, "chunks"))
    _check_part_chunks(chunks)
    delta_base = _delta_base(body, chunks, f"part {part_manifest_name(ranks[0])}")
    _check_no_deltas_before_4(body, chunks)
    skeletons = _field(body, "skeletons", dict)
    if sorted(skeletons) != sorted(str(r) for r in ranks):
        raise ManifestError(f"skeletons for ranks {sorted(skeletons)!r:.200}, part covers {list(ranks)!r:.200}")
    return PartManifest(step=_int(body, "step", MAX_STEP), writer_generation=generation, world_size=world_size,
                        ranks=ranks, epoch_boundary=_field(body, "epoch_boundary", bool),
                        created_unix_ns=_int(body, "created_unix_ns"), files=files, chunks=chunks,
                        skeletons={r: skeletons[str(r)] for r in ranks}, delta_base=delta_base,
                        attributes=_attributes(body))


def decode_global(data: bytes) -> GlobalManifest:
    """Parse and check a global manifest; raises ManifestError with the reason."""
    return _decode_global(bytes(data))


# A decode is a function of the bytes alone and its result is immutable: the same bytes
# read again (every listing reads every committed manifest) are not checked again.
@functools.lru_cache(maxsize=16)
def _decode_global(data: bytes) -> GlobalManifest:
    body = _checked_body(data, KIND_SHARDED)
    world_size = _world_size(body)
    parts = tuple(_part_entry(raw, world_size) for raw in _list(body, "parts"))
    sizes = {f.name: (f.size_bytes, p.ranks) for p in parts for f in p.files}
    if len(sizes) != sum(len(p.files) for p in parts):
        raise ManifestError("a data file is listed by two parts")
    tensors = tuple(_tensor_index(raw, sizes) for raw in _list(body, "tensors"))
    _check_part_bases(parts, tensors)
    _check_no_deltas_before_4(body, [c for t in tensors for c in t.chunks])
    manifest = GlobalManifest(step=_int(body, "step", MAX_STEP), writer_generation=_generation(body),
                               world_size=world_size, epoch_boundary=_field(body, "epoch_boundary", bool),
                               created_unix_ns=_int(body, "created_unix_ns"), parts=parts, tensors=tensors,
                               attributes=_attributes(body), format_version=body["format_version"])
    _check_global(manifest)
    return manifest


def forget_decoded() -> None:
    """Drop the decoded manifests this process keeps, so the next read decodes afresh (what
    a restarted process pays; benchmarks call it)."""
    _decode_global.cache_clear()
    _claims_sharded.cache_clear()


def is_parted_manifest(data: bytes) -> bool:
    """Whether ``data`` claims to be a sharded global manifest (format 3 or 4; not checked)."""
    return _claims_sharded(bytes(data))


@functools.lru_cache(maxsize=16)
def _claims_sharded(data: bytes) -> bool:
    try:
        body = parse_stored_json(data, max_bytes=MAX_MANIFEST_BYTES)
    except StoredJsonError:
        return False
    return isinstance(body, dict) and body.get("format_version") in READABLE_SHARDED_VERSIONS


def replicated_skeleton(part: PartManifest, manifest: GlobalManifest) -> tuple[Any, list[str]]:
    """The state skeleton and leaf keys of a replicated checkpoint's one part, checked: the
    skeleton names every leaf once, each leaf a tensor of one whole chunk of its kind."""
    if part.ranks != (0,) or manifest.world_size != 1:
        raise ManifestError("a replicated checkpoint has one part, of rank 0")
    body = part.skeletons[0]
    if not isinstance(body, dict) or sorted(body) != ["keys", "state"]:
        raise ManifestError("the skeleton of a replicated checkpoint is {state, keys}")
    keys = body["keys"]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise ManifestError("skeleton keys: expected a list of distinct tensor keys")
    if len(keys) != len(manifest.tensors):
        raise ManifestError(f"skeleton names {len(keys)} leaves, the checkpoint holds {len(manifest.tensors)}")
    try:
        refs = skeleton_leaf_refs(body["state"])
    except SkeletonError as err:
        raise ManifestError(f"state skeleton: {err}") from None
    if sorted(index for _, index in refs) != list(range(len(keys))):
        raise ManifestError("state skeleton does not reference every tensor exactly once")
    for tag, index in refs:
        tensor = manifest.tensor(keys[index])
        if tensor is None or len(tensor.chunks) != 1 or tensor.chunks[0].box != whole(tensor.global_shape):
            raise ManifestError(f"leaf {keys[index]!r:.80} is not one whole tensor of the checkpoint")
        if tag not in LEAF_TAGS[tensor.kind]:
            raise ManifestError(f"tensor {tensor.key!r:.80} referenced as {tag}")
    return body["state"], keys


def _checked_body(data: bytes, kind: str) -> dict:
    try:
        body = parse_stored_json(data, max_bytes=MAX_MANIFEST_BYTES)
    except StoredJsonError as err:
        raise ManifestError(str(err)) from None
    if not isinstance(body, dict):
        raise ManifestError("top level is not a JSON object")
    if body.get("format") != FORMAT_NAME:
        raise ManifestError(f"not a ray_checkfreq manifest (format={body.get('format')!r:.80})")
    version = body.get("format_version")
    if version not in READABLE_SHARDED_VERSIONS:
        raise ManifestError(f"format version {version!r:.40} is not a sharded checkpoint's "
                            f"{READABLE_SHARDED_VERSIONS}")
    if body.get("kind") != kind:
        raise ManifestError(f"kind {body.get('kind')!r:.40}: expected {kind!r}")
    if body.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise ManifestError(f"unknown checksum algorithm {body.get('checksum_algorithm')!r:.40}")
    if body.get("manifest_crc32") != body_checksum(body):
        raise ManifestError("manifest checksum mismatch (the file was altered or damaged)")
    if _dump(body) != bytes(data):
        raise ManifestError("manifest bytes differ from their encoding (the file was altered or damaged)")
    return body


def _check_global(manifest: GlobalManifest) -> None:
    if manifest.attributes.placement == "replicated" and (manifest.world_size, len(manifest.parts)) != (1, 1):
        raise ManifestError(f"a replicated checkpoint of {len(manifest.parts)} parts for a world of "
                            f"{manifest.world_size} (it has one part, of rank 0)")
    covered = sorted(r for p in manifest.parts for r in p.ranks)
    if covered != list(range(manifest.world_size)):
        missing = sorted(set(range(manifest.world_size)) - set(covered))
        twice = sorted({r for r in covered if covered.count(r) > 1}) if len(covered) < 4096 else "some"
        raise ManifestError(f"parts cover ranks {len(covered)} times for a world of {manifest.world_size} "
                            f"(missing {missing[:20]}, twice {twice}): not every part is there exactly once")
    names = [p.name for p in manifest.parts]
    if len(set(names)) != len(names):
        raise ManifestError("a part is listed twice")
    keys = [t.key for t in manifest.tensors]
    if len(set(keys)) != len(keys):
        raise ManifestError("a tensor is listed twice")
    for tensor in manifest.tensors:
        for chunk in tensor.chunks:
            if (chunk.kind, chunk.dtype, chunk.global_shape) != (tensor.kind, tensor.dtype, tensor.global_shape):
                raise ManifestError(f"tensor {tensor.key!r}: chunks disagree on dtype or global shape")
        try:
            check_tiling(tensor.global_shape, [c.box for c in tensor.chunks])
        except ChunkLayoutError as err:
            raise ManifestError(f"tensor {tensor.key!r}: {err}") from None


def _part_entry(raw: Any, world_size: int) -> PartEntry:
    if not isinstance(raw, dict):
        raise ManifestError("part entry is not an object")
    name = _field(raw, "name", str)
    match = PART_MANIFEST.match(name)
    ranks = _ranks(raw.get("ranks"), world_size)
    if match is None or int(match["rank"]) != ranks[0]:
        raise ManifestError(f"part name {name!r:.80} is not part-r<first rank>.json of ranks from {ranks[0]}")
    return PartEntry(name=name, ranks=ranks, size_bytes=_int(raw, "size_bytes", MAX_MANIFEST_BYTES),
                     crc32=_int(raw, "crc32", MAX_CRC32), files=_files(raw.get("files"), ranks[0]),
                     delta_base=_optional_dir_name(raw, f"part {name}"))


def _tensor_index(raw: Any, sizes: dict[str, tuple[int, tuple[int, ...]]]) -> TensorIndex:
    if not isinstance(raw, dict):
        raise ManifestError("tensor entry is not an object")
    key, kind, dtype, shape = _tensor_identity(raw)
    chunks = []
    for place in _list(raw, "chunks"):
        if not isinstance(place, dict):
            raise ManifestError(f"tensor {key!r}: chunk entry is not an object")
        file = _field(place, "file", str)
        if file not in sizes:
            raise ManifestError(f"tensor {key!r}: chunk in {file!r:.80}, a file no part lists")
        size, ranks = sizes[file]
        chunks.append(_chunk(key, kind, dtype, shape, place, {file: size}, set(ranks)))
    return TensorIndex(key=key, kind=kind, dtype=dtype, global_shape=shape, chunks=tuple(chunks))


def _part_chunk(raw: Any, sizes: dict[str, int], ranks: set[int]) -> ChunkRecord:
    if not isinstance(raw, dict):
        raise ManifestError("chunk entry is not an object")
    key, kind, dtype, shape = _tensor_identity(raw)
    return _chunk(key, kind, dtype, shape, raw, sizes, ranks)


def _tensor_identity(raw: dict) -> tuple[str, str, str, tuple[int, ...]]:
    key = _field(raw, "key", str)
    if len(key) > MAX_KEY_CHARS:
        raise ManifestError(f"tensor key {key!r:.80}: longer than {MAX_KEY_CHARS} characters")
    kind, dtype = _field(raw, "kind", str), _field(raw, "dtype", str)
    try:
        if kind == "torch":
            torch_dtype(dtype)
        elif kind == "numpy":
            numpy_dtype(dtype)
        else:
            raise ValueError(f"unknown leaf kind {kind!r:.40}")
    except ValueError as err:
        raise ManifestError(f"tensor {key!r}: {err}") from None
    shape = _dims(raw, "global_shape", key)
    if LeafSpec(kind=kind, dtype=dtype, shape=shape).nbytes > MAX_SIZE_BYTES:
        raise ManifestError(f"tensor {key!r}: global shape {list(shape)} holds more than {MAX_SIZE_BYTES} bytes")
    return key, kind, dtype, shape


def _chunk(key: str, kind: str, dtype: str, shape: tuple[int, ...], raw: dict, sizes: dict[str, int],
           ranks: set[int]) -> ChunkRecord:
    offsets, box_sizes = _dims(raw, "offsets", key), _dims(raw, "sizes", key)
    if len(offsets) != len(shape) or len(box_sizes) != len(shape):
        raise ManifestError(f"tensor {key!r}: chunk offsets/sizes of another rank than shape {list(shape)}")
    box = Box(offsets, box_sizes)
    if not box.fits(shape):
        raise ManifestError(f"tensor {key!r}: chunk at {list(offsets)} of sizes {list(box_sizes)} lies outside "
                            f"shape {list(shape)}")
    record = ChunkRecord(
        key=key, kind=kind, dtype=dtype, global_shape=shape, box=box, rank=_int(raw, "rank", MAX_WORLD_SIZE - 1),
        codec=_field(raw, "codec", str), file=_field(raw, "file", str), offset=_int(raw, "offset", MAX_SIZE_BYTES),
        length=_int(raw, "length", MAX_SIZE_BYTES), stored_crc32=_int(raw, "stored_crc32", MAX_CRC32),
        raw_crc32=_int(raw, "raw_crc32", MAX_CRC32),
        crc_block_bytes=_int(raw, "crc_block_bytes", MAX_CRC_BLOCK), block_crc32=_crc_list(raw, key),
        delta=_optional_bool(raw, "delta"),
    )
    _check_chunk_place(record, sizes, ranks)
    return record


def _check_chunk_place(c: ChunkRecord, sizes: dict[str, int], ranks: set[int]) -> None:
    try:
        _check_chunk_fields(c, sizes, ranks)
    except ValueError as err:
        raise ManifestError(f"tensor {c.key!r} chunk at {list(c.box.offsets)}: {err}") from None


def _check_chunk_fields(c: ChunkRecord, sizes: dict[str, int], ranks: set[int]) -> None:
    """Raises ValueError with the reason; the caller names the chunk (only on failure: a
    manifest has thousands of chunks)."""
    if c.rank not in ranks:
        raise ValueError(f"rank {c.rank} is not one of its part's ranks")
    if c.codec not in CODECS:
        raise ValueError(f"unknown codec {c.codec!r:.40}")
    if c.file not in sizes:
        raise ValueError(f"refers to unlisted file {c.file!r:.80}")
    if c.offset + c.length > sizes[c.file]:
        raise ValueError(f"extends past the end of {c.file!r}")
    nbytes = c.spec.nbytes
    if c.codec == "raw" and c.length != nbytes:
        raise ValueError(f"raw length {c.length} != {nbytes} for its sizes")
    if c.delta and c.codec != "rcfz":
        raise ValueError(f"a delta stored with codec {c.codec!r} (deltas are rcfz blobs)")
    if c.codec == "rcfz" and nbytes > max(c.length, 1) * MAX_EXPANSION:
        raise ValueError(f"{nbytes} bytes from a {c.length}-byte codec blob is more than the "
                         f"{MAX_EXPANSION}x expansion a blob may have")
    block = c.crc_block_bytes
    if not MIN_CRC_BLOCK <= block or block & (block - 1):
        raise ValueError(f"crc_block_bytes {block} is not a power of two from {MIN_CRC_BLOCK}")
    if len(c.block_crc32) != -(-c.length // block):
        raise ValueError(f"{len(c.block_crc32)} block checksums for {c.length} bytes "
                         f"in blocks of {block}")


def _check_part_chunks(chunks: tuple[ChunkRecord, ...]) -> None:
    seen: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    boxes: set[tuple[str, tuple[int, ...]]] = set()
    for c in chunks:
        identity = (c.kind, c.dtype, c.global_shape)
        if seen.setdefault(c.key, identity) != identity:
            raise ManifestError(f"tensor {c.key!r}: chunks disagree on dtype or global shape")
        if (c.key, c.box.offsets) in boxes:
            raise ManifestError(f"tensor {c.key!r}: two chunks at {list(c.box.offsets)}")
        boxes.add((c.key, c.box.offsets))


def _delta_base(body: dict, chunks: Sequence[ChunkRecord], where: str) -> str | None:
    """A part's ``delta_base``: a checkpoint directory name exactly when a chunk is a delta."""
    base = _optional_dir_name(body, where)
    _check_base_matches(base, any(c.delta for c in chunks), where)
    return base


def _check_part_bases(parts: Sequence[PartEntry], tensors: Sequence[TensorIndex]) -> None:
    deltas = {c.file for t in tensors for c in t.chunks if c.delta}
    for part in parts:
        _check_base_matches(part.delta_base, any(f.name in deltas for f in part.files), f"part {part.name}")


def _check_base_matches(base: str | None, has_delta: bool, where: str) -> None:
    if (base is not None) != has_delta:
        raise ManifestError(f"{where}: delta_base {base!r:.80} " + (
            "without a delta chunk" if base is not None else "missing for its delta chunks"))


def _attributes(body: dict) -> CheckpointAttributes:
    if body["format_version"] < 4:
        if any(name in body for name in ("placement", "meta", "history_trim")):
            raise ManifestError(f"format version {body['format_version']} with fields of format 4")
        return CheckpointAttributes()
    placement = body.get("placement")
    if placement not in PLACEMENTS:
        raise ManifestError(f"placement {placement!r:.40}: expected one of {PLACEMENTS}")
    trim = body.get("history_trim")
    if trim is not None:
        trim = parse_history_trim(trim)
    return CheckpointAttributes(placement=placement, meta=_field(body, "meta", dict), history_trim=trim)


def _check_no_deltas_before_4(body: dict, chunks: Sequence[ChunkRecord]) -> None:
    if body["format_version"] < 4 and any(c.delta for c in chunks):
        raise ManifestError(f"a delta chunk in a format version {body['format_version']} manifest (deltas came in 4)")


def _optional_dir_name(raw: dict, where: str) -> str | None:
    value = raw.get("delta_base")
    if value is None:
        return None
    if not isinstance(value, str) or parse_checkpoint_dir(value) is None:
        raise ManifestError(f"{where}: delta_base {value!r:.80} is not a checkpoint directory name")
    return value


def _optional_bool(raw: dict, name: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise ManifestError(f"field {name!r} is not true or false")
    return value


def _files(raw: Any, first_rank: int) -> tuple[PartFile, ...]:
    if not isinstance(raw, list):
        raise ManifestError("field 'files' missing or not list")
    files = []
    for item in raw:
        if not isinstance(item, dict):
            raise ManifestError("file entry is not an object")
        name = _field(item, "name", str)
        match = PART_FILE.match(name)
        if match is None or int(match["rank"]) != first_rank:
            raise ManifestError(f"data file {name!r:.80} is not part-r<first rank>-<token>-<n>.bin "
                                f"of ranks from {first_rank}")
        files.append(PartFile(name=name, size_bytes=_int(item, "size_bytes", MAX_SIZE_BYTES)))
    if len({f.name for f in files}) != len(files):
        raise ManifestError("duplicate data file names")
    return tuple(files)


def _ranks(raw: Any, world_size: int) -> tuple[int, ...]:
    if not isinstance(raw, list) or not raw or not all(is_int(r) and 0 <= r < world_size for r in raw):
        raise ManifestError(f"ranks {raw!r:.200}: expected a non-empty list of ranks below {world_size}")
    if raw != sorted(set(raw)):
        raise ManifestError(f"ranks {raw!r:.200}: not increasing")
    return tuple(raw)


def _world_size(body: dict) -> int:
    value = _int(body, "world_size", MAX_WORLD_SIZE)
    if value < 1:
        raise ManifestError("world_size is 0")
    return value


def _generation(body: dict) -> int:
    value = _int(body, "writer_generation", MAX_GENERATION)
    if value < 1:
        raise ManifestError("writer_generation is 0: a sharded checkpoint is always written by a fenced writer")
    return value


def _dims(raw: dict, name: str, key: str) -> tuple[int, ...]:
    value = raw.get(name)
    # ``type(d) is int``: a parsed JSON integer is an int exactly (a bool is not one).
    if not isinstance(value, list) or len(value) > MAX_NDIM or not all(
            type(d) is int and 0 <= d <= MAX_SIZE_BYTES for d in value):
        raise ManifestError(f"tensor {key!r}: bad {name} {value!r:.200}")
    return tuple(value)


def _crc_list(raw: dict, key: str) -> tuple[int, ...]:
    value = raw.get("block_crc32")
    if not isinstance(value, list) or not all(type(c) is int and 0 <= c <= MAX_CRC32 for c in value):
        raise ManifestError(f"tensor {key!r}: bad block_crc32")
    return tuple(value)


def _list(raw: dict, name: str) -> list:
    return _field(raw, name, list)


def _field(raw: dict, name: str, kind: type) -> Any:
    value = raw.get(name)
    if type(value) is kind:  # the common case, decided at once
        return value
    if not isinstance(value, kind) or kind is int:  # a bool is no int here
        raise ManifestError(f"field {name!r} missing or not {kind.__name__}")
    return value


def _int(raw: dict, name: str, maximum: int = (1 << 64) - 1) -> int:
    value = _field(raw, name, int)
    if not 0 <= value <= maximum:
        raise ManifestError(f"field {name!r} is {value}: not in [0, {maximum}]")
    return value
