"""Sharded checkpoints in storage (storage/sharded_store.py): N writers, one atomic commit,
fencing of older generations, salvage, hostile manifests, and resharding by ranged reads."""

from __future__ import annotations

import itertools
import json
import math
import threading

import numpy as np
import pytest
import torch
from store_helpers import newest_sharded, part_store

from ray_checkfreq.errors import CorruptCheckpointError, FencedWriterError, StorageError
from ray_checkfreq.storage import fencing
from ray_checkfreq.storage.chunks import Box, whole
from ray_checkfreq.storage.manifest import MANIFEST_NAME, body_checksum, decode_global, decode_part, part_manifest_name
from ray_checkfreq.storage.store import CheckpointStore, ChunkSource

WORLD = 4


def full_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(256, 96, generator=g, dtype=torch.float64),  # Shard(0), 64 rows of 768 B a rank
        "model/odd": torch.randn(7, 3, generator=g),  # uneven Shard(0): 2 2 2 1
        "model/tp": torch.randn(6, 8, generator=g).bfloat16(),  # Shard(1): 2 columns a rank
        "optim/v": np.random.default_rng(seed).standard_normal((10,)).astype("<f4"),  # numpy leaf
        "optim/step": torch.tensor(float(seed)),  # replicated 0-d: rank 0 owns it
    }


def rows(size: int, world: int) -> list[tuple[int, int]]:
    """torch.chunk-style split (ceil-div; trailing ranks may get fewer or none)."""
    step = -(-size // world)
    return [(min(r * step, size), min((r + 1) * step, size)) for r in range(world)]


def rank_boxes(key: str, shape: tuple[int, ...], world: int) -> list[Box]:
    if key == "optim/step":
        return [whole(shape)]
    dim = 1 if key == "model/tp" else 0
    boxes = []
    for lo, hi in rows(shape[dim], world):
        offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
        boxes.append(Box(offsets, sizes))
    return boxes


def piece(value, box: Box):
    out = value[box.slices()]
    return out.contiguous() if isinstance(out, torch.Tensor) else np.ascontiguousarray(out)


def chunks_of(state: dict, ranks: list[int], world: int = WORLD) -> list[ChunkSource]:
    out = []
    for key, value in state.items():
        for rank, box in enumerate(rank_boxes(key, tuple(value.shape), world)):
            if rank in ranks:
                out.append(ChunkSource(key=key, data=piece(value, box), global_shape=tuple(value.shape),
                                       offsets=box.offsets, rank=rank))
    return out


def save(store: CheckpointStore, step: int, ranks: list[int], state: dict, world: int = WORLD):
    skeletons = {r: {"rng": [r, step], "data": {"consumed": 10 * step}} for r in ranks}
    return store.save_part(step, world_size=world, skeletons=skeletons, chunks=chunks_of(state, ranks, world))


def assert_loads(store: CheckpointStore, step: int, state: dict, world: int) -> None:
    """Every tensor rebuilt from the boxes of a ``world``-rank layout equals the saved one."""
    for key, value in state.items():
        boxes = rank_boxes(key, tuple(value.shape), world)
        pieces = store.reader(step).load_boxes({key: boxes})[key]
        for box, got in zip(boxes, pieces):
            want = piece(value, box)
            assert type(got) is type(want), key
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), key
            if isinstance(want, torch.Tensor):
                assert torch.equal(got, want), key
            else:
                np.testing.assert_array_equal(got, want)


def manifests(root) -> list:
    return sorted(p for p in root.rglob(MANIFEST_NAME))


# ------------------------------------------------------------------ the commit race
def run_writers(root, generation: int, order: list[int], killed: int | None, state: dict, step: int = 7):
    """One writer per rank, finishing its part in ``order``; each commits right after its
    part while the next one writes; ``killed`` never gets to commit."""
    turns = [threading.Event() for _ in range(WORLD + 1)]
    turns[0].set()
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def writer(position: int, rank: int) -> None:
        store = part_store(str(root), writer_generation=generation)
        turns[position].wait()
        try:
            save(store, step, [rank], state)
        except BaseException as err:
            errors.append(err)
        finally:
            turns[position + 1].set()
        if rank != killed:
            try:
                results[rank] = store.try_commit(step)
            except BaseException as err:
                errors.append(err)

    threads = [threading.Thread(target=writer, args=(i, r)) for i, r in enumerate(order)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], errors
    return results


