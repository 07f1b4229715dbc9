"""The commit: one global manifest over a directory's parts, created exclusively, final.

Invariants (docs/format.md, "The commit protocol"; the rules every directory follows are
``commit.py``'s):
1. A directory is committed only when its part manifests cover ranks ``0..world_size-1``
   exactly once, every data file they list is there at its recorded size, every tensor's
   chunks tile it exactly once, every delta base is committed, and the writer's
   generation is still the newest (checked right before the create).
2. The create is exclusive, so there is exactly one commit; a loser finds the manifest and
   reports the step committed only once it reads it and finds every file. A created
   manifest is final (``commit.settle_created`` names the one exception). Where the
   storage has no atomic exclusive create, only the writer of rank 0 creates it.
3. ``salvage``: a new generation commits an old generation's directory whose parts are all
   there but whose committer died, under the directory's generation, when no checkpoint of
   a newer generation than that directory's is committed.
"""

from __future__ import annotations

import logging
import time

from ray_checkfreq.errors import CorruptCheckpointError, FencedWriterError, StorageError
from ray_checkfreq.storage import commit, fencing
from ray_checkfreq.storage.catalog import Catalog, CheckpointRef, CommitResult, missing_files
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.manifest import (
    MAX_MANIFEST_BYTES,
    PART_MANIFEST,
    GlobalManifest,
    ManifestError,
    PartManifest,
    decode_part,
    encode_global,
    merge_parts,
)
from ray_checkfreq.storage.retention import StoredEntry

logger = logging.getLogger("ray_checkfreq.storage")

Parts = list[tuple[PartManifest, int, int]]  # each part with its JSON's size and CRC32


def commit_dir(catalog: Catalog, name: str, step: int, generation: int, *, fence: int,
               may_create: bool = True) -> CommitResult:
    """Commit directory ``name`` of (``step``, ``generation``) if its parts are all there
    (invariant 1), as a writer of generation ``fence``."""
    backend = catalog.backend
    files = backend.list_files(name)
    if commit.MANIFEST_NAME in files:
        return catalog.existing_commit(name)
    parts = _read_parts(catalog, name, files, step, generation)
    if not parts:
        return CommitResult(committed=False, by_me=False)
    world_size = parts[0][0].world_size
    missing = sorted(set(range(world_size)) - {r for p, _, _ in parts for r in p.ranks})
    if missing:
        return CommitResult(committed=False, by_me=False, missing_ranks=tuple(missing))
    try:
        manifest = merge_parts(step, generation, world_size, time.time_ns(), parts)
    except ManifestError as err:
        raise CorruptCheckpointError(backend.uri(name), f"its parts do not make a checkpoint: {err}") from None
    lost = missing_files(manifest, files)
    if lost:
        raise StorageError(backend.uri(name), f"files {lost[:8]} missing or short before the commit: not committed")
    if not may_create:
        return CommitResult(committed=False, by_me=False)
    _check_bases(catalog, name, manifest)
    fencing.check_fence(backend, fence)
    if not backend.create_exclusive(commit.manifest_path(name), encode_global(manifest)):
        return catalog.existing_commit(name)
    emptied = commit.settle_created(backend, name, manifest.expected_files(), generation)
    if emptied:
        _raise_emptied(catalog, name, generation, fence, emptied)
    logger.info("%s: committed step %d (%d parts)", backend.root_uri, step, len(parts))
    return CommitResult(committed=True, by_me=True, ref=catalog.ref(name, manifest))


def salvage(catalog: Catalog, generation: int) -> CheckpointRef | None:
    """Commit the newest complete but uncommitted directory of an older generation
    (invariant 3); None when there is none."""
    fencing.check_fence(catalog.backend, generation)
    entries = catalog.scan()
    newest_committed = max((e.generation for e in entries if e.manifest is not None), default=0)
    candidates = sorted((e for e in entries if not e.committed and not e.abandoned
                         and newest_committed <= e.generation < generation),
                        key=StoredEntry.order_key, reverse=True)
    for entry in candidates:
        try:
            result = commit_dir(catalog, entry.name, entry.step, entry.generation, fence=generation)
        except (CorruptCheckpointError, StorageError) as err:
            if isinstance(err, FencedWriterError):
                raise
            logger.warning("not salvaged: %s", err)
            continue
        if result.committed:
            logger.info("%s: salvaged %s", catalog.backend.root_uri, entry.name)
            return result.ref
    return None


def _check_bases(catalog: Catalog, name: str, manifest: GlobalManifest) -> None:
    """A delta is only as good as its base: commit only while every base is committed."""
    for base in sorted(manifest.delta_bases):
        if not catalog.existing_commit(base).committed:
            raise StorageError(catalog.backend.uri(name), f"its delta base {base} is not a committed checkpoint "
                               "(removed?): not committed")


def _raise_emptied(catalog: Catalog, name: str, generation: int, fence: int, emptied: list[str]) -> None:
    """A manifest created over files a newer generation had removed (commit.py, rule 2)."""
    newest = fencing.newest_marker(catalog.backend)
    if fence == generation:
        raise FencedWriterError(catalog.backend.root_uri, generation, newest)
    raise StorageError(catalog.backend.uri(name), f"files {emptied[:8]} were removed by generation {newest}: "
                       "not salvaged")


def _read_parts(catalog: Catalog, name: str, files: dict[str, int], step: int, generation: int) -> Parts:
    backend = catalog.backend
    parts = []
    for file in sorted(f for f in files if PART_MANIFEST.match(f)):
        location = backend.uri(f"{name}/{file}")
        if files[file] > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(location, f"{files[file]} bytes, more than {MAX_MANIFEST_BYTES}")
        try:
            data = backend.read_small(f"{name}/{file}")
            part = catalog.parts.get(f"{name}/{file}", data) or decode_part(data, name=file)
        except FileNotFoundError:
            raise CorruptCheckpointError(location, "part manifest disappeared while reading") from None
        except ManifestError as err:
            raise CorruptCheckpointError(location, str(err)) from None
        catalog.parts.put(f"{name}/{file}", data, part)
        if (part.step, part.writer_generation) != (step, generation):
            raise CorruptCheckpointError(location, f"step {part.step} of generation {part.writer_generation} "
                                         f"in the directory of step {step}, generation {generation}")
        parts.append((part, len(data), crc32(data)))
    _check_parts_agree(catalog, name, parts)
    return parts


def _check_parts_agree(catalog: Catalog, name: str, parts: Parts) -> None:
    sizes = {p.world_size for p, _, _ in parts}
    if len(sizes) > 1:
        raise CorruptCheckpointError(catalog.backend.uri(name), f"parts disagree on the world size: {sorted(sizes)}")
    seen: dict[int, str] = {}
    for part, _, _ in parts:
        for rank in part.ranks:
            if rank in seen:
                raise CorruptCheckpointError(catalog.backend.uri(name), f"rank {rank} is in two parts: "
                                             f"{seen[rank]} and {part.name}")
            seen[rank] = part.name
