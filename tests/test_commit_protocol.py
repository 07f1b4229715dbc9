"""The commit rules of storage/commit.py, interleaving by interleaving, on the real local
backend: a created manifest is final, files of a step directory go only under an abandon
record, housekeeping honours protected steps, a fenced writer ends fenced by name and
leaves nothing. The seeded simulation (test_commit_sim.py) explores the interleavings."""

from __future__ import annotations

import os

import numpy as np
import pytest
from store_helpers import newest_sharded, part_store

from ray_checkfreq import CheckpointStore
from ray_checkfreq.errors import FencedWriterError, StorageError
from ray_checkfreq.storage import commit
from ray_checkfreq.storage.backends import posix
from ray_checkfreq.storage.store import CheckpointStore, ChunkSource

WORLD = 3


def part(store: CheckpointStore, step: int, rank: int, world: int = WORLD):
    values = np.full(2, 100 * step + rank, np.float32)
    chunk = ChunkSource(key="w", data=values, global_shape=(2 * world,), offsets=(2 * rank,), rank=rank)
    return store.save_part(step, world_size=world, skeletons={rank: {"step": step}}, chunks=[chunk])


def writers(root, world: int = WORLD, **kwargs) -> list[CheckpointStore]:
    first = part_store(str(root), **kwargs)
    generation = first.acquire_writer()
    return [first, *(part_store(str(root), writer_generation=generation, **kwargs) for _ in range(world - 1))]


def vanishing_mid_listing(monkeypatch, directory, name: str) -> list[int]:
    """A file ``name`` in ``directory`` that is unlinked between every listing's directory
    read and its stat (the loser's temporary file of the old layout, an NFS client's
    ``.nfs*`` file): put back before each listing, gone before its stat. Returns a counter."""
    path = os.path.join(directory, name)
    real_scandir, real_size = os.scandir, posix._file_size
    vanished = [0]

    def scandir(target):
        if os.path.abspath(target) == os.path.abspath(directory):
            with open(path, "wb") as f:
                f.write(b"staged")
        return real_scandir(target)

    def file_size(entry):
        if entry.name == name and os.path.exists(path):
            os.unlink(path)
            vanished[0] += 1
        return real_size(entry)

    monkeypatch.setattr(posix.os, "scandir", scandir)
    monkeypatch.setattr(posix, "_file_size", file_size)
    return vanished


def test_a_file_vanishing_mid_listing_never_undoes_a_commit(tmp_path, monkeypatch):
    """The interleaving behind the intermittent sharded-kill failure: the loser's temporary
    file unlinked between the winner's directory read and its stat once made the winner's
    listing {} and its commit undone. Now the commit stays and is the winner's."""
    stores = writers(tmp_path)
    for rank, store in enumerate(stores):
        part(store, 5, rank)
    name = stores[0].dir_name(5)
    vanished = vanishing_mid_listing(monkeypatch, tmp_path / name, "manifest.json.1f2e3d4c.tmp")
    result = stores[0].try_commit(5)
    assert result.committed and result.by_me
    assert vanished[0] >= 1  # the listing really lost a file on the way
    assert stores[2].try_commit(5).committed  # the loser finds the commit and reports it
    assert (tmp_path / name / "manifest.json").exists()
    monkeypatch.undo()
    assert newest_sharded(part_store(str(tmp_path))).step == 5


def test_a_manifest_created_over_files_a_newer_generation_removed_is_fenced_by_name(tmp_path, monkeypatch):
    """Rule 2's exception on an object store (no directory to vanish): the zombie's create
    lands after a newer generation emptied its directory. It raises FencedWriterError and
    leaves no manifest that no reader could ever load."""
    stores = writers(tmp_path)
    for rank, store in enumerate(stores):
        part(store, 5, rank)
    zombie, name = stores[0], stores[0].dir_name(5)
    newer = part_store(str(tmp_path))
    real_create = zombie.backend.create_exclusive

    def create_after_the_removal(rel_path, data, **kwargs):
        if rel_path.endswith("/manifest.json") and not getattr(create_after_the_removal, "done", False):
            create_after_the_removal.done = True
            newer.acquire_writer()
            for file in os.listdir(tmp_path / name):
                os.unlink(tmp_path / name / file)  # what the newer generation's housekeeping did
        return real_create(rel_path, data, **kwargs)

    monkeypatch.setattr(zombie.backend, "create_exclusive", create_after_the_removal)
    with pytest.raises(FencedWriterError, match="is fenced"):
        zombie.try_commit(5)
    assert not (tmp_path / name).exists()  # no manifest without its files, no file of the zombie


