"""CheckpointStore: the one way ray_checkfreq reads and writes checkpoints.

Layout under the root URI: one directory per checkpoint,
``step-<12 digits>-g<writer generation>-<8 hex>``, holding shard files and
``manifest.json``; ``writers/`` holds one marker per writer generation (see ``fencing``).
Commit protocol (invariants; the rules every directory follows are ``commit.py``'s):

1. Shards are new files in a new directory (a random suffix, so a re-saved step never
   touches the files of an earlier save of that step).
2. The manifest is written last, after every shard is durable, with an exclusive create;
   a directory without a manifest is not a checkpoint. A created manifest is final
   (``commit.settle_created`` names the one exception: a newer writer emptied the
   directory before it appeared).
3. Writer fencing. A store that saves holds a writer generation, newer than every one
   taken before on its URI (taken at its first save or by ``acquire_writer``; reading
   never takes one). A save checks for a newer generation before writing and again
   right before the commit, and raises ``FencedWriterError`` (committing nothing) when
   there is one.
4. Checkpoints are ordered by (writer generation, step, commit time, name): a stale
   writer's commit that slips through the window between check and commit still sorts
   below every checkpoint of the newer writer, so it never becomes the latest over them.
5. Housekeeping never touches a newer writer's checkpoints or in-flight directories. It
   removes in-flight directories of its own or older generations under an abandon record
   (``commit.claim``): an older writer that passed its last check before this one took
   its generation either commits first (and its directory stays) or finds the record.
6. Retention runs only after the new manifest is durable, deletes a checkpoint's
   manifest before its shards (an interrupted delete leaves an uncommitted directory,
   never a committed one with holes), stops counting at ``keep_last`` checkpoints whose
   shards are all present at their recorded sizes, and never deletes the checkpoint just
   saved nor the newest one this store object verified (read in full) or wrote.
7. ``protected_steps`` (a picklable callable returning step numbers) names steps that
   something outside the store still points at (a Ray Train pointer checkpoint, say):
   retention keeps every checkpoint of those steps. It is asked at each retention, so a
   pointer that went away stops protecting; if it raises, retention deletes nothing.
8. With ``history_trim``, retention rewrites history checkpoints near-lossless (see
   ``history``): the copy commits before its source is deleted; copies never count among
   the newest ``keep_last`` and are never what ``latest()`` or ``load()`` returns.
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_checkfreq.errors import (
    CheckFreqError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedWriterError,
    StorageError,
    UnsupportedStateError,
)
from ray_checkfreq.storage import commit, fencing, legacy, metadata_docs
from ray_checkfreq.storage.backends import S3Options, open_backend
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.chunks import Box, whole
from ray_checkfreq.storage.encoding import EncodeOptions, copy_leaf
from ray_checkfreq.storage.history import HistoryTrim
from ray_checkfreq.storage.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError
from ray_checkfreq.storage.names import MAX_GENERATION, MAX_STEP, checkpoint_dir_name, parse_checkpoint_dir
from ray_checkfreq.storage.part_files import ChunkSource, PartLayout, write_part_files
from ray_checkfreq.storage.retention import StoredEntry, plan_retention, protected_steps_now, removable
from ray_checkfreq.storage.sharded_load import BoxReader
from ray_checkfreq.storage.sharded_manifest import (
    CheckpointAttributes,
    ChunkRecord,
    PartManifest,
    ShardedManifest,
    decode_any_manifest,
    decode_part,
    encode_global,
    encode_part,
    merge_parts,
    replicated_skeleton,
)
from ray_checkfreq.storage.sharded_store import ShardedStore
from ray_checkfreq.storage.stored_json import StoredJsonError, parse_stored_json
from ray_checkfreq.storage.tree import SkeletonError, flatten_state, unflatten_state

logger = logging.getLogger("ray_checkfreq.storage")

MiB = 1024 * 1024
MAX_METADATA_BYTES = 16 * MiB
CRC_BLOCK_BYTES = 1 * MiB  # a ranged read of a replicated checkpoint checks blocks of this size


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """How a CheckpointStore writes and what it keeps."""

    keep_last: int = 2
    """Newest checkpoints kept."""
    keep_epoch_boundaries: bool = True
    """Also keep every epoch-boundary checkpoint."""
    shard_size_bytes: int = 64 * MiB
    """Bytes per shard file."""
    io_threads: int = 4
    """Parallel shard writes and reads (a local filesystem writes one shard at a time: parallel writes there cost CPU
    and gain nothing)."""
    codec: str = "rcfz"
    """``"rcfz"`` (byte grouping + zstd) or ``"raw"``."""
    codec_level: int | None = None
    """zstd level (None: the codec's default)."""
    codec_threads: int | None = None
    """Encoder threads (None: the codec's default)."""
    full_every: int = 8
    """A full checkpoint at least every N saves, XOR deltas between (1: no deltas)."""
    history_trim: HistoryTrim | None = None  # keep history checkpoints near-lossless (history.py)
    """A ``HistoryTrim``: keep epoch-boundary history near-lossless."""
    direct_io: bool = True  # local stores: large shards around the page cache (backends/direct.py)
    """Local stores: shards of 1 MiB and more written around the page cache (``O_DIRECT``) where the filesystem takes
    it; False: buffered writes (e.g. a network filesystem where direct writes are slow)."""

    def __post_init__(self) -> None:
        if self.history_trim is not None and not isinstance(self.history_trim, HistoryTrim):
            raise TypeError(f"history_trim={self.history_trim!r}: expected a HistoryTrim or None")
        if self.history_trim is not None and not self.keep_epoch_boundaries:
            raise ValueError("history_trim needs keep_epoch_boundaries=True (it trims the epoch boundaries kept)")
        EncodeOptions(codec=self.codec, level=self.codec_level, threads=self.codec_threads)
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"full_every={self.full_every!r}: must be an int >= 1 (1 = no deltas)")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"keep_last={self.keep_last!r}: must be an int >= 1")
        if not isinstance(self.shard_size_bytes, int) or self.shard_size_bytes < 1:
            raise ValueError(f"shard_size_bytes={self.shard_size_bytes!r}: must be an int >= 1")
        if not isinstance(self.direct_io, bool):
            raise ValueError(f"direct_io={self.direct_io!r}: must be True or False")
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ValueError(f"io_threads={self.io_threads!r}: must be an int >= 1")


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


