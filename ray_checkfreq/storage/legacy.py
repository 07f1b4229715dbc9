"""Reading checkpoints of formats 1 and 2 (written before the one-format change): shard
files and one ``manifest.json`` holding the state skeleton and every tensor's place.
Read-only; every byte is checked as it was then. A delta's base is a format 1 full
checkpoint of the same store."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_checkfreq.codec import MAX_EXPANSION
from ray_checkfreq.errors import CorruptCheckpointError
from ray_checkfreq.storage.arrays import LeafSpec, numpy_dtype, torch_dtype
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.canonical_json import dumps_indented
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.encoding import LeafDecodeError, decode_leaf
from ray_checkfreq.storage.manifest import (
    CHECKSUM_ALGORITHM,
    CODECS,
    FORMAT_NAME,
    LEAF_TAGS,
    MANIFEST_NAME,
    MAX_CRC32,
    MAX_INT_FIELD,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_SIZE_BYTES,
    GlobalManifest,
    ManifestError,
    body_checksum,
    decode_global,
    is_parted_manifest,
    parse_history_trim,
)
from ray_checkfreq.storage.names import CHECKPOINT_DIR, MAX_GENERATION, MAX_STEP
from ray_checkfreq.storage.parallel import map_on_threads
from ray_checkfreq.storage.stored_json import StoredJsonError, is_int, parse_stored_json
from ray_checkfreq.storage.tree import SkeletonError, skeleton_leaf_refs

FORMAT_VERSION = 1
# Written only for a near-lossless history copy (``history_trim``): a reader that predates
# trimming refuses it instead of restoring rounded weights as if they were the checkpoint.
FORMAT_VERSION_TRIMMED = 2
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_TRIMMED)
# Shard names are plain file names: nothing a manifest says can leave its directory.
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
Threads = tuple[int, int | None]  # (parallel shard reads, codec threads)


def load_manifest(backend: Backend, name: str) -> Manifest:
    location = backend.uri(f"{name}/{MANIFEST_NAME}")
    try:
        return decode_manifest(backend.read_small(f"{name}/{MANIFEST_NAME}"))
    except FileNotFoundError:
        raise CorruptCheckpointError(location, "manifest is missing") from None
    except ManifestError as err:
        raise CorruptCheckpointError(location, str(err)) from None


def read_leaves(backend: Backend, name: str, manifest: Manifest, threads: Threads, *, build: bool,
                check_stored: bool = False) -> list[Any]:
    """The leaves of checkpoint directory ``name``, in the manifest's order (None where not
    ``build``: bytes checked only)."""
    bases = _read_base(backend, name, manifest, threads, build=build)
    files = backend.list_files(name)
    for shard in manifest.shards:
        _check_shard_file(backend, name, shard, files)
    by_shard: dict[str, list[int]] = {}
    for index, tensor in enumerate(manifest.tensors):
        by_shard.setdefault(tensor.shard, []).append(index)
    leaves: list[Any] = [None] * len(manifest.tensors)
    read = _shard_reader(backend, name, manifest, leaves, bases, threads[1], build=build, check_stored=check_stored)
    map_on_threads(lambda item: read(item[0], item[1]), list(by_shard.items()), threads[0], "rcf-read")
    return leaves


def _read_base(backend: Backend, name: str, manifest: Manifest, threads: Threads, *, build: bool) -> dict[str, Any]:
    """Leaves of the full checkpoint the deltas refer to, by key ({} when none)."""
    if manifest.delta_base is None:
        return {}
    try:
        base = load_manifest(backend, manifest.delta_base)
        if base.delta_base is not None:
            raise CorruptCheckpointError(backend.uri(f"{manifest.delta_base}/{MANIFEST_NAME}"),
                                         "a delta base is itself a delta")
        leaves = read_leaves(backend, manifest.delta_base, base, threads, build=build)
    except CorruptCheckpointError as err:
        raise CorruptCheckpointError(backend.uri(f"{name}/{MANIFEST_NAME}"),
                                     f"its delta base is unusable: {err}") from None
    return {t.key: leaf for t, leaf in zip(base.tensors, leaves)}


def _check_shard_file(backend: Backend, name: str, shard: ShardEntry, files: dict[str, int]) -> None:
    location = backend.uri(f"{name}/{shard.name}")
    if shard.name not in files:
        raise CorruptCheckpointError(location, "shard file is missing")
    if files[shard.name] != shard.size_bytes:
        raise CorruptCheckpointError(
            location, f"shard is {files[shard.name]} bytes, manifest says {shard.size_bytes} (truncated?)")


def _shard_reader(backend: Backend, name: str, manifest: Manifest, leaves: list[Any], bases: dict[str, Any],
                  codec_threads: int | None, *, build: bool, check_stored: bool) -> Callable[[str, list[int]], None]:
    def read(shard: str, indices: list[int]) -> None:
        location = backend.uri(f"{name}/{shard}")
        try:
            buffer = backend.read(f"{name}/{shard}")
        except FileNotFoundError:
            raise CorruptCheckpointError(location, "shard file is missing") from None
        view = memoryview(buffer)
        for index in indices:
            entry = manifest.tensors[index]
            if entry.offset + entry.length > len(buffer):
                raise CorruptCheckpointError(location, f"tensor {entry.key!r} lies past the end of the shard")
            # Decoding a codec blob checks the blob's own checksums and then raw_crc32, so the
            # stored-bytes pass is needed only for raw tensors and for verify().
            if (entry.codec == "raw" or not build or check_stored) and (
                    crc32(view[entry.offset:entry.offset + entry.length]) != entry.stored_crc32):
                raise CorruptCheckpointError(location, f"checksum mismatch in tensor {entry.key!r}")
            if entry.delta and entry.key not in bases:
                raise CorruptCheckpointError(location, f"tensor {entry.key!r}: no such key in its delta base")
            if not build:
                continue
            try:
                leaves[index] = decode_leaf(entry.spec, entry.codec, buffer, entry.offset, entry.length,
                                            entry.raw_crc32, base=bases.get(entry.key) if entry.delta else None,
                                            threads=codec_threads)
            except LeafDecodeError as err:
                raise CorruptCheckpointError(location, f"tensor {entry.key!r}: {err}") from None
    return read


def decode_any_manifest(data: bytes) -> Manifest | GlobalManifest:
    """A checkpoint's ``manifest.json`` of any readable format: 3 and 4 by ``manifest``, 1
    and 2 here. Raises ManifestError with the reason."""
    return decode_global(data) if is_parted_manifest(data) else decode_manifest(data)


# ------------------------------------------------------------------ the format 1-2 manifest
@dataclass(frozen=True)
class TensorEntry:
    """Where one array leaf lives and how to check it."""

    key: str
    spec: LeafSpec
    codec: str
    shard: str
    offset: int
    length: int
    stored_crc32: int
    raw_crc32: int
    delta: bool = False  # stored as an XOR delta against the same key in Manifest.delta_base


@dataclass(frozen=True)
class ShardEntry:
    name: str
    size_bytes: int


@dataclass(frozen=True)
class Manifest:
    step: int
    epoch_boundary: bool
    created_unix_ns: int
    shards: tuple[ShardEntry, ...]
    tensors: tuple[TensorEntry, ...]
    state: Any
    meta: dict = field(default_factory=dict)
    delta_base: str | None = None  # directory name of the full checkpoint deltas refer to
    writer_generation: int = 0  # of the store that wrote it; 0 = written before writer fencing
    # A near-lossless history copy (storage/history.py): {"source": the directory it was
    # made from, "precision_factor" or "precision_bits": the setting}; None: exact.
    history_trim: dict | None = None

    @property
    def size_bytes(self) -> int:
        return sum(shard.size_bytes for shard in self.shards)

    @property
    def delta_bases(self) -> frozenset[str]:
        return frozenset() if self.delta_base is None else frozenset((self.delta_base,))

    def expected_files(self) -> dict[str, int]:
        return {shard.name: shard.size_bytes for shard in self.shards}


def _dump(body: dict) -> bytes:
    return dumps_indented(body)


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate; raises ManifestError with the reason."""
    try:
        body = parse_stored_json(data, max_bytes=MAX_MANIFEST_BYTES)
    except StoredJsonError as err:
        raise ManifestError(str(err)) from None
    if not isinstance(body, dict):
        raise ManifestError("top level is not a JSON object")
    _check_format(body)
    if body.get("manifest_crc32") != body_checksum(body):
        raise ManifestError("manifest checksum mismatch (the file was altered or damaged)")
    manifest = _build_manifest(body)
    # The checksum covers what the JSON means; a flipped bit can change the bytes and not
    # the meaning (the case of a hex digit in a \u escape). Written manifests are exactly
    # their own re-encoding, so any other byte is damage too.
    if _dump(body) != data:
        raise ManifestError("manifest bytes differ from their encoding (the file was altered or damaged)")
    return manifest


