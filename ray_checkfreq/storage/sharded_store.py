"""Sharded checkpoints: N writers (one per node agent), one atomic commit.

Layout: the directories of ``CheckpointStore`` (``step-<step>-g<generation>-<8 hex>``,
``writers/`` markers) under the same URI. Every writer of generation ``g`` saving step
``s`` writes into the one directory whose suffix is a hash of ``(g, s)``: its data files
``part-r<first rank>-<token>-<n>.bin``, then, exclusively, its part manifest
``part-r<first rank>.json``. Format and fields: ``sharded_manifest``.

Commit protocol (invariants, docs/format.md "Sharded checkpoints"; the rules every
directory follows are ``commit.py``'s):

1. A part manifest is created only after its data files are durable, exclusively, and
   only by a writer whose generation is still the newest (checked right before).
2. ``try_commit``: a writer fenced by a newer generation withdraws its part (under an
   abandon record, ``commit.claim``: never in a committed directory) and raises
   ``FencedWriterError``. Otherwise it lists the directory; if the part manifests cover
   ranks ``0..world_size-1`` exactly once, every data file they list is there at its
   recorded size and every tensor's chunks tile it exactly once, it checks the fence
   again and creates ``manifest.json`` exclusively. So there is exactly one commit (the
   create is exclusive; a loser finds the manifest and reports it committed only once it
   reads it and finds every file), and never a global manifest with a part missing. A
   created manifest is final (``commit.settle_created`` names the one exception). Where
   the storage has no atomic exclusive create, only the writer of rank 0 creates it.
3. A directory's generation is its writers': a writer of an older generation cannot add a
   part to a newer generation's step (its parts go to its own directory, and its fence
   check fails), cannot commit it, and cannot hide it: checkpoints are ordered by
   (generation, step, commit time) and housekeeping never touches a newer generation.
4. Only the writer that *just committed* step ``s`` runs housekeeping: it removes
   manifest-less directories of older generations and of its own with a smaller step
   (every writer of ``g`` finished its commits of those before it wrote its part of ``s``),
   and applies retention; never a step ``protected_steps`` names.
5. ``salvage``: a new generation commits an old generation's directory whose parts are
   all there but whose committer died, under the directory's generation, when no
   checkpoint of a newer generation than that directory's is committed.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ray_checkfreq.errors import (
    CheckFreqError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedWriterError,
    StorageError,
)
from ray_checkfreq.storage import commit, fencing, metadata_docs
from ray_checkfreq.storage.backends import S3Options, open_backend
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.chunks import Box
from ray_checkfreq.storage.encoding import EncodeOptions, copy_leaf
from ray_checkfreq.storage.manifest import MAX_MANIFEST_BYTES, ManifestError
from ray_checkfreq.storage.names import MAX_GENERATION, MAX_STEP, checkpoint_dir_name, parse_checkpoint_dir
from ray_checkfreq.storage.part_files import ChunkSource, PartLayout, write_part_files
from ray_checkfreq.storage.retention import protected_steps_now
from ray_checkfreq.storage.sharded_load import BoxReader
from ray_checkfreq.storage.sharded_manifest import (
    GLOBAL_MANIFEST_NAME,
    MAX_CRC_BLOCK,
    MAX_WORLD_SIZE,
    MIN_CRC_BLOCK,
    PART_MANIFEST,
    ChunkRecord,
    PartFile,
    PartManifest,
    ShardedManifest,
    decode_global,
    decode_part,
    encode_global,
    encode_part,
    is_sharded_manifest,
    merge_parts,
    part_manifest_name,
)
from ray_checkfreq.storage.stored_json import StoredJsonError, parse_stored_json

logger = logging.getLogger("ray_checkfreq.storage")

MiB = 1024 * 1024
Decoded = TypeVar("Decoded")
MAX_SKELETON_BYTES = 16 * MiB
# A loser of the commit reads the winner's manifest at most this often before it gives up.
_MANIFEST_READS = 3
# The newest steps whose parts this writer remembers (withdrawn if it is fenced); one
# checkpoint is in flight at a time, so older ones are settled.
_OWN_KEPT = 8


@dataclass(frozen=True, kw_only=True)
class ShardedConfig:
    """How a ShardedStore writes and what it keeps."""

    codec: str = "raw"
    codec_level: int | None = None
    codec_threads: int | None = None
    part_file_bytes: int = 64 * MiB  # data files of about this size per part
    crc_block_bytes: int = 1 * MiB  # a ranged read checks whole blocks of this size
    io_threads: int = 4
    keep_last: int = 2
    keep_epoch_boundaries: bool = True
    full_every: int = 1  # a full part at least every N saves of a writer, rcfz XOR deltas between (1: none)

    def __post_init__(self) -> None:
        EncodeOptions(codec=self.codec, level=self.codec_level, threads=self.codec_threads)
        for name in ("part_file_bytes", "io_threads", "keep_last", "full_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        block = self.crc_block_bytes
        if isinstance(block, bool) or not isinstance(block, int) or not MIN_CRC_BLOCK <= block <= MAX_CRC_BLOCK \
                or block & (block - 1):
            raise ValueError(f"crc_block_bytes={block!r}: must be a power of two from {MIN_CRC_BLOCK} "
                             f"to {MAX_CRC_BLOCK}")
        if not isinstance(self.keep_epoch_boundaries, bool):
            raise ValueError(f"keep_epoch_boundaries={self.keep_epoch_boundaries!r}: must be True or False")


@dataclass(frozen=True)
class ShardedRef:
    """A committed sharded checkpoint."""

    step: int
    name: str
    uri: str
    writer_generation: int
    world_size: int
    epoch_boundary: bool
    created_unix_ns: int
    size_bytes: int
    placement: str = "sharded"  # "replicated": written by CheckpointStore.save (one part)


@dataclass(frozen=True)
class CommitResult:
    committed: bool  # a global manifest of the step exists (made now or before)
    by_me: bool  # this call created it
    missing_ranks: tuple[int, ...] = ()  # when not committed: the ranks no part covers yet
    ref: ShardedRef | None = None


@dataclass(frozen=True)
class _OwnPart:
    """What this writer wrote of one step: its part manifest, data files and ranks."""

    manifest: str
    files: builtins.list[str]
    ranks: tuple[int, ...]


@dataclass
class _ChunkBase:
    """The chunks of this writer's newest committed full part: the base of its next deltas."""

    name: str  # the directory
    chunks: dict[tuple[str, Box, int], Any]  # (key, box, rank) -> a private copy
    saves_since: int = 0