@pytest.mark.parametrize("killed", [None, 0, 1, 2, 3])
def test_writers_finishing_in_every_order_commit_exactly_once_and_never_with_a_part_missing(tmp_path, killed):
    state = full_state(1)
    for n, order in enumerate(itertools.permutations(range(WORLD))):
        root = tmp_path / f"{n}"
        generation = fencing.acquire_generation(part_store(str(root)).backend, 0)
        results = run_writers(root, generation, list(order), killed, state)
        found = manifests(root)
        by_me = [r for r, res in results.items() if res.by_me]
        assert len(found) == len(by_me) <= 1, (order, killed, results)
        if killed is None or order[-1] != killed:  # a writer listed after the killed one's part
            assert len(found) == 1, (order, killed)
        store = part_store(str(root), writer_generation=generation + 1)
        if not found:  # the committer died after the last part: the next generation salvages
            fencing.acquire_generation(store.backend, generation)
            assert store.salvage() is not None
        manifest = decode_global(manifests(root)[0].read_bytes())
        assert sorted(r for p in manifest.parts for r in p.ranks) == list(range(WORLD))
        assert newest_sharded(store).step == 7
    assert_loads(store, 7, state, WORLD)


def test_a_newer_generation_mid_way_fences_the_rest_and_nothing_commits(tmp_path):
    state = full_state(2)
    for fenced_after in range(WORLD):
        root = tmp_path / f"{fenced_after}"
        old = [part_store(str(root), writer_generation=1) for _ in range(WORLD)]
        fencing.acquire_generation(old[0].backend, 0)
        for rank in range(fenced_after):
            save(old[rank], 3, [rank], state)
        newer = part_store(str(root))
        assert newer.acquire_writer() == 2
        for rank in range(fenced_after, WORLD):
            with pytest.raises(FencedWriterError, match="writer generation 1 is fenced: generation 2"):
                save(old[rank], 3, [rank], state)
        for rank in range(fenced_after):
            with pytest.raises(FencedWriterError):
                old[rank].try_commit(3)
        assert manifests(root) == []
        leftovers = [p.name for p in root.glob("step-*/*")]
        assert leftovers == [], leftovers  # every fenced writer took its part back
        assert newer.salvage() is None


def test_an_old_generation_can_neither_add_a_part_nor_commit_nor_hide_a_newer_step(tmp_path, monkeypatch):
    state, newer_state = full_state(3), full_state(4)
    old = part_store(str(tmp_path), keep_last=1)
    old.acquire_writer()
    for rank in range(WORLD - 1):
        save(old, 5, [rank], state)
    new = part_store(str(tmp_path))
    assert new.acquire_writer() == 2
    # a zombie of generation 1 tries to finish its step: refused by name, nothing of it left
    with pytest.raises(FencedWriterError, match="writer generation 1 is fenced: generation 2"):
        save(old, 5, [WORLD - 1], state)
    with pytest.raises(FencedWriterError, match="generation 2"):
        old.try_commit(5)
    for step in (4, 5):
        for rank in range(WORLD):
            save(new, step, [rank], newer_state)
        assert new.try_commit(step).by_me
    # and cannot add a part to the newer generation's step: its parts go to its own directory
    with pytest.raises(FencedWriterError):
        save(old, 4, [0], state)
    parts = [decode_part(p.read_bytes()) for p in (tmp_path / new.dir_name(4)).glob("part-*.json")]
    assert sorted(p.writer_generation for p in parts) == [2] * WORLD
    # nor hide it: a stale commit that slipped through the window sorts below generation 2
    monkeypatch.setattr(fencing, "check_fence", lambda *args, **kwargs: None)  # the window between check and commit
    save(new, 6, [0], newer_state)  # generation 2 is writing step 6
    for rank in range(WORLD):
        save(old, 9, [rank], state)
    assert old.try_commit(9).by_me
    assert (tmp_path / new.dir_name(6) / part_manifest_name(0)).exists(), "its housekeeping spared the newer writer"
    assert [(r.writer_generation, r.step) for r in new.list()] == [(1, 9), (2, 4), (2, 5)]
    assert newest_sharded(new).step == 5 and newest_sharded(new).writer_generation == 2
    assert_loads(new, 5, newer_state, WORLD)


