"""What the writer that just committed a checkpoint removes, and what it rewrites.

Invariants (docs/format.md, retention):
1. Only the writer that *just committed* step ``s`` of generation ``g`` runs it. It removes
   manifest-less directories of older generations, and of ``g`` with a smaller step (or
   the same step under another name: a one-part save that failed before): every writer of
   ``g`` finished its commits of those before it wrote its part of ``s``. Never a step
   ``protected_steps`` names, unless its directory is abandoned already.
2. It then executes ``retention.plan_retention`` over the committed checkpoints: a newer
   generation's directories are never touched, a checkpoint's manifest goes before its
   files (an interrupted delete leaves an uncommitted directory, never a committed one
   with holes).
3. With ``history_trim`` it rewrites history checkpoints near-lossless (``history.py``):
   the copy commits before its source is deleted; a failure keeps the source exact.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.errors import CheckFreqError
from ray_checkfreq.storage import commit, legacy
from ray_checkfreq.storage.catalog import Catalog
from ray_checkfreq.storage.encoding import EncodeOptions
from ray_checkfreq.storage.history import HistoryTrim
from ray_checkfreq.storage.legacy import Manifest
from ray_checkfreq.storage.manifest import CheckpointAttributes, GlobalManifest
from ray_checkfreq.storage.names import checkpoint_dir_name
from ray_checkfreq.storage.part_files import ChunkSource
from ray_checkfreq.storage.part_writer import ChunkBase, PartContent, PartWriter
from ray_checkfreq.storage.reader import BoxReader
from ray_checkfreq.storage.retention import StoredEntry, plan_retention

logger = logging.getLogger("ray_checkfreq.storage")


@dataclass(frozen=True, kw_only=True)
class Keep:
    """What retention keeps (the store's settings)."""

    keep_last: int
    keep_epoch_boundaries: bool
    history_trim: HistoryTrim | None
    codec_level: int | None
    codec_threads: int | None
    io_threads: int


@dataclass
class Housekeeper:
    catalog: Catalog
    writer: PartWriter
    keep: Keep

    def after_commit(self, just_committed: str, step: int, generation: int, protected: set[int],
                     verified: set[str]) -> None:
        """Invariants 1-3 after this writer committed ``just_committed``; ``verified`` (the
        checkpoints this store read in full or wrote) loses what is deleted."""
        entries = self.catalog.scan()
        for entry in entries:
            if not entry.committed and _older(entry, just_committed, step, generation) \
                    and (entry.abandoned or entry.step not in protected):
                logger.info("removing interrupted save %s", self.catalog.backend.uri(entry.name))
                if entry.abandoned:
                    commit.finish_removal(self.catalog.backend, entry.name)  # its remover died on the way
                else:
                    commit.remove_uncommitted(self.catalog.backend, entry.name, generation)
        committed = sorted((e for e in entries if e.committed), key=StoredEntry.order_key)
        trim = self.keep.history_trim
        plan = plan_retention(
            committed, keep_last=self.keep.keep_last, keep_epoch_boundaries=self.keep.keep_epoch_boundaries,
            protected_steps=protected, just_saved=just_committed,
            newest_verified=next((e.name for e in reversed(committed) if e.name in verified), None),
            writer_generation=generation, trim=trim is not None,
            delta_base_in_use=self.writer.base.name if self.writer.base is not None else None)
        for name in plan.delete:
            commit.remove_committed(self.catalog.backend, name, generation)
        verified &= plan.keep
        if trim is not None:
            kept = [e for e in committed if e.name in plan.keep]
            self._trim_history(trim, kept, plan.rewrite, plan.drop_copied, generation, verified)
        self.catalog.backend.clean_staging(commit.STALE_STAGING_S)

    def _trim_history(self, trim: HistoryTrim, kept: list[StoredEntry], rewrite: Sequence[str],
                      drop_copied: Sequence[str], generation: int, verified: set[str]) -> None:
        by_name = {e.name: e for e in kept}
        for name in [*rewrite, *drop_copied]:
            try:
                if name in rewrite:
                    self._write_trimmed_copy(trim, by_name[name], [e for e in kept if e.trimmed], generation)
                commit.remove_committed(self.catalog.backend, name, generation)
                verified.discard(name)
            except (CheckFreqError, OSError) as err:
                logger.warning("%s: history checkpoint %s kept exact, trimming failed: %s",
                               self.catalog.backend.root_uri, name, err)

    def _write_trimmed_copy(self, trim: HistoryTrim, entry: StoredEntry, trimmed: list[StoredEntry],
                            generation: int) -> None:
        from ray_checkfreq.storage.committer import commit_dir

        assert entry.manifest is not None
        content = self._contents(entry.name, entry.manifest, trim)
        base = self._trimmed_delta_base(trim, trimmed)
        options = EncodeOptions(codec="rcfz", level=self.keep.codec_level, threads=self.keep.codec_threads)
        name = checkpoint_dir_name(entry.step, generation, uuid.uuid4().hex[:8])
        backend = self.catalog.backend
        try:
            self.writer.write(name, generation, content, options, base, lambda: None, track=False)
            result = commit_dir(self.catalog, name, entry.step, generation, fence=generation)
            if not result.by_me:
                raise CheckFreqError(f"{backend.uri(name)}: the trimmed copy did not commit")
        except BaseException:
            commit.discard(backend, name, generation)
            raise
        logger.info("%s: history checkpoint %s rewritten trimmed as %s", backend.root_uri, entry.name, name)

    def _contents(self, name: str, manifest: Manifest | GlobalManifest, trim: HistoryTrim | None) -> PartContent:
        """A checkpoint's chunks (trimmed with ``trim``) and skeletons as one part's content."""
        change = trim.trim_leaf if trim is not None else (lambda leaf: leaf)
        history = trim.describe(name) if trim is not None else None
        threads = self.keep.io_threads
        if isinstance(manifest, Manifest):  # format 1-2: one replica's leaves
            leaves = legacy.read_leaves(self.catalog.backend, name, manifest, (threads, self.keep.codec_threads),
                                        build=True, check_stored=False)
            chunks = [_whole(t.key, change(leaf)) for t, leaf in zip(manifest.tensors, leaves)]
            return PartContent(step=manifest.step, world_size=1, epoch_boundary=manifest.epoch_boundary,
                               skeletons={0: {"state": manifest.state, "keys": [t.key for t in manifest.tensors]}},
                               chunks=chunks, attributes=CheckpointAttributes(
                                   placement="replicated", meta=dict(manifest.meta), history_trim=history))
        reader = BoxReader(self.catalog.backend, name, manifest, codec_threads=self.keep.codec_threads,
                           base_manifest=self.catalog.global_manifest)
        records = [c for t in manifest.tensors for c in t.chunks]
        leaves = reader.read_whole_chunks(records, threads)
        chunks = [ChunkSource(key=r.key, data=change(leaf), global_shape=r.global_shape, offsets=r.box.offsets,
                              rank=r.rank) for r, leaf in zip(records, leaves)]
        attributes = CheckpointAttributes(placement=manifest.attributes.placement, meta=dict(manifest.meta),
                                          history_trim=history)
        return PartContent(step=manifest.step, world_size=manifest.world_size, skeletons=reader.skeletons(),
                           chunks=chunks, epoch_boundary=manifest.epoch_boundary, attributes=attributes)

    def _trimmed_delta_base(self, trim: HistoryTrim, trimmed: list[StoredEntry]) -> ChunkBase | None:
        """The newest full trimmed copy with room for another delta, with its chunks."""
        fulls = [e for e in trimmed if e.manifest is not None and not e.manifest.delta_bases]
        if not fulls or trim.full_every == 1:
            return None
        newest = fulls[-1]
        deltas = sum(1 for e in trimmed if e.manifest is not None and newest.name in e.manifest.delta_bases)
        if deltas >= trim.full_every - 1 or isinstance(newest.manifest, Manifest):
            return None  # full, or a format 2 copy: the next copy is full (a delta's base is format 4)
        assert newest.manifest is not None
        try:
            content = self._contents(newest.name, newest.manifest, None)
        except CheckFreqError as err:
            logger.warning("%s: trimmed copy %s unusable as a delta base: %s", self.catalog.backend.root_uri,
                           newest.name, err)
            return None
        return ChunkBase(name=newest.name, chunks={(c.key, c.box, c.rank): c.data for c in content.chunks})


def _older(entry: StoredEntry, just_committed: str, step: int, generation: int) -> bool:
    if entry.generation != generation:
        return entry.generation < generation
    return entry.step < step or (entry.step == step and entry.name != just_committed)


def _whole(key: str, leaf: Any) -> ChunkSource:
    return ChunkSource(key=key, data=leaf, global_shape=tuple(leaf.shape), offsets=(0,) * leaf.ndim, rank=0)
