"""The checkpoint manifest: a JSON document that commits a checkpoint by existing.

Pure logic, no I/O. ``encode_manifest`` adds a CRC32 of the canonical form of the
document so that a flipped bit anywhere in it is caught; ``decode_manifest`` checks
that CRC and every structural invariant before any shard is touched, so a bad
manifest is refused with a message instead of steering reads out of the checkpoint.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from ray_checkfreq.codec import MAX_EXPANSION
from ray_checkfreq.codec.nearlossless import MAX_FACTOR_LOG2
from ray_checkfreq.storage.arrays import LeafSpec, numpy_dtype, torch_dtype
from ray_checkfreq.storage.canonical_json import dumps_indented
from ray_checkfreq.storage.names import CHECKPOINT_DIR, MAX_GENERATION, MAX_STEP
from ray_checkfreq.storage.stored_json import StoredJsonError, is_int, parse_stored_json
from ray_checkfreq.storage.tree import SkeletonError, skeleton_leaf_refs

FORMAT_NAME = "ray_checkfreq.checkpoint"
FORMAT_VERSION = 1
# Written only for a near-lossless history copy (``history_trim``): a reader that predates
# trimming refuses it instead of restoring rounded weights as if they were the checkpoint.
FORMAT_VERSION_TRIMMED = 2
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_TRIMMED)
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "crc32"
# Shard names are plain file names: nothing a manifest says can leave its directory.
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
LEAF_TAGS = {"torch": ("tensor",), "numpy": ("ndarray", "npscalar")}
# Limits a manifest must keep (docs/format.md); past them it is corrupt. Every size and
# offset is a Python int, so nothing overflows while they are checked.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_SIZE_BYTES = 1 << 50  # a shard, a leaf's stored length or its decoded size
MAX_NDIM = 64
MAX_INT_FIELD = (1 << 64) - 1
MAX_CRC32 = (1 << 32) - 1
# "raw": the leaf's bytes as they are; "rcfz": a ray_checkfreq.codec blob (self-describing).
CODECS = frozenset({"raw", "rcfz"})


class ManifestError(ValueError):
    """The manifest is malformed; the message says what is wrong."""


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


def encode_manifest(manifest: Manifest) -> bytes:
    body = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION if manifest.history_trim is None else FORMAT_VERSION_TRIMMED,
        "step": manifest.step,
        "epoch_boundary": manifest.epoch_boundary,
        "created_unix_ns": manifest.created_unix_ns,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "meta": manifest.meta,
        "delta_base": manifest.delta_base,
        "writer_generation": manifest.writer_generation,
        "shards": [{"name": s.name, "size_bytes": s.size_bytes} for s in manifest.shards],
        "tensors": [_tensor_json(t) for t in manifest.tensors],
        "state": manifest.state,
    }
    if manifest.history_trim is not None:
        body["history_trim"] = manifest.history_trim
    body["manifest_crc32"] = body_checksum(body)
    return _dump(body)


def _dump(body: dict) -> bytes:
    return dumps_indented(body)


def _tensor_json(entry: TensorEntry) -> dict:
    return {
        "key": entry.key,
        "kind": entry.spec.kind,
        "dtype": entry.spec.dtype,
        "shape": list(entry.spec.shape),
        "codec": entry.codec,
        "shard": entry.shard,
        "offset": entry.offset,
        "length": entry.length,
        "stored_crc32": entry.stored_crc32,
        "raw_crc32": entry.raw_crc32,
        "delta": entry.delta,
    }


def body_checksum(body: dict) -> int:
    unsigned = {k: v for k, v in body.items() if k != "manifest_crc32"}
    canonical = json.dumps(unsigned, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return zlib.crc32(canonical.encode("utf-8"))


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