def _check_format(body: dict) -> None:
    if body.get("format") != FORMAT_NAME:
        raise ManifestError(f"not a ray_checkfreq manifest (format={body.get('format')!r})")
    version = body.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        raise ManifestError(
            f"format version {version!r} is not supported (this ray_checkfreq reads {READABLE_FORMAT_VERSIONS})"
        )
    if body.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise ManifestError(f"unknown checksum algorithm {body.get('checksum_algorithm')!r}")


def _build_manifest(body: dict) -> Manifest:
    shards = tuple(_parse_shard(s) for s in _field(body, "shards", list))
    shard_sizes = {s.name: s.size_bytes for s in shards}
    if len(shard_sizes) != len(shards):
        raise ManifestError("duplicate shard names")
    tensors = tuple(_parse_tensor(t, shard_sizes) for t in _field(body, "tensors", list))
    _check_refs(body.get("state"), tensors)
    meta = _field(body, "meta", dict)
    delta_base = _parse_delta_base(body, tensors)
    return Manifest(
        step=_nonneg_int(body, "step", MAX_STEP),
        epoch_boundary=_field(body, "epoch_boundary", bool),
        created_unix_ns=_nonneg_int(body, "created_unix_ns"),
        shards=shards,
        tensors=tensors,
        state=body.get("state"),
        meta=meta,
        delta_base=delta_base,
        writer_generation=_nonneg_int(body, "writer_generation", MAX_GENERATION) if "writer_generation" in body else 0,
        history_trim=_parse_history_trim(body),
    )