def test_housekeeping_only_by_the_committer_and_never_of_a_newer_generation(tmp_path):
    state = full_state(5)
    store = part_store(str(tmp_path), keep_last=1)
    store.acquire_writer()
    save(store, 1, [0], state)  # an older step of this generation, never completed
    for step in (2, 3):
        for rank in range(WORLD):
            save(store, step, [rank], state)
    save(store, 4, [0], state)  # a later step still being written by other writers
    assert store.try_commit(2).by_me
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert store.dir_name(1) not in names, "an older uncommitted step of its generation is removed"
    assert store.dir_name(3) in names and store.dir_name(4) in names, "later steps in flight stay"
    assert store.try_commit(3).by_me
    assert [r.step for r in store.list()] == [3]
    assert store.dir_name(4) in sorted(p.name for p in tmp_path.glob("step-*"))



def commit_at_once(stores: list[CheckpointStore], step: int, state: dict) -> tuple[dict, list]:
    """Rank r writes its part through ``stores[r]``; once every part is there, all commit at once."""
    barrier, results, errors = threading.Barrier(len(stores)), {}, []

    def writer(rank: int) -> None:
        save(stores[rank], step, [rank], state)
        barrier.wait()
        try:
            results[rank] = stores[rank].try_commit(step)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(rank,)) for rank in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def test_without_a_conditional_create_only_rank_0_creates_the_global_manifest(tmp_path):
    """A pyarrow filesystem without a conditional create (HDFS, say): ranks that find every
    part at the same moment must not each write the global manifest through a check and a
    write. Only the writer of rank 0 creates it; the others fail nothing (a shared temporary
    name once made one rank's rename fail, and its training with it) and report the step
    committed only once it is."""
    from ray_checkfreq.chaos.holds import holding_filesystem
    from ray_checkfreq.storage.backends.arrowfs import ArrowBackend

    state = full_state(2)
    plain = holding_filesystem(str(tmp_path / "no-holds"))  # no hold armed: the local disk, through pyarrow
    root = str(tmp_path / "store")
    first = part_store(root, filesystem=plain, keep_last=2)
    assert isinstance(first.backend, ArrowBackend)
    generation = first.acquire_writer()
    stores = [first, *(part_store(root, filesystem=plain, keep_last=2, writer_generation=generation)
                       for _ in range(WORLD - 1))]
    assert not first.backend.atomic_exclusive_create
    for step in range(1, 16):
        results, errors = commit_at_once(stores, step, state)
        assert errors == [], (step, errors)
        assert results[0].committed and results[0].by_me, (step, results)
        assert not any(results[rank].by_me for rank in range(1, WORLD)), (step, results)
        assert all(result.committed or not result.missing_ranks for result in results.values()), (step, results)
        assert newest_sharded(first).step == step
        assert stores[1].try_commit(step).committed  # a rank polling later finds rank 0's commit
    assert [ref.step for ref in first.list()] == [14, 15]
    assert not list((tmp_path / "store").rglob("*.tmp"))
    assert_loads(first, 15, state, WORLD)


def test_a_failed_clean_up_after_a_commit_fails_nothing_and_the_next_commit_cleans_up(tmp_path, monkeypatch):
    """The step is durable once its manifest is: removing older ones failing (another
    committer removing them too, say) must not fail the rank's persist."""
    state = full_state(3)
    store = part_store(str(tmp_path), keep_last=1)
    store.acquire_writer()
    for step in (1, 2):
        for rank in range(WORLD):
            save(store, step, [rank], state)
        if step == 2:
            def refuse(rel_dir: str) -> None:
                raise StorageError(store.backend.uri(rel_dir), "delete failed: the test says no")

            monkeypatch.setattr(store.backend, "delete_dir", refuse)
        assert store.try_commit(step).by_me
    assert [ref.step for ref in store.list()] == [2]  # 1 uncommitted (its manifest removed first) ...
    assert store.dir_name(1) in [p.name for p in tmp_path.glob("step-*")]  # ... but its directory left
    monkeypatch.undo()
    for rank in range(WORLD):
        save(store, 3, [rank], state)
    assert store.try_commit(3).by_me
    assert [ref.step for ref in store.list()] == [3]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [store.dir_name(3)]

