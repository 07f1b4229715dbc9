"""Reading checkpoints of formats 1 and 2 (written before the one-format change): shard
files and one ``manifest.json`` holding the state skeleton and every tensor's place.
Read-only; every byte is checked as it was then. A delta's base is a format 1 full
checkpoint of the same store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray_checkfreq.errors import CorruptCheckpointError
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.encoding import LeafDecodeError, decode_leaf
from ray_checkfreq.storage.manifest import MANIFEST_NAME, Manifest, ManifestError, ShardEntry, decode_manifest
from ray_checkfreq.storage.parallel import map_on_threads

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
