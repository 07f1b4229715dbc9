"""One writer's parts: data files, then its part manifest, created exclusively.

Invariants (docs/format.md, "The commit protocol"):
1. A part manifest is created only after its data files are durable, exclusively, and
   only by a writer whose generation is still the newest (checked right before).
2. A failed write leaves nothing of its own: data files no part manifest lists are this
   writer's alone and go as they are; once its part manifest may exist a committer may be
   counting on them, so they go under an abandon record (``commit.claim``), never out of
   a committed directory.
3. A fenced writer withdraws every part of its own not yet committed (``withdraw``).
4. Deltas: a part's chunks are XOR deltas of the same chunks (key, box, rank) of this
   writer's newest *committed* full part (a part with no delta chunk), each one only where
   it is smaller than the chunk's full form (encoding.py), at most ``full_every - 1`` parts
   in a row; a base that is no longer committed (another writer's housekeeping removed it)
   means a full part. Whichever writer committed a step, this writer learns of it: at the
   commit it made or saw (``committed``), else before its next part (``learn_commit``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.errors import StorageError
from ray_checkfreq.storage import commit
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.chunks import Box
from ray_checkfreq.storage.encoding import EncodeOptions, copy_leaf
from ray_checkfreq.storage.manifest import (
    MAX_WORLD_SIZE,
    CheckpointAttributes,
    PartManifest,
    encode_part,
    part_manifest_name,
)
from ray_checkfreq.storage.part_files import ChunkSource, PartLayout, write_part_files
from ray_checkfreq.storage.stored_json import StoredJsonError, parse_stored_json

logger = logging.getLogger("ray_checkfreq.storage")

# The newest steps whose parts this writer remembers (withdrawn if it is fenced); one
# checkpoint is in flight at a time, so older ones are settled.
_OWN_KEPT = 8
MAX_SKELETON_BYTES = 16 * 1024 * 1024


@dataclass
class ChunkBase:
    """The chunks of a committed full part: the base of the next deltas."""

    name: str  # its directory
    chunks: dict[tuple[str, Box, int], Any]  # (key, box, rank) -> a private copy
    saves_since: int = 0


@dataclass(frozen=True, kw_only=True)
class PartContent:
    """What one part holds: the chunks of ``ranks`` (of ``world_size``) and each rank's
    non-tensor state as JSON."""

    step: int
    world_size: int
    skeletons: Mapping[int, Any]
    chunks: Sequence[ChunkSource]
    epoch_boundary: bool = False
    attributes: CheckpointAttributes = CheckpointAttributes()

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.skeletons))


@dataclass(frozen=True)
class _OwnPart:
    step: int
    manifest: str
    files: list[str]
    ranks: tuple[int, ...]


class PartWriter:
    """Writes the parts of one store object and remembers what it wrote until committed."""

    def __init__(self, backend: Backend, layout: PartLayout, full_every: int) -> None:
        self.backend = backend
        self.layout = layout
        self.full_every = full_every
        self.base: ChunkBase | None = None
        self._own: dict[str, _OwnPart] = {}  # directory -> this writer's uncommitted part there
        # The directory of the newest part written and, if it was full, its chunks: the base once committed.
        self._pending: tuple[str, ChunkBase | None] | None = None

    def write(self, name: str, generation: int, content: PartContent, options: EncodeOptions,
              base: ChunkBase | None, check_fence: Callable[[], None], *, track: bool = True) -> PartManifest:
        """Write ``content`` as a part of directory ``name``, durable on return, checking
        the fence right before the part manifest (the caller checked it before); on failure
        remove what it wrote (invariant 2). ``track``: a part of this writer's run (its
        deltas' base follows it), not a one-off copy."""
        written: list[str] = []
        part_tried = False
        try:
            self._ensure_dir(name)
            files, records = write_part_files(self.backend, name, content.ranks[0], uuid.uuid4().hex[:8],
                                              content.chunks, options, self.layout, written,
                                              base.chunks if base is not None else None)
            part = PartManifest(step=content.step, writer_generation=generation, world_size=content.world_size,
                                ranks=content.ranks, epoch_boundary=bool(content.epoch_boundary),
                                created_unix_ns=time.time_ns(), files=files, chunks=records,
                                skeletons=dict(content.skeletons), attributes=content.attributes,
                                delta_base=base.name if base is not None and any(r.delta for r in records) else None)
            check_fence()
            part_tried = True
            if not self.backend.create_exclusive(f"{name}/{part.name}", encode_part(part)):
                part_tried = False  # the part there is another writer's: not ours to remove
                raise StorageError(self.backend.uri(f"{name}/{part.name}"), "a part for these ranks is there "
                                   "already: two writers of one generation claim the same ranks?")
        except BaseException:
            self._abandon(name, written, part_tried, content.ranks[0], generation)
            raise
        if track:
            self._own[name] = _OwnPart(content.step, part.name, written, content.ranks)
            self._pending = (name, None if part.delta_base is not None else self._new_base(name, content, options))
            for stale in sorted(self._own, key=lambda d: self._own[d].step)[:-_OWN_KEPT]:
                # A step another writer committed never comes back here; one this long
                # unanswered is committed or is left to the housekeeping of a later commit.
                del self._own[stale]
        return part

    def owns_rank_zero(self, name: str) -> bool:
        own = self._own.get(name)
        return own is not None and 0 in own.ranks

    def committed(self, name: str) -> None:
        """Directory ``name`` is committed: its files are a checkpoint's now, never withdrawn;
        its full part becomes the base, or its delta counts against the base."""
        self._own.pop(name, None)
        if self._pending is None or self._pending[0] != name:
            return
        new_base = self._pending[1]
        self._pending = None
        if new_base is not None:
            self.base = new_base
        elif self.base is not None:
            self.base.saves_since += 1

    def learn_commit(self, listed: Callable[[str], Collection[str]]) -> None:
        """Before a part: whether the newest part's directory was committed since, by
        another writer (a writer that is not the last to write its part commits nothing
        and never polls). ``listed(name)``: the files of the committed manifest of
        ``name``, empty when it has none; this writer's part counts only where the
        manifest lists it and every file of it."""
        if self._pending is None:
            return
        name = self._pending[0]
        own = self._own.get(name)
        if own is not None and {own.manifest, *own.files} <= set(listed(name)):
            self.committed(name)

    def usable_base(self, options: EncodeOptions, is_committed: Callable[[str], bool]) -> ChunkBase | None:
        """The base of this save's deltas: None (a full part) unless one is due and the base
        is still committed (invariant 4)."""
        base = self.base
        if options.codec != "rcfz" or base is None or base.saves_since >= self.full_every - 1:
            return None
        if not is_committed(base.name):
            self.base = None
            return None
        return base

    def _new_base(self, name: str, content: PartContent, options: EncodeOptions) -> ChunkBase | None:
        if options.codec != "rcfz" or self.full_every == 1:
            return None
        return ChunkBase(name=name, chunks={(c.key, c.box, c.rank): copy_leaf(c.data) for c in content.chunks})

    def withdraw(self, generation: int) -> None:
        """A fenced writer leaves nothing: every directory where it wrote a part not yet
        committed goes, under an abandon record. No writer of its generation can commit
        there any more; a salvage that wins the record first keeps it committed."""
        for name in sorted(self._own):
            del self._own[name]
            commit.remove_uncommitted(self.backend, name, generation)

    def _ensure_dir(self, name: str) -> None:
        """The step's directory, made by whichever writer comes first."""
        try:
            self.backend.make_dir(name)
        except StorageError:
            if name not in self.backend.list_dirs():
                raise

    def _abandon(self, name: str, written: Sequence[str], part_tried: bool, first_rank: int,
                 generation: int) -> None:
        try:
            if part_tried:
                part_file = part_manifest_name(first_rank)
                if commit.claim(self.backend, name, generation):
                    self._delete_files(name, [part_file, *written])
                    self.backend.delete_file(commit.manifest_path(name))
            else:
                self._delete_files(name, written)
        except Exception as err:  # the failure that got us here matters more; housekeeping retries
            logger.warning("could not remove the partial part in %s: %s", self.backend.uri(name), err)

    def _delete_files(self, name: str, files: Sequence[str]) -> None:
        for file in files:
            try:
                self.backend.delete_file(f"{name}/{file}")
            except Exception as err:  # the next committer's housekeeping removes the directory
                logger.warning("could not remove %s: %s", self.backend.uri(f"{name}/{file}"), err)


def part_content(step: int, *, world_size: int, skeletons: Mapping[int, Any], chunks: Sequence[ChunkSource],
                 epoch_boundary: bool = False) -> PartContent:
    """A part's content, checked before any I/O: ranks within the world, each skeleton
    storable as bounded JSON, each chunk a rank's box inside its tensor."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size={world_size!r}: must be an int from 1 to {MAX_WORLD_SIZE}")
    ranks = tuple(sorted(skeletons))
    if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size for r in ranks):
        raise ValueError(f"skeletons for ranks {list(ranks)!r:.200}: expected ranks from 0 to {world_size - 1}")
    checked = {rank: _checked_json(skeletons[rank], f"skeleton of rank {rank}") for rank in ranks}
    for chunk in chunks:
        _check_chunk(chunk, set(ranks))
    return PartContent(step=step, world_size=world_size, skeletons=checked, chunks=chunks,
                       epoch_boundary=epoch_boundary)


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