# ------------------------------------------------------------------ salvage
def test_salvage_commits_a_complete_old_directory_only_without_a_newer_checkpoint(tmp_path):
    state = full_state(6)
    old = part_store(str(tmp_path))
    old.acquire_writer()
    for rank in range(WORLD):
        save(old, 8, [rank], state)  # every part durable, the committer died
    for rank in range(2):
        save(old, 9, [rank], state)  # incomplete: never salvaged
    new = part_store(str(tmp_path))
    new.acquire_writer()
    ref = new.salvage()
    assert ref is not None and (ref.step, ref.writer_generation) == (8, 1)
    assert_loads(new, 8, state, 3)
    assert new.reader(8).skeletons([2]) == {2: {"rng": [2, 8], "data": {"consumed": 80}}}
    # once a newer generation has committed, an old directory is no longer salvaged
    root2 = tmp_path / "second"
    old2 = part_store(str(root2))
    old2.acquire_writer()
    for rank in range(WORLD):
        save(old2, 8, [rank], state)
    new2 = part_store(str(root2))
    new2.acquire_writer()
    for rank in range(WORLD):
        save(new2, 2, [rank], state)
    new2._housekeeping = lambda *args: None  # keep the old directory to look at
    assert new2.try_commit(2).by_me
    assert new2.salvage() is None
    assert not (root2 / old2.dir_name(8) / MANIFEST_NAME).exists()


# ------------------------------------------------------------------ hostile manifests
def committed(tmp_path, state=None, steps=(1,)) -> CheckpointStore:
    store = part_store(str(tmp_path))
    store.acquire_writer()
    for step in steps:
        for rank in range(WORLD):
            save(store, step, [rank], state or full_state(step))
        assert store.try_commit(step).by_me
    return store


def rewrite_signed(path, change) -> None:
    body = json.loads(path.read_bytes())
    change(body)
    body["manifest_crc32"] = body_checksum(body)
    path.write_bytes(json.dumps(body, indent=1, allow_nan=False).encode())


@pytest.mark.parametrize(("change", "reason"), [
    (lambda b: b.__setitem__("step", 8), None),  # a flipped bit: checksum
    (lambda b: b["ranks"].__setitem__(0, 9), "ranks"),
    (lambda b: b["files"][0].__setitem__("name", "../../etc/passwd"), "not part-r"),
    (lambda b: b["chunks"][0].__setitem__("offset", 1 << 40), "past the end"),
    (lambda b: b["chunks"][0].__setitem__("sizes", [1, 1, 1]), "another rank"),
    (lambda b: b["chunks"][0].__setitem__("codec", "pickle"), "unknown codec"),
    (lambda b: b["chunks"][0].__setitem__("block_crc32", []), "block checksums"),
    (lambda b: b.__setitem__("format_version", 2), "format version"),
])
def test_a_corrupt_or_hostile_part_manifest_is_refused_by_name(tmp_path, change, reason):
    store = part_store(str(tmp_path))
    store.acquire_writer()
    for rank in range(WORLD):
        save(store, 1, [rank], full_state())
    path = tmp_path / store.dir_name(1) / part_manifest_name(2)
    if reason is None:
        data = bytearray(path.read_bytes())
        data[data.index(b'"step": 1') + 8] = ord("8")
        path.write_bytes(bytes(data))
        reason = "checksum mismatch"
    else:
        rewrite_signed(path, change)
    with pytest.raises(CorruptCheckpointError, match=reason) as err:
        store.try_commit(1)
    assert "part-r00002.json" in str(err.value)
    assert manifests(tmp_path) == []


def test_a_part_of_another_step_or_a_rank_claimed_twice_is_refused(tmp_path):
    store = part_store(str(tmp_path))
    store.acquire_writer()
    for rank in range(WORLD):
        save(store, 1, [rank], full_state())
    before = sorted(p.name for p in (tmp_path / store.dir_name(1)).iterdir())
    extra = part_store(str(tmp_path), writer_generation=store.writer_generation)
    with pytest.raises(StorageError, match="part-r00002.json: a part for these ranks is there already"):
        save(extra, 1, [2, 3], full_state())
    assert sorted(p.name for p in (tmp_path / store.dir_name(1)).iterdir()) == before  # its files taken back
    assert store.try_commit(1).by_me
    # a part of generation 1 planted in the directory of another step is refused by name
    for rank in range(WORLD):
        save(store, 2, [rank], full_state())
    planted = tmp_path / store.dir_name(2) / part_manifest_name(0)
    planted.write_bytes((tmp_path / store.dir_name(1) / part_manifest_name(0)).read_bytes())
    with pytest.raises(CorruptCheckpointError, match="part-r00000.json: step 1 of generation 1 in the directory "
                       "of step 2"):
        store.try_commit(2)