@dataclass
class _DeltaBase:
    """The newest full checkpoint written by this store object, kept for deltas."""

    name: str
    chunks: dict[tuple[str, Box, int], Any]  # (key, whole box, rank 0) -> a private copy
    saves_since: int = 0


@dataclass
class _Loaded:
    """A replicated checkpoint read back: its skeleton, and its leaves in skeleton order."""

    skeleton: Any
    keys: builtins.list[str]
    leaves: builtins.list[Any]


class CheckpointStore:
    """Crash-consistent checkpoints under one URI (path, ``file://``, ``s3://``, pyarrow.fs).

    One writer at a time: a store that saves takes a writer generation (see the module
    docstring), and a save from a store whose generation a newer writer has superseded
    raises ``FencedWriterError``. Any number may read. ``writer_generation`` adopts a
    generation taken by ``acquire_writer`` elsewhere (one writer, handed over); a pickled
    store is a new writer and takes its own.
    """

    def __init__(
        self,
        uri: str,
        *,
        keep_last: int = 2,
        keep_epoch_boundaries: bool = True,
        shard_size_bytes: int = 64 * MiB,
        io_threads: int = 4,
        codec: str = "rcfz",
        codec_level: int | None = None,
        codec_threads: int | None = None,
        full_every: int = 8,
        history_trim: HistoryTrim | None = None,
        direct_io: bool = True,
        filesystem: Any = None,
        s3: S3Options | None = None,
        writer_generation: int | None = None,
        protected_steps: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        if protected_steps is not None and not callable(protected_steps):
            raise TypeError(f"protected_steps={protected_steps!r}: expected a callable returning step numbers")
        self.protected_steps = protected_steps
        self.config = StoreConfig(
            keep_last=keep_last,
            keep_epoch_boundaries=keep_epoch_boundaries,
            shard_size_bytes=shard_size_bytes,
            io_threads=io_threads,
            codec=codec,
            codec_level=codec_level,
            codec_threads=codec_threads,
            full_every=full_every,
            history_trim=history_trim,
            direct_io=direct_io,
        )
        self._init_args = (uri, filesystem, s3)
        self.backend: Backend = open_backend(uri, filesystem=filesystem, s3=s3, direct_io=direct_io)
        self.uri = self.backend.root_uri
        self._lock = threading.Lock()
        self._base: _DeltaBase | None = None
        self._generation = _checked_generation(writer_generation)
        self._generation_confirmed = False
        self._verified: set[str] = set()  # checkpoints this object wrote or read in full

    def __reduce__(self) -> tuple:
        uri, filesystem, s3 = self._init_args
        kwargs = dict(vars(self.config), filesystem=filesystem, s3=s3, protected_steps=self.protected_steps)
        return (_rebuild_store, (uri, kwargs))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r}, keep_last={self.config.keep_last})"

    def with_writer(self, generation: int) -> CheckpointStore:
        """A store on the same URI and settings that writes as ``generation`` (handed over)."""
        uri, filesystem, s3 = self._init_args
        return CheckpointStore(uri, **vars(self.config), filesystem=filesystem, s3=s3, writer_generation=generation,
                               protected_steps=self.protected_steps)

    def sharded_twin(self) -> ShardedStore:
        """A ``ShardedStore`` on this store's URI, filesystem and S3 options, with its codec
        and retention: where a sharded (DTensor) state's checkpoints go, beside this store's
        metadata documents and under the same writer generations."""
        uri, filesystem, s3 = self._init_args
        config = self.config
        return ShardedStore(uri, filesystem=filesystem, s3=s3, direct_io=config.direct_io,
                            protected_steps=self.protected_steps, codec=config.codec, codec_level=config.codec_level,
                            codec_threads=config.codec_threads, io_threads=config.io_threads,
                            keep_last=config.keep_last, keep_epoch_boundaries=config.keep_epoch_boundaries,
                            full_every=config.full_every)

    # ------------------------------------------------------------------ writing
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        epoch_boundary: bool = False,
        meta: dict | None = None,
        codec: str | None = None,
        codec_level: int | None = None,
        raw_crc32: Sequence[int | None] | None = None,
    ) -> CheckpointRef:
        """Write ``state`` as the checkpoint of ``step``; returns once it is committed.

        ``codec`` / ``codec_level`` override the store's defaults for this save only
        (the engine's policy turns compression off where it does not pay). ``raw_crc32``:
        the leaves' checksums in ``flatten_state`` order, computed where their bytes were
        made (a Ray slot's seal; None: computed here); the store keeps them as they are.
        """
        _check_step(step)
        meta = _checked_meta(meta)
        options = EncodeOptions(
            codec=codec or self.config.codec,
            level=codec_level if codec_level is not None else self.config.codec_level,
            threads=self.config.codec_threads,
        )
        flat = flatten_state(state)  # refuses bad state before any I/O
        if raw_crc32 is not None and len(raw_crc32) != len(flat.leaves):
            raise ValueError(f"raw_crc32 has {len(raw_crc32)} checksums for {len(flat.leaves)} leaves")
        known_crcs = list(raw_crc32) if raw_crc32 is not None else None
        with self._lock:
            entries = self._scan(read_manifests=False)
            generation = self._writer(entries)
            self._check_fence(entries)
            self._delete_leftovers(entries)
            name = checkpoint_dir_name(step, generation, uuid.uuid4().hex[:8])
            base = self._usable_base(options)
            try:
                manifest = self._write_checkpoint(name, step, flat, epoch_boundary, meta, options, base,
                                                  known_crcs=known_crcs)
            except BaseException as err:
                self._discard(name)
                self._raise_if_fenced(err)
                raise
            self._remember_base(name, manifest, flat, options)
            if known_crcs is None:  # checksummed here: known good (given ones are checked at the load)
                self._verified.add(name)
            self._apply_retention(just_saved=name)
        return self._ref(name, manifest)

    # ------------------------------------------------------------ writer fencing
    @property
    def writer_generation(self) -> int | None:
        """This store's writer generation; None until it saves or calls ``acquire_writer``."""
        return self._generation

    def acquire_writer(self) -> int:
        """Take a writer generation now, fencing every older writer on this URI; returns it.

        A store that already holds one keeps it. ``save`` calls this first when needed.
        """
        with self._lock:
            return self._writer(self._scan(read_manifests=False))

    def _writer(self, entries: builtins.list[StoredEntry]) -> int:
        if self._generation is None:
            in_use = max((e.generation for e in entries), default=0)
            self._generation = fencing.acquire_generation(self.backend, in_use)
            logger.info("%s: writer generation %d taken", self.uri, self._generation)
        elif not self._generation_confirmed and not fencing.has_marker(self.backend, self._generation):
            raise StorageError(
                self.backend.uri(fencing.marker_path(self._generation)),
                f"writer generation {self._generation} was never taken on this URI (see acquire_writer)",
            )
        self._generation_confirmed = True
        return self._generation

    def _check_fence(self, entries: builtins.list[StoredEntry] | None = None) -> None:
        """Raise FencedWriterError if a newer writer has taken this URI.

        With ``entries`` (a scan made anyway) it looks only at their directory names: a
        cheap early check; the one right before the commit reads the markers.
        """
        assert self._generation is not None
        if entries is None:
            newest = fencing.newest_marker(self.backend)
        else:
            newest = max((e.generation for e in entries), default=0)
        if newest > self._generation:
            raise FencedWriterError(self.uri, self._generation, newest)

    def _raise_if_fenced(self, err: BaseException) -> None:
        """A save that failed because a newer writer took over says so."""
        if self._generation is not None:
            fencing.raise_if_fenced(err, self._check_fence)

    def _usable_base(self, options: EncodeOptions) -> _DeltaBase | None:
        base = self._base
        if options.codec != "rcfz" or base is None or base.saves_since >= self.config.full_every - 1:
            return None
        return base

    def _remember_base(self, name: str, manifest: ShardedManifest, flat: Any, options: EncodeOptions) -> None:
        """Keep a private copy of a full checkpoint's leaves as the base of the next deltas."""
        if manifest.delta_bases:
            assert self._base is not None
            self._base.saves_since += 1
        elif options.codec == "rcfz" and self.config.full_every > 1:
            self._base = _DeltaBase(name=name, chunks=_whole_chunks(flat.key_paths, map(copy_leaf, flat.leaves)))
        else:
            self._base = None

    def _write_checkpoint(self, name: str, step: int, flat: Any, epoch_boundary: bool, meta: dict,
                          options: EncodeOptions, base: _DeltaBase | None, *,
                          history_trim: dict | None = None,
                          known_crcs: list[int | None] | None = None) -> ShardedManifest:
        """One part of whole-tensor chunks (the replicated placement), then the manifest."""
        generation = self._generation
        assert generation is not None
        self.backend.make_dir(name)
        chunks = [ChunkSource(key=key, data=leaf, global_shape=tuple(leaf.shape), offsets=(0,) * leaf.ndim, rank=0,
                              raw_crc32=known_crcs[index] if known_crcs else None)
                  for index, (key, leaf) in enumerate(zip(flat.key_paths, flat.leaves))]
        layout = PartLayout(file_bytes=self.config.shard_size_bytes, crc_block_bytes=CRC_BLOCK_BYTES,
                            threads=min(self.config.io_threads,
                                        self.backend.max_parallel_writes or self.config.io_threads))
        files, records = write_part_files(self.backend, name, 0, uuid.uuid4().hex[:8], chunks, options, layout, [],
                                          base.chunks if base is not None else None)
        part = PartManifest(
            step=step, writer_generation=generation, world_size=1, ranks=(0,), epoch_boundary=bool(epoch_boundary),
            created_unix_ns=time.time_ns(), files=files, chunks=records,
            skeletons={0: {"state": flat.skeleton, "keys": flat.key_paths}},
            delta_base=base.name if base is not None and any(r.delta for r in records) else None,
            attributes=CheckpointAttributes(placement="replicated", meta=meta, history_trim=history_trim))
        data = encode_part(part)
        if not self.backend.create_exclusive(f"{name}/{part.name}", data):
            raise StorageError(self.backend.uri(f"{name}/{part.name}"), "a part is there already: two writers "
                               "share a generation?")
        try:
            manifest = merge_parts(step, generation, 1, part.created_unix_ns, [(part, len(data), crc32(data))])
        except ManifestError as err:  # the state made a manifest a reader would refuse
            raise UnsupportedStateError("<root>", str(err)) from None
        self._check_fence()
        self._commit(name, manifest)
        return manifest

    def _commit(self, name: str, manifest: ShardedManifest) -> None:
        path = commit.manifest_path(name)
        expected = manifest.expected_files()
        files = self.backend.list_files(name)
        short = [file for file, size in expected.items() if files.get(file) != size]
        if short:  # checked before the create: a created manifest is final
            raise StorageError(self.backend.uri(name), f"files {short} missing or short before the commit: "
                               "not committed")
        if not self.backend.create_exclusive(path, encode_global(manifest)):
            raise StorageError(self.backend.uri(path), "a manifest is there already: two writers share a generation?")
        generation = self._generation or 0
        if commit.settle_created(self.backend, name, expected, generation):
            raise FencedWriterError(self.uri, generation, fencing.newest_marker(self.backend))

    def _discard(self, name: str) -> None:
        """Remove what a failed save wrote, under an abandon record: a save that failed after
        its commit (an answer lost on the way back) keeps its checkpoint. Where the record
        cannot be written (a full disk) and no manifest is there, the directory is this
        writer's alone (its name is new, and only this writer commits it): it goes as it is."""
        try:
            try:
                commit.remove_uncommitted(self.backend, name, self._generation or 0)
            except StorageError:
                if MANIFEST_NAME in self.backend.list_files(name):
                    raise
                self.backend.delete_dir(name)
        except Exception as err:  # the next save retries; the failure that got us here matters more
            logger.warning("could not remove partial checkpoint %s: %s", self.backend.uri(name), err)

    # ------------------------------------------------------------ housekeeping
    def _delete_leftovers(self, entries: builtins.list[StoredEntry]) -> None:
        protected = self._protected()
        if protected is None:
            return  # the pointers are unknown: keeping too much is safe, deleting one is not
        for entry in entries:
            if not entry.committed and removable(entry, self._generation) \
                    and (entry.abandoned or entry.step not in protected):
                logger.info("removing interrupted save %s", self.backend.uri(entry.name))
                if entry.abandoned:
                    commit.finish_removal(self.backend, entry.name)  # its remover died on the way
                else:
                    commit.remove_uncommitted(self.backend, entry.name, self._generation or 0)
        self.backend.clean_staging(commit.STALE_STAGING_S)

    def _apply_retention(self, just_saved: str) -> None:
        """Execute ``plan_retention`` over the committed checkpoints."""
        protected = self._protected()
        if protected is None:
            return
        entries = self._committed()
        trim = self.config.history_trim
        plan = plan_retention(
            entries, keep_last=self.config.keep_last, keep_epoch_boundaries=self.config.keep_epoch_boundaries,
            protected_steps=protected, just_saved=just_saved,
            newest_verified=next((e.name for e in reversed(entries) if e.name in self._verified), None),
            writer_generation=self._generation, trim=trim is not None,
            delta_base_in_use=self._base.name if self._base is not None else None)
        for name in plan.delete:
            self._delete(name)
        self._verified &= plan.keep
        if trim is not None:
            self._trim_history(trim, [e for e in entries if e.name in plan.keep], plan.rewrite, plan.drop_copied)

    def _trim_history(self, trim: HistoryTrim, kept: builtins.list[StoredEntry], rewrite: Sequence[str],
                      drop_copied: Sequence[str]) -> None:
        """Rewrite ``rewrite`` trimmed, then delete them and ``drop_copied`` (history.py's
        invariants 2 and 4: the copy commits before its source goes; a failure keeps the source)."""
        by_name = {e.name: e for e in kept}
        for name in [*rewrite, *drop_copied]:
            try:
                if name in rewrite:
                    self._write_trimmed_copy(trim, by_name[name], [e for e in kept if e.trimmed])
                self._delete(name)
                self._verified.discard(name)
            except (CheckFreqError, OSError) as err:
                logger.warning("%s: history checkpoint %s kept exact, trimming failed: %s", self.uri, name, err)

    def _write_trimmed_copy(self, trim: HistoryTrim, entry: StoredEntry, trimmed: builtins.list[StoredEntry]) -> None:
        assert entry.manifest is not None
        loaded = self._read_leaves(self._ref(entry.name, entry.manifest))
        state = unflatten_state(loaded.skeleton, [trim.trim_leaf(leaf) for leaf in loaded.leaves])
        base = self._trimmed_delta_base(trim, trimmed)
        options = EncodeOptions(codec="rcfz", level=self.config.codec_level, threads=self.config.codec_threads)
        name = checkpoint_dir_name(entry.step, self._generation or 0, uuid.uuid4().hex[:8])
        try:
            self._write_checkpoint(name, entry.step, flatten_state(state), True, dict(entry.manifest.meta), options,
                                   base, history_trim=trim.describe(entry.name))
        except BaseException:
            self._discard(name)
            raise
        logger.info("%s: history checkpoint %s rewritten trimmed as %s", self.uri, entry.name, name)

    def _trimmed_delta_base(self, trim: HistoryTrim, trimmed: builtins.list[StoredEntry]) -> _DeltaBase | None:
        """The newest full trimmed copy with room for another delta, with its leaves by key."""
        fulls = [e for e in trimmed if e.manifest is not None and not e.manifest.delta_bases]
        if not fulls or trim.full_every == 1:
            return None
        newest = fulls[-1]
        deltas = sum(1 for e in trimmed if e.manifest is not None and newest.name in e.manifest.delta_bases)
        if deltas >= trim.full_every - 1:
            return None
        assert newest.manifest is not None
        try:
            loaded = self._read_leaves(self._ref(newest.name, newest.manifest))
        except CheckFreqError as err:
            logger.warning("%s: trimmed copy %s unusable as a delta base: %s", self.uri, newest.name, err)
            return None
        if isinstance(newest.manifest, Manifest):
            return None  # a format 2 copy: the next copy is full (a delta's base is format 4)
        return _DeltaBase(name=newest.name, chunks=_whole_chunks(loaded.keys, loaded.leaves))

    def _protected(self) -> set[int] | None:
        return protected_steps_now(self.protected_steps, self.uri)

    def _delete(self, name: str) -> None:
        # Uncommit first: an interrupted delete must not leave a manifest without shards.
        commit.remove_committed(self.backend, name, self._generation or 0)

    def delete(self, ref_or_step: CheckpointRef | int) -> None:
        """Delete one committed checkpoint (manifest first)."""
        with self._lock:
            if isinstance(ref_or_step, CheckpointRef):
                name = ref_or_step.name
            else:
                matches = [e.name for e in self._committed() if e.step == ref_or_step]
                if not matches:
                    raise CheckpointNotFoundError(f"no committed checkpoint for step {ref_or_step} in {self.uri}")
                name = matches[-1]
            self._delete(name)

    # ------------------------------------------------------------------ listing
    def _scan(self, read_manifests: bool = True, *, settled: bool = False) -> builtins.list[StoredEntry]:
        """Checkpoint directories, listed again while a listed manifest vanished before it
        was read, and (``settled``, a reader's answer) while a step directory appeared
        meanwhile: never a view older than one a reader could have had (commit.py)."""
        attempts = commit.SETTLED_RESCANS if settled else commit.RESCANS
        for attempt in range(attempts):
            entries = self._scan_once(read_manifests)
            if attempt + 1 == attempts and not settled:
                return entries
            if not any(e.vanished for e in entries) \
                    and not (settled and commit.new_step_dirs(self.backend, (e.name for e in entries))):
                return entries
        raise commit.unsettled(self.uri)

    def _scan_once(self, read_manifests: bool) -> builtins.list[StoredEntry]:
        entries = []
        for name, files in self.backend.list_tree().items():
            parsed = parse_checkpoint_dir(name)
            if parsed is not None:  # any other name is not a checkpoint: ignored
                entry = StoredEntry(name=name, step=parsed[0], generation=parsed[1], files=files)
                entry.abandoned = commit.holds_abandon_record(self.backend, name, files)
                if read_manifests and entry.committed:
                    self._read_manifest_into(entry)
                entries.append(entry)
        return entries

    def _read_manifest_into(self, entry: StoredEntry) -> None:
        location = self.backend.uri(f"{entry.name}/{MANIFEST_NAME}")
        try:
            if entry.files[MANIFEST_NAME] > MAX_MANIFEST_BYTES:  # not even read
                raise ManifestError(f"{entry.files[MANIFEST_NAME]} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
            entry.manifest = decode_any_manifest(commit.read_listed_manifest(self.backend, entry.name))
            if entry.manifest.step != entry.step:
                raise ManifestError(f"step {entry.manifest.step} does not match directory {entry.name}")
            if entry.manifest.writer_generation != entry.generation:
                raise ManifestError(
                    f"writer generation {entry.manifest.writer_generation} does not match directory {entry.name}"
                )
        except ManifestError as err:
            entry.manifest = None
            entry.fault = CorruptCheckpointError(location, str(err))
        except FileNotFoundError:  # the listing is out of date: _scan lists again
            entry.fault = CorruptCheckpointError(location, "manifest disappeared while reading")
            entry.vanished = True

    def _committed(self, *, settled: bool = False) -> builtins.list[StoredEntry]:
        """Committed checkpoints, oldest first (by writer generation, step, commit time)."""
        return sorted((e for e in self._scan(settled=settled) if e.committed), key=StoredEntry.order_key)

    def list(self) -> builtins.list[CheckpointRef]:
        """Committed checkpoints whose manifest is readable, oldest first.

        Ordered by writer generation, then step, then commit time: a newer writer's
        checkpoints come after every older writer's, whatever their steps.
        """
        refs = []
        for entry in self._committed(settled=True):
            if entry.manifest is None:
                logger.warning("skipping checkpoint: %s", entry.fault)
            elif _whole_state(entry.manifest):  # a sharded run's steps are restored rank by rank
                refs.append(self._ref(entry.name, entry.manifest))
        return refs

    def scan(self) -> builtins.list[tuple[CheckpointRef | None, str, CorruptCheckpointError | None]]:
        """Every checkpoint directory: ``(ref or None, dir name, manifest fault)``, oldest first.

        Includes uncommitted leftovers (ref None, fault None) and unreadable manifests.
        """
        rows = []
        for entry in sorted(self._scan(), key=StoredEntry.order_key):
            ref = self._ref(entry.name, entry.manifest) if entry.manifest else None
            rows.append((ref, entry.name, entry.fault))
        return rows

    def latest(self) -> CheckpointRef | None:
        """The newest checkpoint that loads: read, decoded and checked by the very rule
        ``load()`` applies, so ``load()`` returns this checkpoint's state."""
        for attempt in range(commit.RESCANS):
            for ref in self._newest_first():
                try:
                    self._read(ref)  # remembers it as verified
                    return ref
                except CorruptCheckpointError as err:
                    if attempt + 1 < commit.RESCANS and not self._still_committed(ref):
                        break  # removed while read (a retention at work): the listing is out of date
                    logger.warning("checkpoint %s failed verification, falling back: %s", ref.uri, err)
            else:
                return None
        return None

    def _still_committed(self, ref: CheckpointRef) -> bool:
        try:
            commit.read_listed_manifest(self.backend, ref.name)
        except FileNotFoundError:
            return False
        return True

    def _newest_first(self) -> Iterator[CheckpointRef]:
        """Exact checkpoints, newest first: what a resume may read (never a trimmed copy)."""
        return reversed([ref for ref in self.list() if not ref.trimmed])

    def _ref(self, name: str, manifest: Manifest | ShardedManifest) -> CheckpointRef:
        return CheckpointRef(
            step=manifest.step,
            uri=self.backend.uri(name),
            epoch_boundary=manifest.epoch_boundary,
            meta=dict(manifest.meta),
            name=name,
            created_unix_ns=manifest.created_unix_ns,
            size_bytes=manifest.size_bytes,
            writer_generation=manifest.writer_generation,
            trimmed=manifest.history_trim is not None,
        )

    def _find(self, ref_or_step: CheckpointRef | int) -> CheckpointRef:
        """A ref is used as it is; a step resolves to its newest committed save."""
        if isinstance(ref_or_step, CheckpointRef):
            return ref_or_step
        if isinstance(ref_or_step, bool) or not isinstance(ref_or_step, int):
            raise TypeError(f"expected a CheckpointRef or a step number, got {ref_or_step!r}")
        entries = self._committed()
        matches = [e for e in entries if e.step == ref_or_step]
        if not matches:
            steps = [e.step for e in entries]
            raise CheckpointNotFoundError(
                f"no committed checkpoint for step {ref_or_step} in {self.uri} (steps: {steps})"
            )
        entry = matches[-1]
        if entry.manifest is None:
            assert entry.fault is not None
            raise entry.fault
        return self._ref(entry.name, entry.manifest)

    # ------------------------------------------------------------------ reading
    def load(self, ref_or_step: CheckpointRef | int | None = None) -> dict:
        """The state of a checkpoint; ``None`` = newest valid one, falling back past faults.

        Every byte is checked against the manifest's checksums as it is read; a
        checkpoint asked for by ref or step is not substituted when it is corrupt.
        """
        if ref_or_step is not None:
            return self._read(self._find(ref_or_step))
        faults = []
        for ref in self._newest_first():
            try:
                return self._read(ref)
            except CorruptCheckpointError as err:
                logger.warning("checkpoint %s is corrupt, falling back: %s", ref.uri, err)
                faults.append(str(err))
        detail = f"; faults: {faults}" if faults else ""
        trimmed = [ref.step for ref in self.list() if ref.trimmed]
        if trimmed:
            detail += f"; near-lossless history copies (load them by step) at steps {trimmed}"
        raise CheckpointNotFoundError(f"no valid checkpoint in {self.uri}{detail}")

    def verify(self, ref_or_step: CheckpointRef | int) -> None:
        """Raise CorruptCheckpointError naming the file unless every byte checks out and
        the checkpoint loads (what ``load()`` accepts, and every stored checksum too)."""
        self._read(self._find(ref_or_step), check_stored=True)

    def _read(self, ref: CheckpointRef, *, check_stored: bool = False) -> Any:
        loaded = self._read_leaves(ref, check_stored=check_stored)
        try:
            state = unflatten_state(loaded.skeleton, loaded.leaves)
        except SkeletonError as err:
            raise CorruptCheckpointError(self._manifest_uri(ref), f"state skeleton: {err}") from None
        self._verified.add(ref.name)
        return state

    def _read_leaves(self, ref: CheckpointRef, *, check_stored: bool = False) -> _Loaded:
        manifest = self._load_manifest(ref.name)
        if isinstance(manifest, Manifest):
            leaves = legacy.read_leaves(self.backend, ref.name, manifest,
                                        (self.config.io_threads, self.config.codec_threads), build=True,
                                        check_stored=check_stored)
            return _Loaded(manifest.state, [t.key for t in manifest.tensors], leaves)
        if not _whole_state(manifest):
            raise CorruptCheckpointError(self._manifest_uri(ref), "a sharded checkpoint (one part per rank): "
                                         "restore it through the engine or export it (ray-checkfreq export)")
        skeleton, keys, chunks = self._replicated_layout(ref, manifest)
        reader = BoxReader(self.backend, ref.name, manifest, codec_threads=self.config.codec_threads,
                           base_manifest=self._base_manifest, verify=check_stored)
        return _Loaded(skeleton, keys, reader.read_whole_chunks(chunks, self.config.io_threads))

    def _replicated_layout(self, ref: CheckpointRef,
                           manifest: ShardedManifest) -> tuple[Any, builtins.list[str], builtins.list[ChunkRecord]]:
        """The state skeleton, leaf keys and whole chunks of a replicated checkpoint, its one
        part manifest checked against what the global manifest records."""
        (entry,) = manifest.parts
        path = f"{ref.name}/{entry.name}"
        try:
            data = self.backend.read_small(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(self.backend.uri(path), "part manifest is missing") from None
        if len(data) != entry.size_bytes or crc32(data) != entry.crc32:
            raise CorruptCheckpointError(self.backend.uri(path), "part manifest differs from what the global "
                                         "manifest records")
        try:
            skeleton, keys = replicated_skeleton(decode_part(data, name=entry.name), manifest)
        except ManifestError as err:
            raise CorruptCheckpointError(self.backend.uri(path), str(err)) from None
        return skeleton, keys, [manifest.tensor(key).chunks[0] for key in keys]  # type: ignore[union-attr]

    def _base_manifest(self, name: str) -> ShardedManifest:
        """A delta base's global manifest (format 4: the only one a delta refers to)."""
        manifest = self._load_manifest(name)
        if isinstance(manifest, Manifest):
            raise CorruptCheckpointError(self.backend.uri(commit.manifest_path(name)), "a format 1 checkpoint "
                                         "named as the base of a format 4 delta")
        return manifest

    def _manifest_uri(self, ref: CheckpointRef) -> str:
        return self.backend.uri(commit.manifest_path(ref.name))

    def _load_manifest(self, name: str) -> Manifest | ShardedManifest:
        location = self.backend.uri(commit.manifest_path(name))
        try:
            manifest = decode_any_manifest(self.backend.read_small(commit.manifest_path(name)))
        except FileNotFoundError:
            raise CorruptCheckpointError(location, "manifest is missing") from None
        except ManifestError as err:
            raise CorruptCheckpointError(location, str(err)) from None
        parsed = parse_checkpoint_dir(name)
        if isinstance(manifest, ShardedManifest) and parsed not in (None, (manifest.step, manifest.writer_generation)):
            raise CorruptCheckpointError(location, f"step {manifest.step} / generation {manifest.writer_generation} "
                                         f"do not match directory {name}")
        return manifest

    def write_metadata(self, name: str, data: dict) -> None:
        """Store a small JSON document (a cached profile, say) beside the checkpoints."""
        metadata_docs.write_metadata(self.backend, name, data)

    def read_metadata(self, name: str) -> dict | None:
        """A document written by ``write_metadata``; None if absent or unreadable (a
        warning names the file). The caller checks the document's schema."""
        return metadata_docs.read_metadata(self.backend, name)

    def close(self) -> None:
        self.backend.close()


def _checked_generation(generation: Any) -> int | None:
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)
                                   or not 1 <= generation <= MAX_GENERATION):
        raise ValueError(f"writer_generation={generation!r}: must be an int from 1 to {MAX_GENERATION} "
                         "(from acquire_writer) or None")
    return generation


def _rebuild_store(uri: str, kwargs: dict) -> CheckpointStore:
    return CheckpointStore(uri, **kwargs)


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step={step!r}: must be an int from 0 to {MAX_STEP}")


def _checked_meta(meta: dict | None) -> dict:
    import json

    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise UnsupportedStateError("meta", "meta must be a dict with str keys")
    try:
        text = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise UnsupportedStateError("meta", f"not JSON-serialisable: {err}") from None
    try:  # within the limits a reader checks (one level more: it sits inside the manifest)
        return parse_stored_json(f"[{text}]".encode(), max_bytes=MAX_METADATA_BYTES)[0]
    except StoredJsonError as err:
        raise UnsupportedStateError("meta", str(err)) from None


def _whole_chunks(keys: Iterable[str], leaves: Iterable[Any]) -> dict[tuple[str, Box, int], Any]:
    return {(key, whole(tuple(leaf.shape)), 0): leaf for key, leaf in zip(keys, leaves)}


def _whole_state(manifest: Manifest | ShardedManifest) -> bool:
    """Whether ``load()`` rebuilds the checkpoint's state: formats 1-2, or a replicated one."""
    return isinstance(manifest, Manifest) or manifest.attributes.placement == "replicated"