@dataclass
class _Dir:
    name: str
    step: int
    generation: int
    files: dict[str, int]
    manifest: ShardedManifest | None = None
    abandoned: bool = False  # its manifest name holds an abandon record (commit.py)

    @property
    def committed(self) -> bool:
        return GLOBAL_MANIFEST_NAME in self.files and not self.abandoned

    def intact(self) -> bool:
        return self.manifest is not None and _missing_files(self.manifest, self.files) == []

    def order_key(self) -> tuple[int, int, int, str]:
        created = self.manifest.created_unix_ns if self.manifest else 0
        return (self.generation, self.step, created, self.name)


class _ManifestMemo(Generic[Decoded]):
    """Decoded manifests by path and content digest. A manifest's bytes never change under
    its name unless it is replaced, and decoding one (parsed, then encoded twice to check
    it) takes ~0.1 s at a few thousand chunks: without the memo a restore decoded each
    global manifest at every listing, and rank 0's commit poll every part at every poll."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._entries: OrderedDict[str, tuple[bytes, Decoded]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _digest(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=16).digest()

    def get(self, name: str, data: bytes) -> Decoded | None:
        with self._lock:
            hit = self._entries.get(name)
        return hit[1] if hit is not None and hit[0] == self._digest(data) else None

    def put(self, name: str, data: bytes, manifest: Decoded) -> None:
        with self._lock:
            self._entries[name] = (self._digest(data), manifest)
            self._entries.move_to_end(name)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)


class ShardedStore:
    """Sharded checkpoints under one URI (path, ``file://``, ``s3://``, pyarrow.fs).

    Every writer of one generation (the node agents of one run) shares the generation
    taken once (``acquire_writer``) and handed over (``writer_generation=g``).
    """

    def __init__(self, uri: str, *, writer_generation: int | None = None, filesystem: Any = None,
                 s3: S3Options | None = None, direct_io: bool = True,
                 protected_steps: Callable[[], Iterable[int]] | None = None, **config: Any) -> None:
        self.config = ShardedConfig(**config)
        if writer_generation is not None and (isinstance(writer_generation, bool)
                                              or not isinstance(writer_generation, int)
                                              or not 1 <= writer_generation <= MAX_GENERATION):
            raise ValueError(f"writer_generation={writer_generation!r}: must be an int from 1 to {MAX_GENERATION}")
        if protected_steps is not None and not callable(protected_steps):
            raise TypeError(f"protected_steps={protected_steps!r}: expected a callable returning step numbers")
        self.protected_steps = protected_steps
        self.backend: Backend = open_backend(uri, filesystem=filesystem, s3=s3, direct_io=direct_io)
        self.uri = self.backend.root_uri
        self._generation = writer_generation
        self._lock = threading.Lock()
        self._own: dict[int, _OwnPart] = {}  # step -> what this writer wrote of it
        self._base: _ChunkBase | None = None
        # The step of the newest part written and, if it was full, its chunks: the base once committed.
        self._pending: tuple[int, _ChunkBase | None] | None = None
        self._decoded: _ManifestMemo[ShardedManifest] = _ManifestMemo()
        self._decoded_parts: _ManifestMemo[PartManifest] = _ManifestMemo(64)

    def __repr__(self) -> str:
        return f"ShardedStore({self.uri!r}, writer_generation={self._generation})"

    # ------------------------------------------------------------ generations
    @property
    def writer_generation(self) -> int | None:
        return self._generation

    def acquire_writer(self) -> int:
        """Take a writer generation newer than every one on this URI (once per run)."""
        if self._generation is None:
            in_use = max((d.generation for d in self._scan(read_manifests=False)), default=0)
            self._generation = fencing.acquire_generation(self.backend, in_use)
        return self._generation

    def adopt_generation(self, generation: int) -> None:
        """Write as ``generation``, taken by another writer of this run (rank 0 hands it
        over). Idempotent for the same generation; ValueError for a different one than
        this store already writes as."""
        if isinstance(generation, bool) or not isinstance(generation, int) \
                or not 1 <= generation <= MAX_GENERATION:
            raise ValueError(f"generation={generation!r}: must be an int from 1 to {MAX_GENERATION}")
        with self._lock:
            if self._generation is not None and self._generation != generation:
                raise ValueError(f"{self.uri}: this store writes as generation {self._generation}, "
                                 f"cannot adopt generation {generation}")
            self._generation = generation

    # ------------------------------------------------------------ metadata documents
    def write_metadata(self, name: str, data: dict) -> None:
        """Store a small JSON document (a cached profile, say) beside the checkpoints."""
        metadata_docs.write_metadata(self.backend, name, data)

    def read_metadata(self, name: str) -> dict | None:
        """A document written by ``write_metadata``; None if absent or unreadable."""
        return metadata_docs.read_metadata(self.backend, name)

    def dir_name(self, step: int, generation: int | None = None) -> str:
        """The directory every writer of ``generation`` uses for ``step``."""
        generation = self._require_generation() if generation is None else generation
        suffix = hashlib.blake2b(f"{generation}:{step}".encode(), digest_size=4).hexdigest()
        return checkpoint_dir_name(step, generation, suffix)

    def _require_generation(self) -> int:
        if self._generation is None:
            raise StorageError(self.uri, "this ShardedStore has no writer generation (acquire_writer, or "
                               "writer_generation=g handed over from the one that took it)")
        return self._generation

    def _check_fence(self, generation: int) -> None:
        newest = fencing.newest_marker(self.backend)
        if newest > generation:
            raise FencedWriterError(self.uri, generation, newest)

    # ------------------------------------------------------------ writing a part
    def save_part(self, step: int, *, world_size: int, skeletons: Mapping[int, Any],
                  chunks: Sequence[ChunkSource], epoch_boundary: bool = False,
                  codec: str | None = None) -> PartManifest:
        """Write this writer's part of ``step``: the chunks of ranks ``skeletons`` names
        (each rank's non-tensor state as JSON), durable on return, encoded with ``codec``
        (None: the config's). Raises ``FencedWriterError`` (and leaves nothing) when a
        newer generation exists."""
        _check_step(step)
        options = EncodeOptions(codec=self.config.codec if codec is None else codec,
                                level=self.config.codec_level, threads=self.config.codec_threads)
        ranks = _checked_ranks(skeletons, world_size)
        checked = {rank: _checked_json(skeletons[rank], f"skeleton of rank {rank}") for rank in ranks}
        for chunk in chunks:
            _check_chunk(chunk, set(ranks))
        generation = self._require_generation()
        with self._lock:
            name = self.dir_name(step)
            token = uuid.uuid4().hex[:8]
            written: list[str] = []
            part_tried = False
            base = self._usable_base(options)
            try:
                self._check_fence(generation)
                self._ensure_dir(name)
                files, records = self._write_data(name, ranks[0], token, chunks, options, written, base)
                delta_base = base.name if base is not None and any(r.delta for r in records) else None
                part = PartManifest(step=step, writer_generation=generation, world_size=world_size, ranks=ranks,
                                    epoch_boundary=bool(epoch_boundary), created_unix_ns=time.time_ns(),
                                    files=files, chunks=records, skeletons=checked, delta_base=delta_base)
                self._check_fence(generation)
                path = f"{name}/{part.name}"
                part_tried = True
                if not self.backend.create_exclusive(path, encode_part(part)):
                    part_tried = False  # the part there is another writer's: not ours to remove
                    raise StorageError(self.backend.uri(path), "a part for these ranks is there already: two "
                                       "writers of one generation claim the same ranks?")
            except BaseException as err:
                part_file = part_manifest_name(ranks[0]) if part_tried else None
                self._abandon_part(name, written, part_file, generation)
                if isinstance(err, Exception):
                    self._withdraw_if_fenced(err, generation)
                raise
            self._own[step] = _OwnPart(part.name, written, ranks)
            self._pending = (step, None if delta_base is not None else self._new_base(name, chunks, options))
            for stale in sorted(self._own)[:-_OWN_KEPT]:
                # A step another rank committed never comes back here; one this long unanswered
                # is committed or is left to the housekeeping of a later commit.
                del self._own[stale]
        return part

    def _abandon_part(self, name: str, written: Sequence[str], part_file: str | None, generation: int) -> None:
        """Remove what a failed ``save_part`` wrote. Data files no part manifest lists are
        this writer's alone; once its part manifest may exist, a committer may be counting
        on them, so they go under an abandon record (``commit.claim``)."""
        try:
            if part_file is None:
                self._delete_files(name, written)
            else:
                self._remove_own(name, [part_file, *written], generation)
        except Exception as err:  # the failure that got us here matters more; housekeeping retries
            logger.warning("could not remove the partial part in %s: %s", self.backend.uri(name), err)

    # ------------------------------------------------------------ delta bases
    def _usable_base(self, options: EncodeOptions) -> _ChunkBase | None:
        """The base of this save's deltas: None (a full part) unless one is due and the base
        is still a committed checkpoint (another writer's housekeeping may have removed one
        that no kept checkpoint refers to)."""
        base = self._base
        if options.codec != "rcfz" or base is None or base.saves_since >= self.config.full_every - 1:
            return None
        if not self._existing_commit(base.name).committed:
            self._base = None
            return None
        return base

    def _new_base(self, name: str, chunks: Sequence[ChunkSource], options: EncodeOptions) -> _ChunkBase | None:
        """A private copy of a full part's chunks, the base of later deltas once it commits."""
        if options.codec != "rcfz" or self.config.full_every == 1:
            return None
        return _ChunkBase(name=name, chunks={(c.key, c.box, c.rank): copy_leaf(c.data) for c in chunks})

    def _note_committed(self, step: int) -> None:
        """The step's commit makes its full part the base, or counts one more delta of the base."""
        if self._pending is None or self._pending[0] != step:
            return
        new_base = self._pending[1]
        self._pending = None
        if new_base is not None:
            self._base = new_base
        elif self._base is not None:
            self._base.saves_since += 1

    def _check_bases(self, name: str, manifest: ShardedManifest) -> None:
        """A delta is only as good as its base: commit only while every base is committed."""
        for base in sorted(manifest.delta_bases):
            if not self._existing_commit(base).committed:
                raise StorageError(self.backend.uri(name), f"its delta base {base} is not a committed checkpoint "
                                   "(removed?): not committed")

    def _ensure_dir(self, name: str) -> None:
        """The step's directory, made by whichever writer comes first."""
        try:
            self.backend.make_dir(name)
        except StorageError:
            if name not in self.backend.list_dirs():
                raise

    def _remove_own(self, name: str, files: Sequence[str], generation: int) -> None:
        """Delete this writer's ``files`` of ``name`` under an abandon record, then the
        record: unless the directory is committed (then they are a checkpoint's)."""
        if not commit.claim(self.backend, name, generation):
            return
        self._delete_files(name, files)
        self.backend.delete_file(commit.manifest_path(name))

    def _write_data(self, name: str, first_rank: int, token: str, chunks: Sequence[ChunkSource],
                    options: EncodeOptions, written: list[str],
                    base: _ChunkBase | None) -> tuple[tuple[PartFile, ...], tuple[ChunkRecord, ...]]:
        layout = PartLayout(file_bytes=self.config.part_file_bytes, crc_block_bytes=self.config.crc_block_bytes,
                            threads=min(self.config.io_threads,
                                        self.backend.max_parallel_writes or self.config.io_threads))
        return write_part_files(self.backend, name, first_rank, token, chunks, options, layout, written,
                                base.chunks if base is not None else None)

    def _delete_files(self, name: str, files: Sequence[str]) -> None:
        for file in files:
            try:
                self.backend.delete_file(f"{name}/{file}")
            except Exception as err:  # the next committer's housekeeping removes the directory
                logger.warning("could not remove %s: %s", self.backend.uri(f"{name}/{file}"), err)

    # ------------------------------------------------------------ the commit
    def try_commit(self, step: int) -> CommitResult:
        """Commit ``step`` if every part is there (see the module docstring, invariant 2)."""
        _check_step(step)
        generation = self._require_generation()
        name = self.dir_name(step)
        with self._lock:
            try:
                self._check_fence(generation)
            except FencedWriterError:
                self._withdraw()
                raise
            try:
                result = self._commit_dir(name, step, generation, fence=generation,
                                          may_create=self._may_create(step))
            except Exception as err:
                self._withdraw_if_fenced(err, generation)
                raise
            if result.committed:
                self._own.pop(step, None)  # a checkpoint's files now, never withdrawn
                self._note_committed(step)
            if result.by_me:
                self._housekeeping_after(name, step, generation)
        return result

    def _may_create(self, step: int) -> bool:
        """Whether this writer may create the global manifest: any writer where the create
        is atomic; else only rank 0's (check-then-write must not race between writers)."""
        own = self._own.get(step)
        return self.backend.atomic_exclusive_create or (own is not None and 0 in own.ranks)

    def _housekeeping_after(self, name: str, step: int, generation: int) -> None:
        """Housekeeping after a durable commit: its failure (another committer removing the
        same directory, say) is logged, not raised; the next commit's housekeeping retries."""
        try:
            self._housekeeping(name, step, generation)
        except (CheckFreqError, OSError) as err:
            logger.warning("%s committed; removing older checkpoints failed: %s", self.backend.uri(name), err)

    def _withdraw_if_fenced(self, err: Exception, generation: int) -> None:
        """A commit that failed because a newer generation took over (its housekeeping removed
        files under it, say): withdraw this writer's parts and raise ``FencedWriterError``."""
        try:
            if isinstance(err, FencedWriterError):
                raise err
            fencing.raise_if_fenced(err, lambda: self._check_fence(generation))
        except FencedWriterError:
            self._withdraw()
            raise

    def _withdraw(self) -> None:
        """A fenced writer leaves nothing: it removes the directory of every step of its own
        it saw uncommitted, under an abandon record. No writer of its generation can commit
        there any more; a salvage that wins the record first keeps it committed."""
        generation = self._require_generation()
        for step in sorted(self._own):
            del self._own[step]
            commit.remove_uncommitted(self.backend, self.dir_name(step), generation)

    def _commit_dir(self, name: str, step: int, generation: int, *, fence: int,
                    may_create: bool = True) -> CommitResult:
        files = self.backend.list_files(name)
        if GLOBAL_MANIFEST_NAME in files:
            return self._existing_commit(name)
        parts = self._read_parts(name, files, step, generation)
        if not parts:
            return CommitResult(committed=False, by_me=False, missing_ranks=())
        world_size = parts[0][0].world_size
        missing = sorted(set(range(world_size)) - {r for p, _, _ in parts for r in p.ranks})
        if missing:
            return CommitResult(committed=False, by_me=False, missing_ranks=tuple(missing))
        try:
            manifest = merge_parts(step, generation, world_size, time.time_ns(), parts)
        except ManifestError as err:
            raise CorruptCheckpointError(self.backend.uri(name), f"its parts do not make a checkpoint: {err}") from None
        lost = _missing_files(manifest, files)
        if lost:
            raise StorageError(self.backend.uri(name), f"files {lost[:8]} missing or short: not committed")
        if not may_create:
            return CommitResult(committed=False, by_me=False)
        self._check_bases(name, manifest)
        self._check_fence(fence)
        if not self.backend.create_exclusive(commit.manifest_path(name), encode_global(manifest)):
            return self._existing_commit(name)
        emptied = commit.settle_created(self.backend, name, _expected_files(manifest), generation)
        if emptied:
            self._raise_emptied(name, generation, fence, emptied)
        logger.info("%s: committed sharded step %d (%d parts)", self.uri, step, len(parts))
        return CommitResult(committed=True, by_me=True, ref=self._ref(name, manifest))

    def _raise_emptied(self, name: str, generation: int, fence: int, emptied: builtins.list[str]) -> None:
        """A manifest created over files a newer generation had removed (commit.py, rule 2)."""
        newest = fencing.newest_marker(self.backend)
        if fence == generation:
            raise FencedWriterError(self.uri, generation, newest)
        raise StorageError(self.backend.uri(name), f"files {emptied[:8]} were removed by generation {newest}: "
                           "not salvaged")

    def _existing_commit(self, name: str) -> CommitResult:
        """The step as another writer left it: committed only where its manifest reads and
        every file it lists is there; an abandon record or a removed manifest is no commit."""
        path = commit.manifest_path(name)
        for attempt in range(_MANIFEST_READS):
            try:
                data = self.backend.read_small(path)
            except FileNotFoundError:
                return CommitResult(committed=False, by_me=False)
            if commit.is_abandon_record(data):
                return CommitResult(committed=False, by_me=False)
            try:
                manifest = self._checked_global(name, data)
            except CorruptCheckpointError:
                if attempt + 1 == _MANIFEST_READS:
                    raise
                continue
            if _missing_files(manifest, self.backend.list_files(name)):
                return CommitResult(committed=False, by_me=False)
            return CommitResult(committed=True, by_me=False, ref=self._ref(name, manifest))
        raise AssertionError("unreachable")

    def _read_parts(self, name: str, files: dict[str, int], step: int,
                    generation: int) -> list[tuple[PartManifest, int, int]]:
        parts = []
        for file in sorted(f for f in files if PART_MANIFEST.match(f)):
            location = self.backend.uri(f"{name}/{file}")
            if files[file] > MAX_MANIFEST_BYTES:
                raise CorruptCheckpointError(location, f"{files[file]} bytes, more than {MAX_MANIFEST_BYTES}")
            try:
                data = self.backend.read_small(f"{name}/{file}")
                part = self._decode_part(f"{name}/{file}", data)
            except FileNotFoundError:
                raise CorruptCheckpointError(location, "part manifest disappeared while reading") from None
            except ManifestError as err:
                raise CorruptCheckpointError(location, str(err)) from None
            if (part.step, part.writer_generation) != (step, generation):
                raise CorruptCheckpointError(location, f"step {part.step} of generation {part.writer_generation} "
                                             f"in the directory of step {step}, generation {generation}")
            parts.append((part, len(data), crc32(data)))
        sizes = {p.world_size for p, _, _ in parts}
        if len(sizes) > 1:
            raise CorruptCheckpointError(self.backend.uri(name), f"parts disagree on the world size: {sorted(sizes)}")
        seen: dict[int, str] = {}
        for part, _, _ in parts:
            for rank in part.ranks:
                if rank in seen:
                    raise CorruptCheckpointError(self.backend.uri(name), f"rank {rank} is in two parts: "
                                                 f"{seen[rank]} and {part.name}")
                seen[rank] = part.name
        return parts

    def _decode_part(self, path: str, data: bytes) -> PartManifest:
        part = self._decoded_parts.get(path, data)
        if part is None:
            part = decode_part(data, name=path.rpartition("/")[2])
            self._decoded_parts.put(path, data, part)
        return part

    # ------------------------------------------------------------ salvage
    def salvage(self) -> ShardedRef | None:
        """Commit the newest complete but uncommitted directory of an older generation
        (its committer died after the last part), under its own generation; only when no
        checkpoint of a newer generation than that directory's is committed."""
        generation = self._require_generation()
        with self._lock:
            self._check_fence(generation)
            dirs = self._scan()
            newest_committed = max((d.generation for d in dirs if d.manifest is not None), default=0)
            candidates = sorted((d for d in dirs if not d.committed and not d.abandoned
                                 and newest_committed <= d.generation < generation),
                                key=_Dir.order_key, reverse=True)
            for entry in candidates:
                try:
                    result = self._commit_dir(entry.name, entry.step, entry.generation, fence=generation)
                except (CorruptCheckpointError, StorageError) as err:
                    if isinstance(err, FencedWriterError):
                        raise
                    logger.warning("not salvaged: %s", err)
                    continue
                if result.committed:
                    logger.info("%s: salvaged %s", self.uri, entry.name)
                    return result.ref
        return None

    # ------------------------------------------------------------ housekeeping
    def _housekeeping(self, just_committed: str, step: int, generation: int) -> None:
        protected = self._protected()
        if protected is None:
            return  # the pointers are unknown: keeping too much is safe, deleting one is not
        dirs = self._scan()
        for entry in dirs:
            older = entry.generation < generation or (entry.generation == generation and entry.step < step)
            # An abandoned directory is no checkpoint a pointer can name; another one is kept
            # while its step is protected (a pointer names steps, not directories).
            if older and not entry.committed and (entry.abandoned or entry.step not in protected):
                self._remove_interrupted(entry, generation)
        committed = sorted((d for d in dirs if d.manifest is not None), key=_Dir.order_key)
        keep = {just_committed} | {d.name for d in committed if d.step in protected}
        kept_intact = 0
        for entry in reversed(committed):
            if kept_intact >= self.config.keep_last:
                break
            keep.add(entry.name)
            kept_intact += entry.intact()
        if self.config.keep_epoch_boundaries:
            keep |= {d.name for d in committed if d.manifest is not None and d.manifest.epoch_boundary and d.intact()}
        # A delta is only as good as its base: keep every base a kept checkpoint refers to,
        # and the one this writer's next deltas refer to.
        keep |= {base for d in committed if d.name in keep and d.manifest for base in d.manifest.delta_bases}
        if self._base is not None:
            keep.add(self._base.name)
        for entry in committed:
            if entry.name not in keep and entry.generation <= generation:
                commit.remove_committed(self.backend, entry.name, generation)
        self.backend.clean_staging(commit.STALE_STAGING_S)

    def _remove_interrupted(self, entry: _Dir, generation: int) -> None:
        logger.info("removing interrupted sharded save %s", self.backend.uri(entry.name))
        if entry.abandoned:
            commit.finish_removal(self.backend, entry.name)  # its remover died on the way
        else:
            commit.remove_uncommitted(self.backend, entry.name, generation)

    def _protected(self) -> set[int] | None:
        return protected_steps_now(self.protected_steps, self.uri)

    # ------------------------------------------------------------ listing
    def _scan(self, read_manifests: bool = True, *, settled: bool = False) -> builtins.list[_Dir]:
        """Checkpoint directories; ``manifest`` set where a valid v3 global manifest is.
        ``settled`` (what a reader's answer needs: never a view older than one it could
        have had, commit.py): taken again until a second listing, after the manifests were
        read, agrees with the first (``_settle``)."""
        attempts = commit.SETTLED_RESCANS if settled else commit.RESCANS
        for attempt in range(attempts):
            try:
                dirs = self._scan_once(read_manifests, last=attempt + 1 == attempts and not settled)
            except FileNotFoundError:
                continue  # a manifest went between the listing and its read: list again
            if not settled or _settle(dirs, self.backend.list_tree()):
                return dirs
        raise commit.unsettled(self.uri)

    def _scan_once(self, read_manifests: bool, *, last: bool) -> builtins.list[_Dir]:
        dirs = []
        for name, files in self.backend.list_tree().items():
            parsed = parse_checkpoint_dir(name)
            if parsed is None:
                continue
            entry = _Dir(name=name, step=parsed[0], generation=parsed[1], files=files,
                         abandoned=commit.holds_abandon_record(self.backend, name, files))
            if read_manifests and entry.committed:
                try:
                    entry.manifest = self._try_read_global(entry)
                except FileNotFoundError:
                    if not last:
                        raise
            dirs.append(entry)
        return dirs

    def _try_read_global(self, entry: _Dir) -> ShardedManifest | None:
        location = self.backend.uri(f"{entry.name}/{GLOBAL_MANIFEST_NAME}")
        try:
            if entry.files[GLOBAL_MANIFEST_NAME] > MAX_MANIFEST_BYTES:
                raise CorruptCheckpointError(location, "manifest larger than allowed")
            data = commit.read_listed_manifest(self.backend, entry.name)
            known = self._decoded.get(entry.name, data)
            if known is not None:
                return known
            if not is_sharded_manifest(data):
                return None  # a CheckpointStore checkpoint (format 1 or 2): not this store's
            manifest = self._checked_global(entry.name, data)
        except CorruptCheckpointError as err:
            logger.warning("skipping sharded checkpoint: %s", err)
            return None
        return manifest

    def _read_global(self, name: str) -> ShardedManifest:
        location = self.backend.uri(f"{name}/{GLOBAL_MANIFEST_NAME}")
        try:
            data = self.backend.read_small(f"{name}/{GLOBAL_MANIFEST_NAME}")
        except FileNotFoundError:
            raise CorruptCheckpointError(location, "manifest is missing") from None
        return self._checked_global(name, data)

    def _checked_global(self, name: str, data: bytes) -> ShardedManifest:
        known = self._decoded.get(name, data)
        if known is not None:
            return known
        location = self.backend.uri(f"{name}/{GLOBAL_MANIFEST_NAME}")
        try:
            manifest = decode_global(data)
        except ManifestError as err:
            raise CorruptCheckpointError(location, str(err)) from None
        if parse_checkpoint_dir(name) != (manifest.step, manifest.writer_generation):
            raise CorruptCheckpointError(location, f"step {manifest.step} / generation {manifest.writer_generation} "
                                         f"do not match directory {name}")
        self._decoded.put(name, data, manifest)
        return manifest

    def list(self, *, replicated: bool = False) -> builtins.list[ShardedRef]:
        """Complete sharded checkpoints (valid global manifest, every file at its size), oldest
        first; with ``replicated``, those of ``CheckpointStore.save`` (one part) as well."""
        dirs = sorted((d for d in self._scan(settled=True) if d.intact()), key=_Dir.order_key)
        return [self._ref(d.name, d.manifest) for d in dirs if d.manifest is not None
                and (replicated or d.manifest.attributes.placement == "sharded")]

    def latest(self) -> ShardedRef | None:
        """The newest complete sharded checkpoint (bytes are checked as they are loaded)."""
        refs = self.list()
        return refs[-1] if refs else None

    def _ref(self, name: str, manifest: ShardedManifest) -> ShardedRef:
        return ShardedRef(step=manifest.step, name=name, uri=self.backend.uri(name),
                          writer_generation=manifest.writer_generation, world_size=manifest.world_size,
                          epoch_boundary=manifest.epoch_boundary, created_unix_ns=manifest.created_unix_ns,
                          size_bytes=manifest.size_bytes, placement=manifest.attributes.placement)

    def _find(self, ref_or_step: ShardedRef | int) -> ShardedRef:
        if isinstance(ref_or_step, ShardedRef):
            return ref_or_step
        matches = [r for r in self.list(replicated=True) if r.step == ref_or_step]
        if not matches:
            raise CheckpointNotFoundError(f"no complete sharded checkpoint for step {ref_or_step} in {self.uri}")
        return matches[-1]

    # ------------------------------------------------------------ reading
    def manifest(self, ref_or_step: ShardedRef | int) -> ShardedManifest:
        """The global manifest: every tensor's global shape, dtype and chunk boxes."""
        return self._read_global(self._find(ref_or_step).name)

    def load_chunks(self, ref_or_step: ShardedRef | int,
                    wanted: Mapping[str, Sequence[Box]]) -> dict[str, builtins.list[Any]]:
        """``{key: [box, ...]}`` -> the boxes' contents (tensors or ndarrays of the stored
        dtype), reading only the byte ranges of overlapping chunks (``sharded_load``)."""
        return self.reader(ref_or_step).load_boxes(wanted)

    def reader(self, ref_or_step: ShardedRef | int) -> BoxReader:
        """A ranged reader of one checkpoint (its deltas' bases read through this store)."""
        ref = self._find(ref_or_step)
        return BoxReader(self.backend, ref.name, self._read_global(ref.name), codec_threads=self.config.codec_threads,
                         base_manifest=self._read_global)

    def load_skeletons(self, ref_or_step: ShardedRef | int, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """The non-tensor state of ``ranks`` (all when None), each part checked against the
        size and CRC32 the global manifest records for it."""
        ref = self._find(ref_or_step)
        manifest = self._read_global(ref.name)
        wanted = set(range(manifest.world_size)) if ranks is None else set(ranks)
        out: dict[int, Any] = {}
        for entry in manifest.parts:
            if not wanted & set(entry.ranks):
                continue
            location = self.backend.uri(f"{ref.name}/{entry.name}")
            try:
                data = self.backend.read_small(f"{ref.name}/{entry.name}")
            except FileNotFoundError:
                raise CorruptCheckpointError(location, "part manifest is missing") from None
            if len(data) != entry.size_bytes or crc32(data) != entry.crc32:
                raise CorruptCheckpointError(location, "part manifest differs from what the global manifest records")
            try:
                part = decode_part(data, name=entry.name)
            except ManifestError as err:
                raise CorruptCheckpointError(location, str(err)) from None
            out.update({r: part.skeletons[r] for r in part.ranks if r in wanted})
        unknown = wanted - set(out)
        if unknown:
            raise KeyError(f"{ref.uri}: ranks {sorted(unknown)} are not in a world of {manifest.world_size}")
        return out

    def close(self) -> None:
        self.backend.close()


def _settle(dirs: Sequence[_Dir], after: Mapping[str, Mapping[str, int]]) -> bool:
    """Whether the listing ``after``, taken once the manifests of ``dirs`` were read, agrees
    with the one ``dirs`` came from: the same step directories, the same manifest names at
    the same sizes, and every committed directory's files the same. Two listings that agree
    around the reads make a view that held at one moment (files are new files, never made
    again), so a manifest created over files removed before it is never taken for whole,
    and an answer is never older than the store was when the call began."""
    steps = {name: files for name, files in after.items() if parse_checkpoint_dir(name) is not None}
    if set(steps) != {entry.name for entry in dirs}:
        return False
    for entry in dirs:
        files = steps[entry.name]
        if files.get(GLOBAL_MANIFEST_NAME) != entry.files.get(GLOBAL_MANIFEST_NAME):
            return False
        if entry.committed and dict(files) != entry.files:
            return False
    return True


def _expected_files(manifest: ShardedManifest) -> dict[str, int]:
    expected = {p.name: p.size_bytes for p in manifest.parts}
    expected.update((f.name, f.size_bytes) for p in manifest.parts for f in p.files)
    return expected


def _missing_files(manifest: ShardedManifest, files: Mapping[str, int]) -> builtins.list[str]:
    return [name for name, size in _expected_files(manifest).items() if files.get(name) != size]


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step={step!r}: must be an int from 0 to {MAX_STEP}")


def _checked_ranks(skeletons: Mapping[int, Any], world_size: int) -> tuple[int, ...]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size={world_size!r}: must be an int from 1 to {MAX_WORLD_SIZE}")
    ranks = tuple(sorted(skeletons))
    if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size for r in ranks):
        raise ValueError(f"skeletons for ranks {list(ranks)!r:.200}: expected ranks from 0 to {world_size - 1}")
    return ranks


def _check_chunk(chunk: ChunkSource, ranks: set[int]) -> None:
    if not isinstance(chunk, ChunkSource):
        raise TypeError(f"expected a ChunkSource, got {type(chunk).__name__}")
    if chunk.rank not in ranks:
        raise ValueError(f"chunk {chunk.key!r} of rank {chunk.rank}, a rank this part does not cover")
    if not isinstance(chunk.key, str) or not chunk.key:
        raise ValueError(f"chunk key {chunk.key!r}: expected a non-empty str")
    if not chunk.box.fits(tuple(chunk.global_shape)):
        raise ValueError(f"chunk {chunk.key!r} at {chunk.offsets} of sizes {chunk.box.sizes} lies outside "
                         f"its global shape {tuple(chunk.global_shape)}")


def _checked_json(value: Any, what: str) -> Any:
    try:
        text = json.dumps(value, allow_nan=False)
        return parse_stored_json(f"[{text}]".encode(), max_bytes=MAX_SKELETON_BYTES)[0]
    except (TypeError, ValueError, StoredJsonError) as err:
        raise ValueError(f"{what}: not storable as JSON ({err})") from None