def drop_last_part(body: dict) -> None:
    """A manifest that leaves a part out, with its chunks: consistent but for the ranks."""
    gone = {f["name"] for f in body["parts"].pop()["files"]}
    for tensor in body["tensors"]:
        tensor["chunks"] = [c for c in tensor["chunks"] if c["file"] not in gone]


@pytest.mark.parametrize(("change", "reason"), [
    (lambda b: drop_last_part(b), "not every part is there exactly once"),
    (lambda b: b["tensors"][0]["chunks"].pop(), "cover"),
    (lambda b: b["tensors"][0]["chunks"][1]["offsets"].__setitem__(0, 0), "overlap"),
    (lambda b: b["parts"][0].__setitem__("ranks", [0, 1]), "cover ranks"),
    (lambda b: b.__setitem__("kind", "part"), "kind"),
])
def test_a_corrupt_or_hostile_global_manifest_is_refused_by_name_and_latest_falls_back(tmp_path, change, reason):
    store = committed(tmp_path, steps=(1, 2))
    held = newest_sharded(store)  # a ref taken before the damage
    path = tmp_path / store.dir_name(2) / MANIFEST_NAME
    rewrite_signed(path, change)
    with pytest.raises(CorruptCheckpointError, match=reason) as err:
        store.reader(held).load_boxes({"model/w": [Box((0, 0), (1, 48))]})
    assert f"{store.dir_name(2)}/manifest.json" in str(err.value)
    assert newest_sharded(store).step == 1
    assert_loads(store, 1, full_state(1), 2)


def test_a_manifest_is_decoded_once_per_store_until_its_bytes_change(tmp_path, monkeypatch):
    """A restore lists the store several times (salvage, latest, the load); decoding a large
    manifest costs ~0.1 s, so each is decoded once, and again only when its bytes changed."""
    import ray_checkfreq.storage.catalog as catalog

    store = committed(tmp_path, steps=(1, 2))
    decoded: list[int] = []

    def counting(data: bytes):
        manifest = decode_global(data)
        decoded.append(manifest.step)
        return manifest

    monkeypatch.setattr(catalog, "decode_any_manifest", counting)
    reader = part_store(str(tmp_path))
    assert [ref.step for ref in reader.list()] == [1, 2] and sorted(decoded) == [1, 2]
    assert newest_sharded(reader).step == 2 and reader.reader(2).manifest.step == 2
    assert_loads(reader, 2, full_state(2), WORLD)
    assert sorted(decoded) == [1, 2]
    rewrite_signed(tmp_path / store.dir_name(2) / MANIFEST_NAME,
                   lambda body: body.__setitem__("created_unix_ns", body["created_unix_ns"] + 1))
    assert newest_sharded(reader).step == 2 and sorted(decoded) == [1, 2, 2]


def test_a_flipped_data_byte_is_caught_by_its_block_checksum(tmp_path):
    store = part_store(str(tmp_path), crc_block_bytes=4096)
    store.acquire_writer()
    state = full_state(7)
    for rank in range(WORLD):
        save(store, 1, [rank], state)
    store.try_commit(1)
    chunk = store.reader(1).manifest.tensor("model/w").chunks[1]
    path = tmp_path / store.dir_name(1) / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.offset + 5000] ^= 1  # block 1 of rank 1's rows
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in tensor 'model/w'.*block 1") as err:
        store.reader(1).load_boxes({"model/w": [Box((64, 0), (64, 96))]})
    assert chunk.file in str(err.value)
    # rows in blocks that are intact still load (the damage is contained to its block):
    # block 2 of the chunk starts at byte 8192, within its row 10
    got = store.reader(1).load_boxes({"model/w": [Box((75, 0), (20, 96))]})["model/w"][0]
    assert torch.equal(got, state["model/w"][75:95])