def _parse_history_trim(body: dict) -> dict | None:
    trimmed = body.get("format_version") == FORMAT_VERSION_TRIMMED
    value = body.get("history_trim")
    if not trimmed:
        if value is not None:
            raise ManifestError(f"history_trim in a format version {FORMAT_VERSION} manifest")
        return None
    return parse_history_trim(value)


def _parse_delta_base(body: dict, tensors: tuple[TensorEntry, ...]) -> str | None:
    base = body.get("delta_base")
    if base is not None and (not isinstance(base, str) or not CHECKPOINT_DIR.match(base)):
        raise ManifestError(f"delta_base {base!r} is not a checkpoint directory name")
    if base is None and any(t.delta for t in tensors):
        raise ManifestError("delta tensors without a delta_base")
    return base


def _parse_shard(raw: Any) -> ShardEntry:
    if not isinstance(raw, dict):
        raise ManifestError("shard entry is not an object")
    name = _field(raw, "name", str)
    if not _SHARD_NAME.match(name) or ".." in name:
        raise ManifestError(f"shard name {name!r} is not a plain file name (escapes the checkpoint?)")
    return ShardEntry(name=name, size_bytes=_nonneg_int(raw, "size_bytes", MAX_SIZE_BYTES))


def _parse_tensor(raw: Any, shard_sizes: dict[str, int]) -> TensorEntry:
    if not isinstance(raw, dict):
        raise ManifestError("tensor entry is not an object")
    key = _field(raw, "key", str)
    spec = _parse_spec(raw, key)
    entry = TensorEntry(
        key=key,
        spec=spec,
        codec=_field(raw, "codec", str),
        shard=_field(raw, "shard", str),
        offset=_nonneg_int(raw, "offset", MAX_SIZE_BYTES),
        length=_nonneg_int(raw, "length", MAX_SIZE_BYTES),
        stored_crc32=_nonneg_int(raw, "stored_crc32", MAX_CRC32),
        raw_crc32=_nonneg_int(raw, "raw_crc32", MAX_CRC32),
        delta=_field(raw, "delta", bool),
    )
    if entry.codec not in CODECS:
        raise ManifestError(f"tensor {key!r}: unknown codec {entry.codec!r}")
    if entry.delta and entry.codec == "raw":
        raise ManifestError(f"tensor {key!r}: a raw tensor cannot be a delta")
    if entry.shard not in shard_sizes:
        raise ManifestError(f"tensor {key!r} refers to unlisted shard {entry.shard!r}")
    if entry.offset + entry.length > shard_sizes[entry.shard]:
        raise ManifestError(f"tensor {key!r} extends past the end of shard {entry.shard!r}")
    if entry.codec == "raw" and entry.length != spec.nbytes:
        raise ManifestError(f"tensor {key!r}: raw length {entry.length} != {spec.nbytes} for its shape")
    if entry.codec == "rcfz" and spec.nbytes > max(entry.length, 1) * MAX_EXPANSION:
        raise ManifestError(f"tensor {key!r}: {spec.nbytes} bytes from a {entry.length}-byte codec blob "
                            f"is more than the {MAX_EXPANSION}x expansion a blob may have")
    return entry


