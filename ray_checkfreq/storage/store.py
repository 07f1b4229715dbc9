"""CheckpointStore: the one way ray_checkfreq reads and writes checkpoints, of every placement.

Layout under the root URI: one directory per checkpoint,
``step-<12 digits>-g<writer generation>-<8 hex>``, holding one part per writer (data files
``part-r<first rank>-<token>-<n>.bin``, then the part manifest ``part-r<first rank>.json``)
and, once committed, the global ``manifest.json``; ``writers/`` holds one marker per writer
generation (``fencing``). A replicated save (``save``) is one part of whole tensors in a
directory of its own; a sharded step is one part per writer (``save_part``) in the
directory every writer of a generation names alike (``dir_name``), committed by
``try_commit``. Format: ``manifest``; formats 1-2 are read by ``legacy``.

Invariants (docs/format.md):
1. The rules of every directory are ``commit.py``'s, the commit ``committer.py``'s, a part's
   ``part_writer.py``'s, and what a commit removes ``housekeeping.py``'s.
2. Writer fencing. A store that saves holds a writer generation, newer than every one
   taken before on its URI (taken at its first ``save`` or by ``acquire_writer``, handed
   over with ``writer_generation=`` or ``adopt_generation``; reading never takes one). A
   save checks for a newer generation before writing and again right before the commit,
   and raises ``FencedWriterError`` (committing nothing, withdrawing its parts).
3. Checkpoints are ordered by (writer generation, step, commit time, name): a stale
   writer's commit that slips through the window between check and commit still sorts
   below every checkpoint of the newer writer, so it never becomes the latest over them.
4. ``protected_steps`` (a picklable callable returning step numbers) names steps that
   something outside the store still points at (a Ray Train pointer checkpoint, say):
   retention keeps every checkpoint of those steps. It is asked at each retention; if it
   raises, retention deletes nothing.
5. With ``history_trim``, retention rewrites history checkpoints near-lossless; copies never
   count among the newest ``keep_last`` and are never what ``latest()`` or ``load()`` returns.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.errors import (
    CheckFreqError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedWriterError,
    StorageError,
    UnsupportedStateError,
)
from ray_checkfreq.storage import commit, committer, fencing, legacy, metadata_docs
from ray_checkfreq.storage.backends import S3Options, open_backend
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.catalog import Catalog, CheckpointRef, CommitResult, damage
from ray_checkfreq.storage.encoding import EncodeOptions
from ray_checkfreq.storage.history import HistoryTrim
from ray_checkfreq.storage.housekeeping import Housekeeper, Keep
from ray_checkfreq.storage.legacy import Manifest
from ray_checkfreq.storage.manifest import (
    MAX_CRC_BLOCK,
    MIN_CRC_BLOCK,
    CheckpointAttributes,
    GlobalManifest,
    PartManifest,
)
from ray_checkfreq.storage.names import MAX_STEP, checkpoint_dir_name
from ray_checkfreq.storage.part_files import ChunkSource, PartLayout, check_padding
from ray_checkfreq.storage.part_writer import PartContent, PartWriter, part_content
from ray_checkfreq.storage.rank_state import gathered_state, parse_rank_skeleton
from ray_checkfreq.storage.reader import BoxReader
from ray_checkfreq.storage.retention import StoredEntry, protected_steps_now
from ray_checkfreq.storage.stored_json import StoredJsonError, parse_stored_json
from ray_checkfreq.storage.tree import SkeletonError, flatten_state, unflatten_state

__all__ = ["CheckpointRef", "CheckpointStore", "ChunkSource", "CommitResult", "StoreConfig", "as_store"]

logger = logging.getLogger("ray_checkfreq.storage")

MiB = 1024 * 1024
MAX_METADATA_BYTES = 16 * MiB


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """How a CheckpointStore writes and what it keeps."""

    keep_last: int = 2
    """Newest checkpoints kept."""
    keep_epoch_boundaries: bool = True
    """Also keep every epoch-boundary checkpoint."""
    shard_size_bytes: int = 64 * MiB
    """Bytes per data file of a part."""
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
    crc_block_bytes: int = 1 * MiB
    """A ranged read checks whole blocks of this size (a power of two)."""

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
        block = self.crc_block_bytes
        if isinstance(block, bool) or not isinstance(block, int) or not MIN_CRC_BLOCK <= block <= MAX_CRC_BLOCK \
                or block & (block - 1):
            raise ValueError(f"crc_block_bytes={block!r}: must be a power of two from {MIN_CRC_BLOCK} "
                             f"to {MAX_CRC_BLOCK}")
        if not isinstance(self.keep_epoch_boundaries, bool):
            raise ValueError(f"keep_epoch_boundaries={self.keep_epoch_boundaries!r}: must be True or False")




class CheckpointStore:
    """Crash-consistent checkpoints under one URI (path, ``file://``, ``s3://``, pyarrow.fs).

    One writer generation at a time (see the module docstring): a replicated run's one
    writer, or every writer of a sharded run (the node agents), which share the generation
    taken once and handed over. Any number may read. A pickled store is a new writer and
    takes its own generation.
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
        crc_block_bytes: int = 1 * MiB,
        filesystem: Any = None,
        s3: S3Options | None = None,
        writer_generation: int | None = None,
        protected_steps: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        if protected_steps is not None and not callable(protected_steps):
            raise TypeError(f"protected_steps={protected_steps!r}: expected a callable returning step numbers")
        self.protected_steps = protected_steps
        self.config = config = StoreConfig(
            keep_last=keep_last, keep_epoch_boundaries=keep_epoch_boundaries, shard_size_bytes=shard_size_bytes,
            io_threads=io_threads, codec=codec, codec_level=codec_level, codec_threads=codec_threads,
            full_every=full_every, history_trim=history_trim, direct_io=direct_io, crc_block_bytes=crc_block_bytes)
        self._init_args = (uri, filesystem, s3)
        self.backend: Backend = open_backend(uri, filesystem=filesystem, s3=s3, direct_io=direct_io)
        self.uri = self.backend.root_uri
        self._lock = threading.Lock()
        self._slot = fencing.WriterSlot(self.backend, writer_generation)
        self._catalog = Catalog(self.backend)
        layout = PartLayout(file_bytes=shard_size_bytes, crc_block_bytes=crc_block_bytes,
                            threads=min(io_threads, self.backend.max_parallel_writes or io_threads))
        self._writer = PartWriter(self.backend, layout, full_every)
        self._housekeeper = Housekeeper(self._catalog, self._writer, Keep(
            keep_last=keep_last, keep_epoch_boundaries=keep_epoch_boundaries, history_trim=history_trim,
            codec_level=codec_level, codec_threads=config.codec_threads, io_threads=io_threads))
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

    # ------------------------------------------------------------ writer generations
    @property
    def writer_generation(self) -> int | None:
        """This store's writer generation; None until it saves or calls ``acquire_writer``."""
        return self._slot.generation

    def acquire_writer(self) -> int:
        """Take a writer generation now, fencing every older writer on this URI; returns it.

        A store that already holds one keeps it. ``save`` calls this first when needed.
        """
        with self._lock:
            return self._slot.take(max((e.generation for e in self._catalog.scan(read_manifests=False)), default=0))

    def adopt_generation(self, generation: int) -> None:
        """Write as ``generation``, taken by another writer of this run (rank 0 hands it
        over). Idempotent for the same generation; ValueError for a different one than
        this store already writes as."""
        with self._lock:
            self._slot.adopt(generation)

    def dir_name(self, step: int, generation: int | None = None) -> str:
        """The directory every writer of ``generation`` (this store's) uses for sharded ``step``."""
        generation = self._slot.require() if generation is None else generation
        suffix = hashlib.blake2b(f"{generation}:{step}".encode(), digest_size=4).hexdigest()
        return checkpoint_dir_name(step, generation, suffix)

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
        """Write ``state`` (the whole state, one replica's) as the checkpoint of ``step``;
        returns once it is committed.

        ``codec`` / ``codec_level`` override the store's defaults for this save only
        (the engine's policy turns compression off where it does not pay). ``raw_crc32``:
        the leaves' checksums in ``flatten_state`` order, computed where their bytes were
        made (a Ray slot's seal; None: computed here); the store keeps them as they are.
        """
        _check_step(step)
        attributes = CheckpointAttributes(placement="replicated", meta=_checked_meta(meta))
        options = EncodeOptions(
            codec=codec or self.config.codec,
            level=codec_level if codec_level is not None else self.config.codec_level,
            threads=self.config.codec_threads,
        )
        flat = flatten_state(state)  # refuses bad state before any I/O
        if raw_crc32 is not None and len(raw_crc32) != len(flat.leaves):
            raise ValueError(f"raw_crc32 has {len(raw_crc32)} checksums for {len(flat.leaves)} leaves")
        chunks = [ChunkSource(key=key, data=leaf, global_shape=tuple(leaf.shape), offsets=(0,) * leaf.ndim, rank=0,
                              raw_crc32=raw_crc32[index] if raw_crc32 is not None else None)
                  for index, (key, leaf) in enumerate(zip(flat.key_paths, flat.leaves))]
        content = PartContent(step=step, world_size=1, skeletons={0: {"state": flat.skeleton, "keys": flat.key_paths}},
                              chunks=chunks, epoch_boundary=bool(epoch_boundary), attributes=attributes)
        with self._lock:
            entries = self._catalog.scan(read_manifests=False)
            newest = max((e.generation for e in entries), default=0)
            generation = self._slot.take(newest)
            fencing.check_fence(self.backend, generation, newest)
            name = checkpoint_dir_name(step, generation, uuid.uuid4().hex[:8])
            try:
                base = self._writer.usable_base(options, self._catalog.manifest_stands)
                self._writer.write(name, generation, content, options, base,
                                   lambda: fencing.check_fence(self.backend, generation))
                if raw_crc32 is None:  # checksummed here: known good (given ones are checked at the load)
                    self._verified.add(name)
                result = self._commit(name, step, generation, may_create=True, fenced_before=False)
                if not result.by_me or result.ref is None:  # an abandon record took the name, or a salvage
                    raise StorageError(self.backend.uri(name), "not committed by this save: the manifest name "
                                       "was taken first (a newer writer? two writers of one generation?)")
            except BaseException as err:
                self._verified.discard(name)
                commit.discard(self.backend, name, generation)
                fencing.raise_if_fenced(err, lambda: fencing.check_fence(self.backend, generation))
                raise
        return result.ref

    def save_part(self, step: int, *, world_size: int, skeletons: Mapping[int, Any],
                  chunks: Sequence[ChunkSource], epoch_boundary: bool = False,
                  codec: str | None = None) -> PartManifest:
        """Write this writer's part of sharded ``step``: the chunks of ranks ``skeletons``
        names (each rank's non-tensor state as JSON), durable on return, encoded with
        ``codec`` (None: the config's). Raises ``FencedWriterError`` (and leaves nothing)
        when a newer generation exists. ``try_commit`` commits the step."""
        _check_step(step)
        options = EncodeOptions(codec=self.config.codec if codec is None else codec,
                                level=self.config.codec_level, threads=self.config.codec_threads)
        content = part_content(step, world_size=world_size, skeletons=skeletons, chunks=chunks,
                               epoch_boundary=epoch_boundary)
        generation = self._slot.require()
        with self._lock:
            check = lambda: fencing.check_fence(self.backend, generation)  # noqa: E731
            try:
                check()
                self._writer.learn_commit(self._committed_files)
                base = self._writer.usable_base(options, self._catalog.manifest_stands)
                return self._writer.write(self.dir_name(step), generation, content, options, base, check)
            except Exception as err:
                _withdraw_if_fenced(self._writer, err, check, generation)
                raise

    def _committed_files(self, name: str) -> frozenset[str]:
        """The files the committed manifest of sharded directory ``name`` lists; none when
        it has no readable one (a hint for the delta base: a delta's commit checks its base)."""
        try:
            manifest = self._catalog.load_manifest(name)
        except (CheckFreqError, OSError) as err:
            logger.debug("%s: not known to be committed (%s)", self.backend.uri(name), err)
            return frozenset()
        return frozenset(manifest.expected_files()) if isinstance(manifest, GlobalManifest) else frozenset()

    def try_commit(self, step: int) -> CommitResult:
        """Commit sharded ``step`` if every part is there (``committer.py``); the writer
        that commits then removes what its retention no longer keeps."""
        _check_step(step)
        generation = self._slot.require()
        name = self.dir_name(step)
        with self._lock:
            may_create = self.backend.atomic_exclusive_create or self._writer.owns_rank_zero(name)
            return self._commit(name, step, generation, may_create=may_create, fenced_before=True)

    def salvage(self) -> CheckpointRef | None:
        """Commit the newest complete but uncommitted directory of an older generation (its
        committer died after the last part), under its own generation; only when no
        checkpoint of a newer generation than that directory's is committed."""
        generation = self._slot.require()
        with self._lock:
            return committer.salvage(self._catalog, generation)

    def _commit(self, name: str, step: int, generation: int, *, may_create: bool,
                fenced_before: bool) -> CommitResult:
        """``fenced_before``: a fenced writer withdraws before it lists (a sharded poll); a
        one-part save checked the fence right before its part manifest."""
        check = lambda: fencing.check_fence(self.backend, generation)  # noqa: E731
        try:
            if fenced_before:
                check()
            result = committer.commit_dir(self._catalog, name, step, generation, fence=generation,
                                          may_create=may_create)
        except Exception as err:
            _withdraw_if_fenced(self._writer, err, check, generation)
            raise
        if result.committed:
            self._writer.committed(name)
        protected = protected_steps_now(self.protected_steps, self.uri) if result.by_me else None
        if protected is not None:  # None: the pointers are unknown, and deleting one is not safe
            try:
                self._housekeeper.after_commit(name, step, generation, protected, self._verified)
            except (CheckFreqError, OSError) as err:  # the next commit's housekeeping retries
                logger.warning("%s committed; removing older checkpoints failed: %s", self.backend.uri(name), err)
        return result

    def delete(self, ref_or_step: CheckpointRef | int) -> None:
        """Delete one committed checkpoint (manifest first)."""
        with self._lock:
            name = self._catalog.find(ref_or_step).name
            commit.remove_committed(self.backend, name, self._slot.generation or 0)

    # ------------------------------------------------------------------ listing
    def list(self, *, placement: str | None = None, step: int | None = None) -> builtins.list[CheckpointRef]:
        """Committed checkpoints, every file of them present at its recorded size, oldest
        first; only those of ``placement`` (``"replicated"`` or ``"sharded"``) when given,
        and only those of ``step`` (whose manifests alone are then read) when given.

        Ordered by writer generation, then step, then commit time: a newer writer's
        checkpoints come after every older writer's, whatever their steps.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step: expected an int or None, got {step!r}")
        refs = []
        for entry in self._catalog.committed(settled=True, only_step=step):
            if step is not None and entry.step != step:
                continue
            if entry.manifest is None:
                logger.warning("skipping checkpoint: %s", entry.fault)
            elif not entry.intact():
                logger.warning("skipping checkpoint %s: %s", self.backend.uri(entry.name),
                               damage(entry.manifest, entry.files))
            else:
                ref = self._catalog.ref(entry.name, entry.manifest)
                if placement is None or ref.placement == placement:
                    refs.append(ref)
        return refs

    def scan(self) -> builtins.list[tuple[CheckpointRef | None, str, CorruptCheckpointError | None]]:
        """Every checkpoint directory: ``(ref or None, dir name, manifest fault)``, oldest first.

        Includes uncommitted leftovers (ref None, fault None) and unreadable manifests.
        """
        return [(self._catalog.ref(e.name, e.manifest) if e.manifest else None, e.name, e.fault)
                for e in sorted(self._catalog.scan(), key=StoredEntry.order_key)]

    def latest(self) -> CheckpointRef | None:
        """The newest checkpoint that ``load()`` rebuilds: read, decoded and checked by the
        very rule ``load()`` applies, so ``load()`` returns this checkpoint's state."""
        for attempt in range(commit.RESCANS):
            for ref in _newest_whole_first(self.list()):
                try:
                    self._read(ref)  # remembers it as verified
                    return ref
                except CorruptCheckpointError as err:
                    if attempt + 1 < commit.RESCANS and not _still_listed(self.backend, ref.name):
                        break  # removed while read (a retention at work): the listing is out of date
                    logger.warning("checkpoint %s failed verification, falling back: %s", ref.uri, err)
            else:
                return None
        return None

    # ------------------------------------------------------------------ reading
    def load(self, ref_or_step: CheckpointRef | int | None = None) -> dict:
        """The state of a checkpoint; ``None`` = the newest valid exact one of either
        placement, falling back past faults (a trimmed history copy only by ref or step).

        Every byte is checked against the manifest's checksums as it is read; a
        checkpoint asked for by ref or step is not substituted when it is corrupt. A
        sharded one asked for comes gathered: every model and optimizer tensor whole (its
        ``"model"`` loads into a plain model), RNG, extra and data state as rank 0 saved
        them, all in this process's memory.
        """
        if ref_or_step is not None:
            return self._read(self._catalog.find(ref_or_step))
        faults = []
        refs = self.list()
        for ref in _newest_whole_first(refs):
            try:
                return self._read(ref)
            except CorruptCheckpointError as err:
                logger.warning("checkpoint %s is corrupt, falling back: %s", ref.uri, err)
                faults.append(str(err))
        detail = f"; faults: {faults}" if faults else ""
        trimmed = [ref.step for ref in refs if ref.trimmed]
        if trimmed:
            detail += f"; near-lossless history copies (load them by step) at steps {trimmed}"
        raise CheckpointNotFoundError(f"no valid checkpoint in {self.uri}{detail}")

    def verify(self, ref_or_step: CheckpointRef | int) -> None:
        """Raise CorruptCheckpointError naming the file unless every byte checks out and
        the checkpoint loads (what ``load()`` accepts, and every stored checksum too). A
        sharded checkpoint is read one data file at a time, every rank's skeleton checked.
        Every data file (formats 3-4) is read whole once more: its length as its part
        records it, and its alignment padding all zeros."""
        ref = self._catalog.find(ref_or_step)
        if ref.placement == "replicated":
            self._read(ref, check_stored=True)
            if isinstance(self._catalog.load_manifest(ref.name), Manifest):
                return  # formats 1-2: one blob per tensor, no padding
        reader = self.reader(ref, verify=ref.placement != "replicated")
        by_file: dict[str, builtins.list[Any]] = {}
        for chunk in (c for t in reader.manifest.tensors for c in t.chunks):
            by_file.setdefault(chunk.file, []).append(chunk)
        if ref.placement != "replicated":
            for rank, skeleton in reader.skeletons().items():
                if isinstance(skeleton, Mapping) and "format" in skeleton:  # the engine's (else the caller's own)
                    parse_rank_skeleton(skeleton, f"{ref.uri} (rank {rank}'s skeleton)")
            for chunks in by_file.values():
                reader.read_whole_chunks(chunks, 1)
        for entry in reader.manifest.parts:
            for file in entry.files:
                path = f"{ref.name}/{file.name}"
                check_padding(self.backend.read(path), file, by_file.get(file.name, []), self.backend.uri(path))

    def reader(self, ref_or_step: CheckpointRef | int, *, verify: bool = False) -> BoxReader:
        """A ranged reader of one checkpoint of format 3 or 4, any placement: boxes of its
        tensors (``load_boxes``), its ranks' skeletons (``skeletons``), its ``manifest``."""
        ref = self._catalog.find(ref_or_step)
        return BoxReader(self.backend, ref.name, self._catalog.global_manifest(ref.name),
                         codec_threads=self.config.codec_threads, base_manifest=self._catalog.global_manifest,
                         verify=verify)

    def _read(self, ref: CheckpointRef, *, check_stored: bool = False) -> Any:
        manifest = self._catalog.load_manifest(ref.name)
        if isinstance(manifest, Manifest):
            skeleton = manifest.state
            leaves = legacy.read_leaves(self.backend, ref.name, manifest,
                                        (self.config.io_threads, self.config.codec_threads), build=True,
                                        check_stored=check_stored)
        elif manifest.attributes.placement != "replicated":  # gathered whole, as one replica's state
            state = gathered_state(self.reader(ref, verify=check_stored), ref.uri)
            self._verified.add(ref.name)
            return state
        else:
            reader = self.reader(ref, verify=check_stored)
            skeleton, _, chunks = reader.whole_state()
            leaves = reader.read_whole_chunks(chunks, self.config.io_threads)
        try:
            state = unflatten_state(skeleton, leaves)
        except SkeletonError as err:
            raise CorruptCheckpointError(self.backend.uri(commit.manifest_path(ref.name)),
                                         f"state skeleton: {err}") from None
        self._verified.add(ref.name)
        return state

    def write_metadata(self, name: str, data: dict) -> None:
        """Store a small JSON document (a cached profile, say) beside the checkpoints."""
        metadata_docs.write_metadata(self.backend, name, data)

    def read_metadata(self, name: str) -> dict | None:
        """A document written by ``write_metadata``; None if absent or unreadable (a
        warning names the file). The caller checks the document's schema."""
        return metadata_docs.read_metadata(self.backend, name)

    def close(self) -> None:
        self.backend.close()


def as_store(storage: str | CheckpointStore) -> CheckpointStore:
    """``storage`` as a store: a store as it is, a URI or path opened with the defaults."""
    if isinstance(storage, CheckpointStore):
        return storage
    if not isinstance(storage, str):
        raise TypeError(f"storage={storage!r}: expected a URI, a path or a CheckpointStore")
    return CheckpointStore(storage)


def _withdraw_if_fenced(writer: PartWriter, err: Exception, check: Callable[[], None], generation: int) -> None:
    """A write or commit that failed because a newer generation took over (its housekeeping
    removed files under it, say): withdraw this writer's parts and raise FencedWriterError."""
    try:
        if isinstance(err, FencedWriterError):
            raise err
        fencing.raise_if_fenced(err, check)
    except FencedWriterError:
        writer.withdraw(generation)
        raise


def _newest_whole_first(refs: builtins.list[CheckpointRef]) -> builtins.list[CheckpointRef]:
    """What a resume may ``load()``, newest first: exact checkpoints of either placement, a
    sharded one gathered whole (never a trimmed copy)."""
    return [ref for ref in reversed(refs) if not ref.trimmed]


def _still_listed(backend: Backend, name: str) -> bool:
    try:
        commit.read_listed_manifest(backend, name)
    except FileNotFoundError:
        return False
    return True


def _rebuild_store(uri: str, kwargs: dict) -> CheckpointStore:
    return CheckpointStore(uri, **kwargs)


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step={step!r}: must be an int from 0 to {MAX_STEP}")


def _checked_meta(meta: dict | None) -> dict:
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
