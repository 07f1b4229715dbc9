"""Phase 2 of a sharded checkpoint: every rank writes its own part, rank 0 waits for the commit.

A rank's part (one ``ShardedStore`` part covering this rank alone) holds:

- each model and optimizer tensor leaf this rank owns (``ChunkPlace.owner``: one rank per
  distinct chunk, engine/state.py), under the leaf's name (``model/inp.weight``) with its
  global shape and offsets; a leaf it does not own is written by its owner;
- every other tensor leaf of the snapshot (RNG states, extra state, data state) whole,
  under ``rank/<rank>/<name>``: they are this rank's own;
- as its skeleton: the ``flatten_state`` skeleton of the whole snapshot and, per leaf
  index, the key that holds it and whether it is a per-rank leaf (``RankSkeleton``).

Every rank saves its part and tries the commit once (the writer that completes the set of
parts commits, storage/committer.py). Rank 0 then waits until the step is committed,
so that its persist time (what the policy sees) is the global commit latency and its
report comes only after the commit; a step not committed within ``commit_wait_s`` is a
``PersistError`` naming the ranks whose parts are missing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.engine.persist import PERSIST_NICE, PersistError, PersistResult, PersistThread, Saved
from ray_checkfreq.engine.snapshot import Snapshot
from ray_checkfreq.engine.state import ChunkPlace
from ray_checkfreq.storage.rank_state import SKELETON_FORMAT
from ray_checkfreq.storage.store import CheckpointStore, ChunkSource, CommitResult
from ray_checkfreq.storage.tree import KeyPath, flatten_state

_FIRST_POLL_S = 0.005
_LONGEST_POLL_S = 0.05  # rank 0 learns of the commit late by at most this: its next checkpoint may wait for it


def rank_key(rank: int, name: str) -> str:
    """The key of a per-rank leaf (RNG, extra state, data state) of ``rank``."""
    return f"rank/{rank}/{name}"


@dataclass(frozen=True)
class RankPart:
    """What one rank saves: its skeleton document and its chunks."""

    skeleton: dict[str, Any]
    chunks: list[ChunkSource]


def rank_part(state: Mapping[str, Any], places: Mapping[KeyPath, ChunkPlace], rank: int) -> RankPart:
    """Split a rank's snapshot into its part: owned model/optimizer chunks under their
    names, every other tensor leaf whole under ``rank/<rank>/<name>``."""
    flat = flatten_state(state)
    leaves: list[dict[str, Any]] = []
    chunks: list[ChunkSource] = []
    for leaf, name, path in zip(flat.leaves, flat.key_paths, flat.paths):
        place = places.get(path)
        if place is None:
            key = rank_key(rank, name)
            chunks.append(ChunkSource(key=key, data=leaf, global_shape=tuple(leaf.shape),
                                      offsets=(0,) * len(leaf.shape), rank=rank))
            leaves.append({"key": key, "rank": True})
            continue
        if place.owner:
            chunks.append(ChunkSource(key=place.name, data=leaf, global_shape=place.global_shape,
                                      offsets=place.offsets, rank=rank))
        leaves.append({"key": place.name, "rank": False})
    return RankPart(skeleton={"format": SKELETON_FORMAT, "tree": flat.skeleton, "leaves": leaves}, chunks=chunks)


class ShardedPersistWorker(PersistThread):
    """The sharded mode's persister: this rank's part, then the commit (see the module doc).

    ``PersistResult`` figures are this rank's: ``raw_bytes`` its snapshot, ``stored_bytes``
    its part's data files; ``seconds`` on rank 0 runs until the global commit.
    """

    def __init__(self, store: CheckpointStore, *, rank: int, world_size: int, commit_wait_s: float,
                 on_done: Callable[[PersistResult], None] | None = None, nice: int = PERSIST_NICE,
                 seal: Callable[[Snapshot], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.commit_wait_s = commit_wait_s
        self._seal = seal
        self._sleep = sleep
        self._clock = clock
        super().__init__(on_done, nice)

    def _save(self, snapshot: Snapshot, options: dict) -> Saved:
        if snapshot.places is None:
            raise ValueError(f"the snapshot of iteration {snapshot.step} has no chunk places: not a sharded snapshot")
        if self._seal is not None:  # the snapshot's RAM copy is complete (and may be restored) from here on
            self._seal(snapshot)
        part = rank_part(snapshot.state, snapshot.places, self.rank)
        codec = options.get("codec")
        written = self.store.save_part(snapshot.step, world_size=self.world_size,
                                       skeletons={self.rank: part.skeleton}, chunks=part.chunks,
                                       epoch_boundary=snapshot.epoch_boundary, codec=codec)
        result = self.store.try_commit(snapshot.step)
        if self.rank == 0:
            result = self._wait_for_commit(snapshot.step, result)
        uri = result.ref.uri if result.ref is not None else self.store.backend.uri(self.store.dir_name(snapshot.step))
        return Saved(codec=codec or self.store.config.codec, stored_bytes=sum(f.size_bytes for f in written.files),
                     uri=uri)

    def _wait_for_commit(self, step: int, result: CommitResult) -> CommitResult:
        """Poll (backing off) until ``step`` is committed, at most ``commit_wait_s``."""
        deadline = self._clock() + self.commit_wait_s
        pause = _FIRST_POLL_S
        while not result.committed:
            left = deadline - self._clock()
            if left <= 0:
                raise PersistError(step, f"not committed within commit_wait_s={self.commit_wait_s:g} s: ranks "
                                         f"{list(result.missing_ranks)} of {self.world_size} wrote no part")
            self._sleep(min(pause, left))
            pause = min(2 * pause, _LONGEST_POLL_S)
            result = self.store.try_commit(step)
        return result