# ------------------------------------------------------------------ resharding by ranged reads
class RecordingBackend:
    def __init__(self, backend):
        self.backend = backend
        self.reads: list[tuple[str, int, int]] = []

    def read_range(self, path, offset, length):
        self.reads.append((path, offset, length))
        return self.backend.read_range(path, offset, length)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def reshard_checks(store: CheckpointStore, state: dict) -> None:
    for rank in range(WORLD):
        save(store, 1, [rank], state)
    assert store.try_commit(1).by_me
    for world in (1, 2, 3, 4, 5):
        assert_loads(store, 1, state, world)
    # a 2-D mesh-like layout of the Shard(0) weight: 3 x 2 grid boxes
    grid = [Box((lo, c0), (hi - lo, c1 - c0)) for lo, hi in rows(256, 3) for c0, c1 in ((0, 20), (20, 96))]
    for box, got in zip(grid, store.reader(1).load_boxes({"model/w": grid})["model/w"]):
        assert torch.equal(got, state["model/w"][box.slices()])
    # rows 80..120 lie in rank 1's chunk (rows 64..128): only that chunk's bytes are read,
    # its overlap widened to whole 4 KiB CRC blocks at most
    recorder = RecordingBackend(store.backend)
    store.backend = recorder
    got = store.reader(1).load_boxes({"model/w": [Box((80, 0), (40, 96))]})["model/w"][0]
    store.backend = recorder.backend
    assert torch.equal(got, state["model/w"][80:120])
    chunk = store.reader(1).manifest.tensor("model/w").chunks[1]
    assert len(recorder.reads) == 1
    path, offset, length = recorder.reads[0]
    assert path.endswith(chunk.file)
    row = 96 * 8
    assert chunk.offset + 16 * row - 4096 <= offset <= chunk.offset + 16 * row  # row 80 = its row 16
    assert 40 * row <= length <= 40 * row + 2 * 4096 < chunk.length


def test_resharding_from_local_storage_reads_only_overlapping_ranges(tmp_path):
    reshard_checks(_with_writer(part_store(str(tmp_path), crc_block_bytes=4096)), full_state(8))


def test_resharding_with_compressed_chunks_decodes_them_whole(tmp_path):
    store = _with_writer(part_store(str(tmp_path), codec="rcfz"))
    state = full_state(9)
    for rank in range(WORLD):
        save(store, 1, [rank], state)
    store.try_commit(1)
    assert {c.codec for t in store.reader(1).manifest.tensors for c in t.chunks} >= {"rcfz"}
    for world in (1, 3):
        assert_loads(store, 1, state, world)


@pytest.mark.s3
def test_resharding_from_s3_reads_only_overlapping_ranges(s3_server, s3_bucket):
    from ray_checkfreq import S3Options

    store = _with_writer(part_store(f"s3://{s3_bucket}/sharded", s3=S3Options(endpoint_url=s3_server),
                                      crc_block_bytes=4096))
    reshard_checks(store, full_state(10))
    assert newest_sharded(store).uri.startswith(f"s3://{s3_bucket}/sharded/step-000000000001-g000001-")


def _with_writer(store: CheckpointStore) -> CheckpointStore:
    store.acquire_writer()
    return store


@pytest.mark.parametrize("kind", ["posix", "arrow"])
def test_read_range_on_local_backends(tmp_path, kind):
    from ray_checkfreq.storage.backends import open_backend
    from ray_checkfreq.storage.backends.arrowfs import ArrowBackend

    if kind == "posix":
        backend = open_backend(str(tmp_path))
    else:
        import pyarrow.fs

        backend = ArrowBackend(pyarrow.fs.LocalFileSystem(), str(tmp_path))
    backend.make_dir("d")
    data = bytes(range(256)) * 40
    backend.write("d/f.bin", [data])
    assert bytes(backend.read_range("d/f.bin", 1000, 3000)) == data[1000:4000]
    assert bytes(backend.read_range("d/f.bin", 10000, 500)) == data[10000:]  # short at the end
    assert bytes(backend.read_range("d/f.bin", 20000, 10)) == b""


@pytest.mark.s3
def test_read_range_on_s3(s3_server, s3_bucket):
    from ray_checkfreq import S3Options
    from ray_checkfreq.storage.backends import open_backend

    backend = open_backend(f"s3://{s3_bucket}/ranges", s3=S3Options(endpoint_url=s3_server))
    data = bytes(range(256)) * 40
    backend.write("d/f.bin", [data])
    assert bytes(backend.read_range("d/f.bin", 1000, 3000)) == data[1000:4000]
    assert bytes(backend.read_range("d/f.bin", 10000, 500)) == data[10000:]
    assert bytes(backend.read_range("d/f.bin", 20000, 10)) == b""


def test_a_store_without_a_generation_reads_but_does_not_write(tmp_path):
    committed(tmp_path)
    reader = part_store(str(tmp_path))
    assert newest_sharded(reader).step == 1
    with pytest.raises(StorageError, match="no writer generation"):
        save(reader, 2, [0], full_state())
    assert math.prod(reader.reader(1).manifest.tensor("model/w").global_shape) == 256 * 96