def _parse_spec(raw: dict, key: str) -> LeafSpec:
    kind = _field(raw, "kind", str)
    dtype = _field(raw, "dtype", str)
    shape = _field(raw, "shape", list)
    if len(shape) > MAX_NDIM or not all(is_int(d) and 0 <= d <= MAX_SIZE_BYTES for d in shape):
        raise ManifestError(f"tensor {key!r}: bad shape {shape!r:.200}")
    try:
        if kind == "torch":
            torch_dtype(dtype)
        elif kind == "numpy":
            numpy_dtype(dtype)
        else:
            raise ValueError(f"unknown leaf kind {kind!r}")
    except ValueError as err:
        raise ManifestError(f"tensor {key!r}: {err}") from None
    spec = LeafSpec(kind=kind, dtype=dtype, shape=tuple(shape))
    if spec.nbytes > MAX_SIZE_BYTES:
        raise ManifestError(f"tensor {key!r}: shape {shape!r} holds {spec.nbytes} bytes, more than {MAX_SIZE_BYTES}")
    return spec


def _check_refs(state: Any, tensors: tuple[TensorEntry, ...]) -> None:
    try:
        refs = skeleton_leaf_refs(state)
    except SkeletonError as err:
        raise ManifestError(f"state skeleton: {err}") from None
    if sorted(index for _, index in refs) != list(range(len(tensors))):
        raise ManifestError("state skeleton does not reference every tensor exactly once")
    for tag, index in refs:
        if tag not in LEAF_TAGS[tensors[index].spec.kind]:
            raise ManifestError(f"tensor {tensors[index].key!r} referenced as {tag}")


def _field(raw: dict, name: str, kind: type) -> Any:
    value = raw.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"field {name!r} missing or not {kind.__name__}")
    return value


def _nonneg_int(raw: dict, name: str, maximum: int = MAX_INT_FIELD) -> int:
    value = _field(raw, name, int)
    if not 0 <= value <= maximum:
        raise ManifestError(f"field {name!r} is {value}: not in [0, {maximum}]")
    return value