def test_housekeeping_removes_an_old_directory_only_under_its_record_and_keeps_a_commit_that_wins(tmp_path):
    stores = writers(tmp_path)
    for rank, store in enumerate(stores):
        part(store, 5, rank)
    name = stores[0].dir_name(5)
    assert stores[0].try_commit(5).committed  # a commit the newer generation's listing missed
    newer = part_store(str(tmp_path))
    generation = newer.acquire_writer()
    assert not commit.remove_uncommitted(newer.backend, name, generation)  # the record loses to it
    assert [ref.step for ref in part_store(str(tmp_path)).list()] == [5]
    assert commit.claim(newer.backend, "step-000000000009-g000001-00000000", generation)  # gone: nothing to claim


def test_a_protected_step_survives_housekeeping_in_every_branch(tmp_path):
    pins = {2}
    first = part_store(str(tmp_path), keep_last=1, protected_steps=lambda: pins)
    first.acquire_writer()
    for step in (1, 2):
        part(first, step, 0, world=1)
        assert first.try_commit(step).committed
    interrupted = part_store(str(tmp_path), keep_last=1, protected_steps=lambda: pins)
    interrupted.acquire_writer()
    part(interrupted, 2, 0, world=2)  # step 2 of a newer generation, never committed
    latest = part_store(str(tmp_path), keep_last=1, protected_steps=lambda: pins)
    latest.acquire_writer()
    for step in (3, 4):
        part(latest, step, 0, world=1)
        assert latest.try_commit(step).committed
    names = sorted(os.listdir(tmp_path))
    assert [ref.step for ref in latest.list()] == [2, 4]  # the pointer's step outlives keep_last
    assert interrupted.dir_name(2) in names  # the interrupted branch honours the pointer too
    pins.clear()
    part(latest, 5, 0, world=1)
    latest.try_commit(5)
    assert [ref.step for ref in latest.list()] == [5]
    assert interrupted.dir_name(2) not in os.listdir(tmp_path)


def test_a_zombie_failing_to_make_its_directory_ends_fenced_by_name(tmp_path, monkeypatch):
    zombie = part_store(str(tmp_path))
    zombie.acquire_writer()
    real_make_dir = zombie.backend.make_dir

    def make_dir_after_a_takeover(rel_dir):
        part_store(str(tmp_path)).acquire_writer()
        real_make_dir(rel_dir)
        raise StorageError(rel_dir, "cannot create directory: File exists")

    monkeypatch.setattr(zombie.backend, "make_dir", make_dir_after_a_takeover)
    monkeypatch.setattr(zombie.backend, "list_dirs", lambda: [])
    with pytest.raises(FencedWriterError, match="is fenced"):
        part(zombie, 3, 0, world=1)


def test_a_fenced_writer_withdraws_every_step_it_left_uncommitted(tmp_path):
    stores = writers(tmp_path)
    for step in (1, 2):
        part(stores[1], step, 1)  # ranks 0 and 2 never write: neither step can commit
        assert not stores[1].try_commit(step).committed
    part_store(str(tmp_path)).acquire_writer()
    with pytest.raises(FencedWriterError):
        part(stores[1], 3, 1)
    assert sorted(os.listdir(tmp_path)) == ["writers"]


def test_a_replicated_store_keeps_its_commit_final_and_removes_leftovers_under_a_record(tmp_path):
    old = CheckpointStore(str(tmp_path), keep_last=1)
    old.save(1, {"w": np.ones(4)})
    leftover = tmp_path / "step-000000000002-g000001-deadbeef"
    leftover.mkdir()
    (leftover / "shard-00000.bin").write_bytes(b"partial")
    new = CheckpointStore(str(tmp_path), keep_last=1)
    new.save(3, {"w": np.ones(4)})
    assert not leftover.exists()
    assert [ref.step for ref in new.list()] == [3]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp") or n.startswith(".staging")]


def test_a_writer_remembers_only_its_newest_parts(tmp_path):
    """A rank that is never the committer learns before each part that its earlier steps
    committed (``learn_commit``): what it keeps to withdraw is its newest part alone, however
    long the run."""
    stores = writers(tmp_path, world=2)
    for step in range(1, 21):
        part(stores[0], step, 0, world=2)
        assert stores[0].try_commit(step).missing_ranks == (1,)  # rank 1 commits each step
        part(stores[1], step, 1, world=2)
        assert stores[1].try_commit(step).by_me
    assert sorted(own.step for own in stores[0]._writer._own.values()) == [20]
    assert stores[1]._writer._own == {}
