"""What a store holds: its checkpoint directories listed, their manifests read and checked.

A reader's answer comes from a *settled* view (commit.py): the listing is taken again
until a second one, made after the manifests were read, agrees with it, so a manifest
created over files removed before it is never taken for whole, and an answer is never
older than the store was when the call began.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_checkfreq.errors import CheckpointNotFoundError, CorruptCheckpointError
from ray_checkfreq.storage import commit
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.legacy import Manifest, decode_any_manifest
from ray_checkfreq.storage.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, GlobalManifest, ManifestError
from ray_checkfreq.storage.names import parse_checkpoint_dir
from ray_checkfreq.storage.retention import StoredEntry

logger = logging.getLogger("ray_checkfreq.storage")

# A loser of the commit reads the winner's manifest at most this often before it gives up.
_MANIFEST_READS = 3


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint: what ``list()`` and ``latest()`` return."""

    step: int
    uri: str
    epoch_boundary: bool
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    name: str = ""
    created_unix_ns: int = 0
    size_bytes: int = 0
    writer_generation: int = 0  # 0: written before writer fencing
    trimmed: bool = False  # a near-lossless history copy (history.py): never picked by latest()
    world_size: int = 1  # the ranks that wrote it (one part each, or several per part)
    placement: str = "replicated"  # "replicated": one part of whole tensors; "sharded": a part per writer
    format_version: int = 4  # 1-2: one replica's shards (read-only); 3-4: parts


@dataclass(frozen=True)
class CommitResult:
    committed: bool  # a global manifest of the step exists (made now or before)
    by_me: bool  # this call created it
    missing_ranks: tuple[int, ...] = ()  # when not committed: the ranks no part covers yet
    ref: CheckpointRef | None = None


class _Memo:
    """Decoded manifests by directory and content digest. A manifest's bytes never change
    under its name unless it is replaced, and decoding one (parsed, then encoded twice to
    check it) takes ~0.1 s at a few thousand chunks: without the memo every listing
    decoded every manifest again."""

    def __init__(self, size: int = 16) -> None:
        self._size = size
        self._entries: OrderedDict[str, tuple[bytes, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str, data: bytes) -> Any:
        with self._lock:
            hit = self._entries.get(name)
        return hit[1] if hit is not None and hit[0] == _digest(data) else None

    def put(self, name: str, data: bytes, decoded: Any) -> None:
        with self._lock:
            self._entries[name] = (_digest(data), decoded)
            self._entries.move_to_end(name)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)


