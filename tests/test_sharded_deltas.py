"""XOR deltas per chunk in sharded checkpoints (format 4): a writer's part is a delta of the
same chunks of its newest committed full part, read back bit for bit through ranged reads,
refused by name when its base is unusable, and never left without its base by retention."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from store_helpers import part_store

from ray_checkfreq import codec
from ray_checkfreq.errors import CorruptCheckpointError, StorageError
from ray_checkfreq.storage import commit
from ray_checkfreq.storage.arrays import leaf_bytes, leaf_spec
from ray_checkfreq.storage.chunks import Box
from ray_checkfreq.storage.encoding import EncodeOptions, decode_leaf, encode_leaf
from ray_checkfreq.storage.history import HistoryTrim
from ray_checkfreq.storage.manifest import MANIFEST_NAME, ManifestError, body_checksum, decode_global, decode_part
from ray_checkfreq.storage.store import CheckpointStore
from tests.test_sharded_store import assert_loads, chunks_of, full_state, piece, rank_boxes, save

WORLD = 2


def drifted(step: int) -> dict:
    """A state that changes a little from step to step (what deltas are for)."""
    state = full_state(0)
    state["model/w"] = state["model/w"] + 1e-9 * step
    state["optim/step"] = torch.tensor(float(step))
    return state


def stores(tmp_path, full_every: int = 4, **kwargs) -> list[CheckpointStore]:
    first = part_store(str(tmp_path), codec="rcfz", full_every=full_every, **kwargs)
    generation = first.acquire_writer()
    second = part_store(str(tmp_path), codec="rcfz", full_every=full_every, writer_generation=generation, **kwargs)
    return [first, second]


def save_step(writers: list[CheckpointStore], step: int) -> None:
    for rank, writer in enumerate(writers):
        save(writer, step, [rank], drifted(step), WORLD)
    assert any(writer.try_commit(step).committed for writer in writers)
    for writer in writers:
        assert writer.try_commit(step).committed


def global_manifest(store: CheckpointStore, step: int):
    return decode_global(store.backend.read_small(f"{store.dir_name(step)}/{MANIFEST_NAME}"))


def test_parts_between_full_ones_are_deltas_and_load_bit_for_bit(tmp_path):
    writers = stores(tmp_path, full_every=3, keep_last=8)
    for step in range(1, 7):
        save_step(writers, step)
    kinds = []
    for step in range(1, 7):
        manifest = global_manifest(writers[0], step)
        kinds.append("delta" if manifest.delta_bases else "full")
        deltas = [c for t in manifest.tensors for c in t.chunks if c.delta]
        if manifest.delta_bases:
            assert manifest.delta_bases == {writers[0].dir_name(step - (step - 1) % 3)}
            assert deltas and all(c.codec == "rcfz" for c in deltas)
        else:
            assert not deltas
        assert_loads(writers[0], step, drifted(step), WORLD)
        assert_loads(writers[0], step, drifted(step), 3)  # resharded reads decode deltas too
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta"]
    full, delta = (global_manifest(writers[0], s).size_bytes for s in (4, 5))
    assert delta < full / 2, (full, delta)


def test_raw_codec_and_full_every_one_write_no_delta(tmp_path):
    for kwargs in ({"full_every": 1}, {}):
        root = tmp_path / str(len(kwargs))
        first = part_store(str(root), codec="rcfz", **kwargs)
        first.acquire_writer()
        for step in (1, 2, 3):
            save(first, step, [0], drifted(step), 1)
            assert first.try_commit(step).committed
            assert not global_manifest(first, step).delta_bases
    raw = part_store(str(tmp_path / "raw"), codec="raw", full_every=4)
    raw.acquire_writer()
    for step in (1, 2):
        save(raw, step, [0], drifted(step), 1)
        raw.try_commit(step)
        assert not global_manifest(raw, step).delta_bases


def test_retention_keeps_the_base_of_every_kept_delta(tmp_path):
    writers = stores(tmp_path, full_every=8, keep_last=1, keep_epoch_boundaries=False)
    for step in range(1, 6):
        save_step(writers, step)
    names = [ref.name for ref in writers[0].list()]
    assert names == [writers[0].dir_name(1), writers[0].dir_name(5)]  # the base and the newest
    assert_loads(writers[0], 5, drifted(5), WORLD)


def test_retention_keeps_an_older_base_after_the_writers_moved_to_a_new_one(tmp_path):
    writers = stores(tmp_path, full_every=3, keep_last=2, keep_epoch_boundaries=False)
    for step in range(1, 5):  # full, delta, delta, full
        save_step(writers, step)
    assert [ref.step for ref in writers[0].list()] == [1, 3, 4]  # 3 is kept, so is its base
    assert_loads(writers[0], 3, drifted(3), WORLD)


def test_a_removed_base_makes_the_next_part_full_and_a_delta_of_it_refused_by_name(tmp_path):
    writers = stores(tmp_path, full_every=8, keep_last=8)
    save_step(writers, 1)
    save_step(writers, 2)
    base = writers[0].dir_name(1)
    commit.remove_committed(writers[0].backend, base, writers[0].writer_generation)
    with pytest.raises(CorruptCheckpointError, match=f"delta base is unusable \\({base}\\)"):
        writers[0].reader(2).load_boxes({"model/w": [Box((0, 0), (256, 96))]})
    save_step(writers, 3)  # the writers see the base gone: full parts
    assert not global_manifest(writers[0], 3).delta_bases
    assert_loads(writers[0], 3, drifted(3), WORLD)


def test_a_delta_whose_base_went_before_the_commit_is_not_committed(tmp_path):
    writers = stores(tmp_path, full_every=8, keep_last=8)
    save_step(writers, 1)
    for rank, writer in enumerate(writers):
        save(writer, 2, [rank], drifted(2), WORLD)
    commit.remove_committed(writers[0].backend, writers[0].dir_name(1), writers[0].writer_generation)
    with pytest.raises(StorageError, match="delta base"):
        writers[0].try_commit(2)
    assert [ref.step for ref in writers[0].list()] == []


def _rewrite(store: CheckpointStore, path: str, change) -> None:
    body = json.loads(store.backend.read_small(path))
    change(body)
    body.pop("manifest_crc32")
    body["manifest_crc32"] = body_checksum(body)
    from ray_checkfreq.storage.canonical_json import dumps_indented

    store.backend.delete_file(path)
    store.backend.write(path, [dumps_indented(body)])


def test_a_delta_of_a_delta_is_refused_by_name(tmp_path):
    writers = stores(tmp_path, full_every=8, keep_last=8)
    for step in (1, 2, 3):
        save_step(writers, step)
    # Point step 3's deltas at step 2 (itself a delta): the reader must refuse, not decode garbage.
    path = f"{writers[0].dir_name(3)}/{MANIFEST_NAME}"
    delta_dir = writers[0].dir_name(2)

    def retarget(body: dict) -> None:
        for part in body["parts"]:
            if part["delta_base"] is not None:
                part["delta_base"] = delta_dir
    _rewrite(writers[0], path, retarget)
    reader = part_store(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="no full chunk"):
        reader.reader(3).load_boxes({"model/w": [Box((0, 0), (256, 96))]})


@pytest.mark.parametrize("change, reason", [
    (lambda b: b.__setitem__("delta_base", None), "missing for its delta chunks"),
    (lambda b: b.__setitem__("delta_base", "../elsewhere"), "not a checkpoint directory name"),
    (lambda b: b["chunks"][0].__setitem__("delta", "yes"), "'delta' is not true or false"),
    (lambda b: b.update(format_version=3), "format version 3"),
])
def test_hostile_delta_fields_in_a_part_are_refused_by_name(tmp_path, change, reason):
    writers = stores(tmp_path, full_every=8)
    save_step(writers, 1)
    part = writers[0].save_part(2, world_size=WORLD, skeletons={0: {}}, chunks=chunks_of(drifted(2), [0], WORLD))
    assert part.delta_base is not None
    body = json.loads(writers[0].backend.read_small(f"{writers[0].dir_name(2)}/{part.name}"))
    change(body)
    body.pop("manifest_crc32")
    body["manifest_crc32"] = body_checksum(body)
    from ray_checkfreq.storage.canonical_json import dumps_indented

    with pytest.raises(ManifestError, match=reason):
        decode_part(dumps_indented(body))


def test_format_3_manifests_still_decode(tmp_path):
    store = part_store(str(tmp_path), codec="raw")
    store.acquire_writer()
    save(store, 1, [0], drifted(1), 1)
    store.try_commit(1)
    path = f"{store.dir_name(1)}/{MANIFEST_NAME}"

    def as_format_3(body: dict) -> None:
        body["format_version"] = 3
        for field in ("placement", "meta", "history_trim"):
            del body[field]
        for part in body["parts"]:
            del part["delta_base"]
        for tensor in body["tensors"]:
            for chunk in tensor["chunks"]:
                del chunk["delta"]
    _rewrite(store, path, as_format_3)
    manifest = decode_global(store.backend.read_small(path))
    assert manifest.parts[0].delta_base is None
    got = part_store(str(tmp_path)).reader(1).load_boxes({"optim/v": [Box((0,), (10,))]})["optim/v"][0]
    assert np.array_equal(np.asarray(got), drifted(1)["optim/v"])


def test_a_sharded_epoch_boundary_is_kept_near_lossless_as_one_part_of_every_rank(tmp_path):
    """History trimming in the sharded placement: the committer rewrites an old epoch
    boundary trimmed, as one part covering every rank (same chunks, same skeletons), commits
    the copy, then deletes the exact one."""
    trim = HistoryTrim(precision_factor=2 ** 10)
    writers = stores(tmp_path, full_every=1, keep_last=1, history_trim=trim)
    for step in (1, 2, 3):
        for rank, writer in enumerate(writers):
            skeleton = {rank: {"rng": [rank, step]}}
            writer.save_part(step, world_size=WORLD, skeletons=skeleton, epoch_boundary=step == 1,
                             chunks=chunks_of(drifted(step), [rank], WORLD))
        assert any(writer.try_commit(step).by_me for writer in writers)
    refs = writers[0].list()
    assert [(ref.step, ref.trimmed, ref.placement, ref.world_size) for ref in refs] == \
        [(1, True, "sharded", WORLD), (3, False, "sharded", WORLD)]
    reader = writers[0].reader(refs[0])
    assert [(part.name, part.ranks) for part in reader.manifest.parts] == [("part-r00000.json", (0, 1))]
    assert reader.skeletons() == {0: {"rng": [0, 1]}, 1: {"rng": [1, 1]}}
    rounded = 0
    for key, value in drifted(1).items():  # each chunk trimmed by itself, as each rank's piece
        for box in rank_boxes(key, tuple(value.shape), WORLD):
            got = reader.load_boxes({key: [box]})[key][0]
            want = trim.trim_leaf(piece(value, box))
            rounded += leaf_bytes(want) != leaf_bytes(piece(value, box))
            if isinstance(want, torch.Tensor):
                assert torch.equal(got, want), key
            else:
                np.testing.assert_array_equal(got, want)
    assert rounded > 0  # the copy is not the exact checkpoint


def test_a_writer_that_never_commits_writes_deltas_of_its_committed_full_part(tmp_path):
    """As a sharded run saves: every writer saves its part and tries the commit once; the
    last to write (rank 0) commits, and rank 1, told nothing, learns of the commit itself."""
    writers = stores(tmp_path, full_every=4, keep_last=8)
    for step in range(1, 6):
        for rank in (1, 0):
            save(writers[rank], step, [rank], drifted(step), WORLD)
            assert writers[rank].try_commit(step).committed == (rank == 0)
    base = writers[0].dir_name(1)
    for rank in (0, 1):
        bases = [next(p.delta_base for p in global_manifest(writers[0], step).parts if p.ranks == (rank,))
                 for step in range(1, 6)]
        assert bases == [None, base, base, base, None], f"rank {rank}"
    for step in range(1, 6):
        assert_loads(writers[0], step, drifted(step), WORLD)


def noisy(step: int) -> dict:
    """``drifted`` plus a moment-like tensor drawn anew every step: its XOR delta is noise."""
    state = drifted(step)
    state["optim/m"] = torch.randn(256, 96, generator=torch.Generator().manual_seed(100 + step))
    return state


def test_a_chunk_whose_delta_is_larger_is_stored_full_beside_deltas_and_all_load_exactly(tmp_path):
    writers = stores(tmp_path, full_every=8, keep_last=8)
    for step in (1, 2):
        for rank, writer in enumerate(writers):
            save(writer, step, [rank], noisy(step), WORLD)
        assert writers[1].try_commit(step).committed
    kinds = {}
    for tensor in global_manifest(writers[0], 2).tensors:
        for chunk in tensor.chunks:
            new, old = (piece(noisy(s)[tensor.key], chunk.box) for s in (2, 1))
            full, delta = len(codec.encode(new)), len(codec.encode(new, base=old))
            assert chunk.length == min(full, delta) and chunk.delta == (delta < full), (tensor.key, full, delta)
            kinds.setdefault(tensor.key, set()).add(chunk.delta)
    assert kinds["optim/m"] == {False} and kinds["model/w"] == {True}  # a mix, in every part
    assert all(p.delta_base == writers[0].dir_name(1) for p in global_manifest(writers[0], 2).parts)
    for world in (WORLD, 3):  # resharded reads mix the two kinds within a box too
        assert_loads(writers[0], 2, noisy(2), world)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(0, 3000), bits=st.integers(0, 32),
       changed=st.floats(0, 1), as_torch=st.booleans())
@example(seed=0, size=0, bits=0, changed=0.0, as_torch=True)  # a tie (empty): full, which needs no base
def test_each_chunk_is_the_smaller_of_its_delta_and_full_forms_and_decodes_exactly(seed, size, bits, changed,
                                                                                    as_torch):
    """From values that differ from the base in nothing to values that differ in every bit;
    a tie goes full."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(size).astype(np.float32)
    flips = (rng.integers(0, 2**bits, size, dtype=np.uint64) * (rng.random(size) < changed)).astype(np.uint32)
    leaf = (base.view(np.uint32) ^ flips).view(np.float32)
    if as_torch:
        leaf, base = torch.from_numpy(leaf), torch.from_numpy(base)
    got = encode_leaf(leaf, EncodeOptions(threads=1), base)
    full, delta = len(codec.encode(leaf, threads=1)), len(codec.encode(leaf, base=base, threads=1))
    assert len(got.data) == min(full, delta) and got.delta == (delta < full), (full, delta)
    back = decode_leaf(leaf_spec(leaf), got.codec, got.data, 0, len(got.data), got.raw_crc32,
                       base=base if got.delta else None)
    assert leaf_bytes(back) == leaf_bytes(leaf)


def test_a_part_whose_step_was_never_committed_is_neither_a_base_nor_counted(tmp_path):
    writers = stores(tmp_path, full_every=3, keep_last=8)
    for step in range(1, 6):
        for rank in (1, 0) if step in (2, 4, 5) else (1,):  # rank 0 skips 1 and 3: never committed
            save(writers[rank], step, [rank], drifted(step), WORLD)
            assert writers[rank].try_commit(step).committed == (rank == 0)
    bases = [{p.ranks: p.delta_base for p in global_manifest(writers[0], step).parts}[(1,)] for step in (2, 4, 5)]
    assert bases == [None, writers[0].dir_name(2), writers[0].dir_name(2)]
    assert_loads(writers[0], 5, drifted(5), WORLD)
