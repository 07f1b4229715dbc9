"""Retention as a plan: which checkpoint directories a save leaves behind, decided from
what a listing found, without I/O. ``CheckpointStore`` executes the plan.

Invariants the plan keeps (``format.md``, retention):
1. Kept: the newest ``keep_last`` intact exact checkpoints and anything newer, intact
   epoch boundaries (``keep_epoch_boundaries``), protected steps (a Ray Train pointer
   names them), the checkpoint just saved, the newest one this store object verified,
   and every delta base a kept checkpoint refers to.
2. Only this writer's and older writers' directories are deleted or rewritten: a newer
   writer's are never touched.
3. History trimming (``trim=True``) rewrites only kept, intact epoch boundaries that are
   none of: recent, just saved, the newest verified, protected, a delta base an exact
   checkpoint still uses, already trimmed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from ray_checkfreq.errors import CorruptCheckpointError
from ray_checkfreq.storage.legacy import Manifest
from ray_checkfreq.storage.manifest import MANIFEST_NAME, GlobalManifest

logger = logging.getLogger("ray_checkfreq.storage")


@dataclass
class StoredEntry:
    """One checkpoint directory as a listing found it."""

    name: str
    step: int
    generation: int
    files: dict[str, int]
    manifest: Manifest | GlobalManifest | None = None  # format 1-2, or 3-4
    fault: CorruptCheckpointError | None = None
    abandoned: bool = False  # its manifest name holds an abandon record (commit.py)
    vanished: bool = False  # its manifest was listed, then gone when read

    @property
    def committed(self) -> bool:
        return MANIFEST_NAME in self.files and not self.abandoned

    @property
    def trimmed(self) -> bool:
        """A near-lossless history copy (``history.py``), never what a resume reads."""
        return self.manifest is not None and self.manifest.history_trim is not None

    def order_key(self) -> tuple[int, int, int, str]:
        created = self.manifest.created_unix_ns if self.manifest else 0
        return (self.generation, self.step, created, self.name)

    def shards_present(self) -> bool:
        assert self.manifest is not None
        return all(self.files.get(name) == size for name, size in self.manifest.expected_files().items())

    def intact(self) -> bool:
        return self.manifest is not None and self.shards_present()


@dataclass(frozen=True)
class RetentionPlan:
    keep: frozenset[str]
    delete: tuple[str, ...]  # oldest first
    # History trimming: at most one checkpoint rewritten trimmed per retention (the work
    # of an epoch's end is spread out), then deleted; and sources whose trimmed copy is
    # committed already (a crash came between the copy and the delete), deleted now.
    rewrite: tuple[str, ...] = ()
    drop_copied: tuple[str, ...] = ()


def removable(entry: StoredEntry, writer_generation: int | None) -> bool:
    """Housekeeping touches only this writer's and older writers' directories."""
    return writer_generation is not None and entry.generation <= writer_generation


def recent_names(entries: Sequence[StoredEntry], keep_last: int) -> set[str]:
    """The newest ``keep_last`` intact exact checkpoints and anything newer (trimmed
    history copies do not count: they are history whatever their writer generation)."""
    recent: set[str] = set()
    kept_intact = 0
    for entry in reversed(entries):
        if kept_intact >= keep_last:
            break
        if not entry.trimmed:
            kept_intact += entry.intact()
            recent.add(entry.name)
    return recent


def plan_retention(entries: Sequence[StoredEntry], *, keep_last: int, keep_epoch_boundaries: bool,
                   protected_steps: Collection[int], just_saved: str, newest_verified: str | None,
                   writer_generation: int | None, trim: bool = False,
                   delta_base_in_use: str | None = None) -> RetentionPlan:
    """``entries``: the committed checkpoints, oldest first (``StoredEntry.order_key``).
    ``delta_base_in_use``: the full checkpoint the writer's next save may be a delta of."""
    recent = recent_names(entries, keep_last)
    keep = set(recent) | {just_saved}
    keep |= {e.name for e in entries
             if keep_epoch_boundaries and e.manifest is not None and e.manifest.epoch_boundary and e.intact()}
    keep |= {e.name for e in entries if e.step in protected_steps}
    if newest_verified is not None:
        keep.add(newest_verified)
    # A delta is only as good as its base: keep every base a kept checkpoint refers to.
    keep |= {base for e in entries if e.name in keep and e.manifest for base in e.manifest.delta_bases}
    delete = tuple(e.name for e in entries if e.name not in keep and removable(e, writer_generation))
    if not trim:
        return RetentionPlan(keep=frozenset(keep), delete=delete)
    kept = [e for e in entries if e.name in keep]
    untouchable = recent | {just_saved, newest_verified or just_saved}
    untouchable |= {e.name for e in kept if e.step in protected_steps}
    in_use = {base for e in kept if e.manifest and not e.trimmed for base in e.manifest.delta_bases}
    if delta_base_in_use is not None:
        in_use.add(delta_base_in_use)
    candidates = [e.name for e in kept
                  if e.manifest is not None and e.manifest.epoch_boundary and not e.trimmed and e.shards_present()
                  and e.name not in untouchable and e.name not in in_use and removable(e, writer_generation)]
    copied = {(e.manifest.history_trim or {}).get("source") for e in kept if e.manifest is not None}
    uncopied = [name for name in candidates if name not in copied]
    return RetentionPlan(keep=frozenset(keep), delete=delete, rewrite=tuple(uncopied[:1]),
                         drop_copied=tuple(name for name in candidates if name in copied))


def protected_steps_now(protected_steps: Callable[[], Iterable[int]] | None, uri: str) -> set[int] | None:
    """The steps ``protected_steps`` names now (none without it); None, meaning delete
    nothing, when it fails: keeping too much is safe, deleting a pointed-at step is not."""
    if protected_steps is None:
        return set()
    try:
        return {int(step) for step in protected_steps()}
    except Exception as err:
        logger.warning("%s: retention skipped, protected_steps failed: %s", uri, err)
        return None