class Catalog:
    """The checkpoint directories of one backend, read and checked."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.manifests = _Memo()
        self.parts = _Memo(64)

    def scan(self, read_manifests: bool = True, *, settled: bool = False,
             only_step: int | None = None) -> list[StoredEntry]:
        """Checkpoint directories, listed again while a listed manifest vanished before it
        was read, and (``settled``, a reader's answer) until two listings agree. With
        ``only_step``, only that step's manifests are read (every directory is listed)."""
        attempts = commit.SETTLED_RESCANS if settled else commit.RESCANS
        for attempt in range(attempts):
            entries = self._scan_once(read_manifests, only_step)
            if attempt + 1 == attempts and not settled:
                return entries
            if any(e.vanished for e in entries):
                continue
            if not settled or _agrees(entries, self.backend.list_tree()):
                return entries
        raise commit.unsettled(self.backend.root_uri)

    def _scan_once(self, read_manifests: bool, only_step: int | None) -> list[StoredEntry]:
        entries = []
        for name, files in self.backend.list_tree().items():
            parsed = parse_checkpoint_dir(name)
            if parsed is not None:  # any other name is not a checkpoint: ignored
                entry = StoredEntry(name=name, step=parsed[0], generation=parsed[1], files=files)
                entry.abandoned = commit.holds_abandon_record(self.backend, name, files)
                if read_manifests and entry.committed and only_step in (None, entry.step):
                    self._read_into(entry)
                entries.append(entry)
        return entries

    def _read_into(self, entry: StoredEntry) -> None:
        location = self.backend.uri(commit.manifest_path(entry.name))
        try:
            if entry.files[MANIFEST_NAME] > MAX_MANIFEST_BYTES:  # not even read
                raise ManifestError(f"{entry.files[MANIFEST_NAME]} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
            entry.manifest = self.decoded(entry.name, commit.read_listed_manifest(self.backend, entry.name))
        except CorruptCheckpointError as err:
            entry.fault = err
        except FileNotFoundError:  # the listing is out of date: scan lists again
            entry.fault = CorruptCheckpointError(location, "manifest disappeared while reading")
            entry.vanished = True

    def decoded(self, name: str, data: bytes) -> Manifest | GlobalManifest:
        """The manifest ``data`` of directory ``name``, checked against the name."""
        known = self.manifests.get(name, data)
        if known is not None:
            return known
        location = self.backend.uri(commit.manifest_path(name))
        try:
            manifest = decode_any_manifest(data)
        except ManifestError as err:
            raise CorruptCheckpointError(location, str(err)) from None
        parsed = parse_checkpoint_dir(name)
        if parsed is not None and parsed != (manifest.step, manifest.writer_generation):
            raise CorruptCheckpointError(location, f"step {manifest.step} / generation {manifest.writer_generation} "
                                         f"do not match directory {name}")
        self.manifests.put(name, data, manifest)
        return manifest

    def load_manifest(self, name: str) -> Manifest | GlobalManifest:
        try:
            data = self.backend.read_small(commit.manifest_path(name))
        except FileNotFoundError:
            raise CorruptCheckpointError(self.backend.uri(commit.manifest_path(name)), "manifest is missing") from None
        return self.decoded(name, data)

    def global_manifest(self, name: str) -> GlobalManifest:
        """A manifest of format 3 or 4 (what a part-level reader and a delta base need)."""
        manifest = self.load_manifest(name)
        if isinstance(manifest, Manifest):
            raise CorruptCheckpointError(self.backend.uri(commit.manifest_path(name)),
                                         "a checkpoint of format 1 or 2: it has no parts")
        return manifest

    def committed(self, *, settled: bool = False, only_step: int | None = None) -> list[StoredEntry]:
        """Committed checkpoints, oldest first (by writer generation, step, commit time);
        with ``only_step``, only that step's manifests are read."""
        return sorted((e for e in self.scan(settled=settled, only_step=only_step) if e.committed),
                      key=StoredEntry.order_key)

    def ref(self, name: str, manifest: Manifest | GlobalManifest) -> CheckpointRef:
        sharded = isinstance(manifest, GlobalManifest)
        return CheckpointRef(
            step=manifest.step, uri=self.backend.uri(name), epoch_boundary=manifest.epoch_boundary,
            meta=dict(manifest.meta), name=name, created_unix_ns=manifest.created_unix_ns,
            size_bytes=manifest.size_bytes, writer_generation=manifest.writer_generation,
            trimmed=manifest.history_trim is not None,
            world_size=manifest.world_size if sharded else 1,  # type: ignore[union-attr]
            placement=manifest.attributes.placement if sharded else "replicated",  # type: ignore[union-attr]
            format_version=manifest.format_version if sharded else (  # type: ignore[union-attr]
                1 if manifest.history_trim is None else 2))

    def find(self, ref_or_step: CheckpointRef | int) -> CheckpointRef:
        """A ref is used as it is; a step resolves to its newest committed save."""
        if isinstance(ref_or_step, CheckpointRef):
            return ref_or_step
        if isinstance(ref_or_step, bool) or not isinstance(ref_or_step, int):
            raise TypeError(f"expected a CheckpointRef or a step number, got {ref_or_step!r}")
        entries = self.committed(only_step=ref_or_step)
        matches = [e for e in entries if e.step == ref_or_step]
        if not matches:
            raise CheckpointNotFoundError(f"no committed checkpoint for step {ref_or_step} in "
                                          f"{self.backend.root_uri} (steps: {[e.step for e in entries]})")
        entry = matches[-1]
        if entry.manifest is None:
            assert entry.fault is not None
            raise entry.fault
        return self.ref(entry.name, entry.manifest)

    def manifest_stands(self, name: str) -> bool:
        """Whether directory ``name`` holds a manifest (not an abandon record): one read,
        no listing. A hint (is a delta base still there?); the commit checks for itself."""
        try:
            return not commit.is_abandon_record(self.backend.read_small(commit.manifest_path(name)))
        except FileNotFoundError:
            return False

    def existing_commit(self, name: str) -> CommitResult:
        """Directory ``name`` as another writer left it: committed only where its manifest
        reads and every file it lists is there; an abandon record or a removed manifest is
        no commit."""
        for attempt in range(_MANIFEST_READS):
            try:
                data = self.backend.read_small(commit.manifest_path(name))
            except FileNotFoundError:
                return CommitResult(committed=False, by_me=False)
            if commit.is_abandon_record(data):
                return CommitResult(committed=False, by_me=False)
            try:
                manifest = self.decoded(name, data)
            except CorruptCheckpointError:
                if attempt + 1 == _MANIFEST_READS:
                    raise
                continue
            if missing_files(manifest, self.backend.list_files(name)):
                return CommitResult(committed=False, by_me=False)
            return CommitResult(committed=True, by_me=False, ref=self.ref(name, manifest))
        raise AssertionError("unreachable")


def damage(manifest: Manifest | GlobalManifest, files: Mapping[str, int]) -> str:
    """What a listing shows is wrong with a committed checkpoint's files ('' when nothing)."""
    faults = [f"{name}: data file is missing" if name not in files else
              f"{name}: truncated or grown ({files[name]} bytes, {size} recorded)"
              for name, size in manifest.expected_files().items() if files.get(name) != size]
    return "; ".join(faults[:4])


def missing_files(manifest: Manifest | GlobalManifest, files: Mapping[str, int]) -> list[str]:
    return [name for name, size in manifest.expected_files().items() if files.get(name) != size]


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _agrees(entries: Sequence[StoredEntry], after: Mapping[str, Mapping[str, int]]) -> bool:
    """Whether the listing ``after``, taken once the manifests of ``entries`` were read,
    agrees with the one they came from: the same step directories, the same manifest
    names at the same sizes, and every committed directory's files the same. Files are
    new files, never made again, so two listings that agree around the reads make a view
    that held at one moment."""
    steps = {name: files for name, files in after.items() if parse_checkpoint_dir(name) is not None}
    if set(steps) != {entry.name for entry in entries}:
        return False
    for entry in entries:
        files = steps[entry.name]
        if files.get(MANIFEST_NAME) != entry.files.get(MANIFEST_NAME):
            return False
        if entry.committed and dict(files) != entry.files:
            return False
    return True
