"""The commit rules of every checkpoint directory (docs/format.md, "The commit protocol").

Invariants, for both stores:

1. A directory is committed exactly when its ``manifest.json`` holds a manifest, created
   exclusively once every file it lists is durable.
2. A created manifest is final: no writer takes it back on the strength of a listing. The
   one exception (``settle_created``): the directory's generation is older than the newest
   writer generation, and a direct stat of each listed file finds one missing or short. A
   newer writer emptied the directory before the manifest appeared, so it never was a
   checkpoint (no reader that checks files took it for one); its writer removes it and is
   fenced.
3. Files of a step directory are deleted only while its manifest name holds an abandon
   record, taken with the same exclusive create as a commit (``claim``). So a directory is
   either committed or being removed, never both: a commit racing a removal loses to it,
   or wins and keeps its files. A committed directory is removed (retention, ``delete``)
   by deleting its manifest, then claiming the name; a late commit that slips in between
   wins, and the directory stays for the next retention.
4. A removal deletes every other file, then its record, then the directory. A late commit
   after that finds no directory (POSIX) or no files: rule 2's exception.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from ray_checkfreq.errors import StorageError
from ray_checkfreq.storage import fencing
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.manifest import MANIFEST_NAME

logger = logging.getLogger("ray_checkfreq.storage")

# Staged temporary files older than this are a killed writer's: housekeeping removes them.
STALE_STAGING_S = 3600.0
# A listing whose committed manifest vanished before it was read (a retention at work) is
# out of date: housekeeping takes it again at most RESCANS times, then goes on with what it
# has; a reader's answer (list, latest) is taken again until it is settled, at most
# SETTLED_RESCANS times, then fails by name: it never answers from a view that was never
# true (an older checkpoint, or none, while a newer one stood).
RESCANS = 4
SETTLED_RESCANS = 64
_RECORD_KEY = "ray_checkfreq_abandoned_by_generation"
_MAX_RECORD_BYTES = 128


def abandon_record(generation: int) -> bytes:
    return json.dumps({_RECORD_KEY: generation}).encode()


def is_abandon_record(data: bytes | memoryview) -> bool:
    """Whether a manifest name holds an abandon record, not a manifest."""
    if len(data) > _MAX_RECORD_BYTES:
        return False
    try:
        value = json.loads(bytes(data))
    except ValueError:
        return False
    return isinstance(value, dict) and list(value) == [_RECORD_KEY] and isinstance(value[_RECORD_KEY], int)


def holds_abandon_record(backend: Backend, name: str, files: Mapping[str, int]) -> bool:
    """Whether directory ``name`` (``files`` as listed) holds an abandon record: only a
    manifest name's file small enough to be one is read."""
    size = files.get(MANIFEST_NAME)
    if size is None or size > _MAX_RECORD_BYTES:
        return False
    try:
        return is_abandon_record(backend.read_small(manifest_path(name)))
    except FileNotFoundError:
        return False


def read_listed_manifest(backend: Backend, name: str) -> bytes:
    """The manifest a listing saw in ``name``. FileNotFoundError where it is gone since, or an
    abandon record took its name: the listing is out of date (a retention removed it)."""
    data = backend.read_small(manifest_path(name))
    if is_abandon_record(data):
        raise FileNotFoundError(backend.uri(manifest_path(name)))
    return data


def unsettled(uri: str) -> StorageError:
    return StorageError(uri, f"the store kept changing through {SETTLED_RESCANS} listings (checkpoints committed "
                             "and removed faster than one listing): no settled view to answer from")


def manifest_path(name: str) -> str:
    return f"{name}/{MANIFEST_NAME}"


def claim(backend: Backend, name: str, generation: int) -> bool:
    """Take the manifest name of directory ``name`` for its removal. False: it is committed
    (or another remover holds it). True also where the directory is gone already."""
    try:
        return backend.create_exclusive(manifest_path(name), abandon_record(generation))
    except StorageError:
        if backend.list_files(name):
            raise
        return True  # nothing left to claim: another remover finished first


def remove_uncommitted(backend: Backend, name: str, generation: int) -> bool:
    """Remove an uncommitted directory (rule 3); False, and nothing removed, if it turned out
    committed."""
    if not claim(backend, name, generation):
        return False
    finish_removal(backend, name)
    return True


def remove_committed(backend: Backend, name: str, generation: int) -> None:
    """Remove a committed directory: its manifest first, then the rest under a claim."""
    backend.delete_file(manifest_path(name))
    if not remove_uncommitted(backend, name, generation):
        logger.info("%s was committed again while it was removed; kept", backend.uri(name))


def finish_removal(backend: Backend, name: str) -> None:
    """Delete a claimed directory's files, then its abandon record, then the directory."""
    for file in sorted(backend.list_files(name)):
        if file != MANIFEST_NAME:
            backend.delete_file(f"{name}/{file}")
    backend.delete_file(manifest_path(name))
    backend.delete_dir(name)


def settle_created(backend: Backend, name: str, expected: Mapping[str, int], dir_generation: int) -> list[str]:
    """After this writer created the manifest of ``name``: the files found missing or short
    (rule 2's exception, and then the manifest is gone again), else []. Stats files only
    when a generation newer than the directory's exists: otherwise no one removes them."""
    if fencing.newest_marker(backend) <= dir_generation:
        return []
    missing = [file for file, size in expected.items() if backend.stat_size(f"{name}/{file}") != size]
    if missing:
        backend.delete_file(manifest_path(name))
    return missing


def discard(backend: Backend, name: str, generation: int) -> None:
    """Remove what a failed one-writer save wrote, under an abandon record: a save that
    failed after its commit (an answer lost on the way back) keeps its checkpoint. Where
    the record cannot be written (a full disk) and no manifest is there, the directory is
    this writer's alone (its name is new, and only this writer commits it): it goes as it is."""
    try:
        try:
            remove_uncommitted(backend, name, generation)
        except StorageError:
            if MANIFEST_NAME in backend.list_files(name):
                raise
            backend.delete_dir(name)
    except Exception as err:  # the next save retries; the failure that got us here matters more
        logger.warning("could not remove partial checkpoint %s: %s", backend.uri(name), err)
