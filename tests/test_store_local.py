"""CheckpointStore on local disk: round trips, commit protocol, retention, faults."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from state_strategies import assert_same_state, states

from ray_checkfreq import (
    CheckpointNotFoundError,
    CheckpointStore,
    CorruptCheckpointError,
    StorageError,
    UnsupportedStateError,
)
from ray_checkfreq.storage.manifest import body_checksum


def training_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.default_rng(seed).bit_generator.state},
        "iterator": {"epoch": 1, "consumed": 128},
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states)
def test_round_trip_is_bit_identical_for_any_nested_state(tmp_path_factory, state):
    store = CheckpointStore(str(tmp_path_factory.mktemp("rt")), shard_size_bytes=64)
    ref = store.save(7, state, meta={"note": "x"})
    assert_same_state(state, store.load(ref))
    assert_same_state(state, store.load())


def test_training_state_restores_into_model_and_optimizer(tmp_path):
    store = CheckpointStore(str(tmp_path))
    state = training_state()
    store.save(3, state)
    loaded = store.load(3)
    assert_same_state(state, loaded)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    model.load_state_dict(loaded["model"])
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(loaded["optimizer"])
    # int keys of the optimizer state survived: the moments are attached to the params
    assert set(opt.state_dict()["state"]) == {0, 1, 2, 3, 4, 5}
    assert isinstance(loaded["model"], OrderedDict) and hasattr(loaded["model"], "_metadata")


def test_latest_is_none_on_an_empty_store_and_load_says_so(tmp_path):
    store = CheckpointStore(str(tmp_path / "nothing"))
    assert store.latest() is None and store.list() == []
    with pytest.raises(CheckpointNotFoundError, match="no valid checkpoint"):
        store.load()


def test_file_uri_and_plain_path_are_the_same_store(tmp_path):
    CheckpointStore(f"file://{tmp_path}").save(1, {"x": torch.arange(3)})
    assert [r.step for r in CheckpointStore(str(tmp_path)).list()] == [1]


def _checkpoint_dirs(root) -> list[str]:
    return [name for name in os.listdir(root) if name.startswith("step-")]


def test_retention_keeps_newest_and_epoch_boundaries(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, full_every=1)
    for step in range(1, 8):
        store.save(step, {"x": torch.full((4,), step)}, epoch_boundary=(step == 3))
    assert [r.step for r in store.list()] == [3, 6, 7]
    assert len(_checkpoint_dirs(tmp_path)) == 3


def test_deltas_keep_their_base_and_a_full_checkpoint_comes_every_n_saves(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, full_every=3, keep_epoch_boundaries=False)
    weights = torch.randn(10_000)
    for step in range(1, 8):
        weights[step * 10] += 1.0  # consecutive checkpoints differ in a few values
        store.save(step, {"w": weights.clone(), "step": step})
    bases = {ref.step: _manifest(tmp_path, ref)["parts"][0]["delta_base"] for ref in store.list()}
    # saves 1, 4, 7 are full; 5 and 6 are deltas against 4, which retention keeps
    assert sorted(bases) == [4, 6, 7]
    assert bases[4] is None and bases[7] is None and bases[6].startswith("step-000000000004-")
    for ref in store.list():
        store.verify(ref)
    assert torch.equal(store.load(6)["w"][60], weights[60]) and torch.equal(store.load()["w"], weights)
    store.save(8, {"w": weights.clone(), "step": 8})  # a delta against 7: 4 and 6 can go
    assert [r.step for r in store.list()] == [7, 8]


def test_a_delta_whose_base_is_damaged_falls_back(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path), keep_last=3, full_every=4)
    for step in (1, 2, 3):
        store.save(step, {"w": torch.arange(5000, dtype=torch.float32) + step})
    base = store.list()[0]
    _flip_bit(_shard(tmp_path, base), 200)
    caplog.set_level(logging.WARNING, logger="ray_checkfreq.storage")
    assert store.latest() is None  # 2 and 3 are deltas against the damaged 1
    assert "delta base is unusable" in caplog.text and base.name in caplog.text


def _manifest(tmp_path, ref) -> dict:
    return json.loads((tmp_path / ref.name / "manifest.json").read_text())


def test_compressed_and_raw_checkpoints_both_load(tmp_path):
    state = training_state()
    compressed = CheckpointStore(str(tmp_path / "z"))
    raw = CheckpointStore(str(tmp_path / "r"), codec="raw")
    compressed.save(1, state)
    raw.save(1, state)
    def codecs(root, ref) -> set[str]:
        return {c["codec"] for t in _manifest(root, ref)["tensors"] for c in t["chunks"]}
    assert codecs(tmp_path / "z", compressed.latest()) == {"rcfz"}
    assert codecs(tmp_path / "r", raw.latest()) == {"raw"}
    assert_same_state(state, compressed.load())
    assert_same_state(state, raw.load())


def test_retention_without_epoch_boundaries(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=1, keep_epoch_boundaries=False, full_every=1)
    for step in range(1, 5):
        store.save(step, {"x": torch.full((4,), step)}, epoch_boundary=True)
    assert [r.step for r in store.list()] == [4]


def test_a_shard_that_lands_short_fails_the_save_and_keeps_the_only_intact_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=1)
    store.save(1, {"x": torch.ones(1000)})
    original_write = store.backend.write

    def torn_write(rel_path, chunks):  # the new checkpoint's shard lands short
        original_write(rel_path, [bytes(memoryview(chunks[0])[:10])])

    store.backend.write = torn_write
    with pytest.raises(StorageError, match="missing or short before the commit") as info:
        store.save(2, {"x": torch.ones(1000)})
    store.backend.write = original_write
    assert "step-000000000002-" in str(info.value)
    assert [r.step for r in store.list()] == [1]
    assert store.latest().step == 1


def test_leftovers_of_an_interrupted_save_are_cleaned_on_the_next_save(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"x": torch.ones(3)})
    leftover = tmp_path / "step-000000000002-deadbeef"
    leftover.mkdir()
    (leftover / "shard-00000.bin").write_bytes(b"partial")
    assert [r.step for r in store.list()] == [1]  # no manifest: not a checkpoint
    store.save(3, {"x": torch.ones(3)})
    assert not leftover.exists()


def test_resaving_a_step_writes_new_files_and_the_newest_wins(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=3)
    first = store.save(5, {"x": torch.zeros(2)})
    second = store.save(5, {"x": torch.ones(2)})
    assert first.name != second.name
    assert torch.equal(store.load(5)["x"], torch.ones(2))
    assert store.latest() == second


def _shard(tmp_path, ref) -> str:
    """The checkpoint's (first) data file."""
    return str(min((tmp_path / ref.name).glob("*.bin")))


def _two_checkpoints(tmp_path):
    store = CheckpointStore(str(tmp_path))
    good = store.save(1, {"w": torch.arange(1000, dtype=torch.float32)})
    bad = store.save(2, {"w": torch.arange(1000, dtype=torch.float32) * 2})
    return store, good, bad


def _flip_bit(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncate", "truncated"),
        ("flip_shard", "checksum mismatch|codec blob"),  # latest() decodes as load() does
        ("delete_shard", "data file is missing"),
        ("flip_manifest", "manifest"),
        ("future_version", "format version 99 is not supported"),
        ("escape", "is not part-r<first rank>-<token>-<n>.bin"),
    ],
)
def test_a_damaged_latest_checkpoint_falls_back_with_a_warning(tmp_path, caplog, damage, reason):
    store, good, bad = _two_checkpoints(tmp_path)
    shard = _shard(tmp_path, bad)
    manifest_path = tmp_path / bad.name / "manifest.json"
    if damage == "truncate":
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif damage == "flip_shard":
        _flip_bit(shard, os.path.getsize(shard) // 2)
    elif damage == "delete_shard":
        os.unlink(shard)
    elif damage == "flip_manifest":
        text = manifest_path.read_bytes()
        _flip_bit(str(manifest_path), text.index(b'"length"') + 12)
    else:
        body = json.loads(manifest_path.read_text())
        if damage == "future_version":
            body["format_version"] = 99
        else:
            body["parts"][0]["files"][0]["name"] = "../../etc/passwd"
            body["tensors"][0]["chunks"][0]["file"] = "../../etc/passwd"
            body["manifest_crc32"] = body_checksum(body)  # well-formed, but hostile
        manifest_path.write_text(json.dumps(body, indent=1))
    caplog.set_level(logging.WARNING, logger="ray_checkfreq.storage")
    assert store.latest() == good
    assert bad.name in caplog.text and re.search(reason, caplog.text)
    assert torch.equal(store.load()["w"], torch.arange(1000, dtype=torch.float32))
    with pytest.raises(CorruptCheckpointError, match=reason) as info:
        store.verify(bad)
    assert bad.name in str(info.value)
    with pytest.raises(CorruptCheckpointError):
        store.load(bad)  # asked for by name: never silently substituted


def test_every_single_bit_flip_in_a_manifest_is_detected(tmp_path):
    store = CheckpointStore(str(tmp_path))
    ref = store.save(1, {"w": torch.ones(2), "lr": 0.1, "tag": "abc"}, meta={"k": 1})
    path = tmp_path / ref.name / "manifest.json"
    original = path.read_bytes()
    for position in range(0, len(original), 7):
        for bit in (0x01, 0x20, 0x80):
            damaged = bytearray(original)
            damaged[position] ^= bit
            path.write_bytes(bytes(damaged))
            with pytest.raises(CorruptCheckpointError):
                store.verify(ref)
    path.write_bytes(original)
    store.verify(ref)


@pytest.mark.parametrize(
    "state, key_path",
    [
        ({"model": {"w": torch.ones(1)}, "opt": {"fn": print}}, "opt/fn"),
        ({"a": [1, 2, object()]}, "a/2"),
        ({"a": {(1, 2): 3}}, "a/(1, 2)"),
        ({"a": np.array(["x"], dtype=object)}, "a"),
        ({"a": torch.ones(2).to_sparse()}, "a"),
        ({"a": {1, 2}}, "a"),
    ],
)
def test_unsupported_state_is_refused_by_key_path_before_any_write(tmp_path, state, key_path):
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"x": torch.ones(1)})
    with pytest.raises(UnsupportedStateError) as info:
        store.save(2, state)
    assert info.value.key_path == key_path and repr(key_path) in str(info.value)
    assert [r.step for r in store.list()] == [1]
    assert len(_checkpoint_dirs(tmp_path)) == 1


def test_invalid_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0"):
        CheckpointStore(str(tmp_path), keep_last=0)
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(ValueError, match="step=-1"):
        store.save(-1, {})
    with pytest.raises(UnsupportedStateError, match="meta"):
        store.save(1, {}, meta={"x": object()})


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs: a real ENOSPC. Mounting needs root (CI and the dev machines run as root)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_fails_the_save_clearly_and_keeps_the_last_checkpoint(tiny_disk):
    store = CheckpointStore(str(tiny_disk))
    store.save(1, {"w": torch.ones(1000)})
    with pytest.raises(StorageError, match="no space left on device") as info:
        store.save(2, {"w": torch.randn(1_000_000)})  # ~3.4 MB compressed, into 2 MiB
    assert str(tiny_disk) in str(info.value)
    assert [r.step for r in store.list()] == [1]
    assert len(_checkpoint_dirs(tiny_disk)) == 1  # the partial directory is gone
    assert torch.equal(store.load()["w"], torch.ones(1000))
    store.save(3, {"w": torch.zeros(1000)})  # space was given back
    assert store.latest().step == 3


def test_store_pickles_for_ray_actors(tmp_path):
    import pickle

    store = CheckpointStore(str(tmp_path), keep_last=3)
    store.save(1, {"x": torch.ones(1)})
    clone = pickle.loads(pickle.dumps(store))
    assert clone.config.keep_last == 3 and [r.step for r in clone.list()] == [1]


def test_delete_uncommits_first_and_names_a_missing_step(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=3, full_every=1)
    for step in (1, 2, 3):
        store.save(step, {"x": torch.full((3,), step)})
    store.delete(3)
    assert [r.step for r in store.list()] == [1, 2]
    assert store.latest().step == 2
    with pytest.raises(CheckpointNotFoundError, match="step 9"):
        store.delete(9)


def test_retention_keeps_the_newest_verified_checkpoint_when_newer_ones_are_bit_rotted(tmp_path):
    """Retention judges "intact" by shard sizes: bit rot in the newest keep_last passes that
    test, so without more a save sorting below them would be deleted by its own retention."""
    store = CheckpointStore(str(tmp_path), keep_last=2, codec="raw")  # byte 100 is tensor data
    rotted = [store.save(step, {"w": torch.full((1000,), float(step))}) for step in (10, 20)]
    for ref in rotted:
        _flip_bit(_shard(tmp_path, ref), 100)
    ref = store.save(5, {"w": torch.full((1000,), 5.0)})  # a rollback: below 10 and 20 in order
    assert ref in store.list()
    assert store.latest() == ref and torch.equal(store.load()["w"], torch.full((1000,), 5.0))
    newer = store.save(6, {"w": torch.full((1000,), 6.0)})
    assert store.latest() == newer
    assert [r.step for r in store.list()] == [6, 10, 20]  # 5 went once 6 was the newest verified


def test_a_local_pyarrow_filesystem_is_fsynced(tmp_path, monkeypatch):
    from pyarrow import fs as pafs

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    store = CheckpointStore(str(tmp_path / "arrow"), filesystem=pafs.LocalFileSystem(), shard_size_bytes=4096)
    store.save(1, {"a": torch.ones(2048), "b": torch.zeros(2048)})
    # two shards, the manifest, the writer marker, and their directories
    assert len(synced) >= 6
    assert torch.equal(CheckpointStore(str(tmp_path / "arrow")).load()["a"], torch.ones(2048))


@pytest.mark.parametrize("arrow", [False, True])
def test_a_local_store_writes_one_shard_at_a_time_whatever_io_threads_says(tmp_path, arrow):
    """Parallel writes into one local filesystem cost kernel CPU beside training and gain nothing."""
    import threading
    import time

    from pyarrow import fs as pafs

    store = CheckpointStore(str(tmp_path / "s"), filesystem=pafs.LocalFileSystem() if arrow else None,
                            shard_size_bytes=4096, io_threads=4, codec="raw")
    writing, most = [0], [0]
    lock = threading.Lock()
    real_write = store.backend.write

    def counted_write(rel_path, chunks):
        with lock:
            writing[0] += 1
            most[0] = max(most[0], writing[0])
        time.sleep(0.05)  # long enough for the other threads of a pool to start theirs
        try:
            real_write(rel_path, chunks)
        finally:
            with lock:
                writing[0] -= 1

    store.backend.write = counted_write
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}  # 4 shards of 4 KiB
    store.save(1, state)
    assert most[0] == 1
    assert torch.equal(CheckpointStore(str(tmp_path / "s")).load()["t3"], state["t3"])


def test_listing_one_step_reads_only_that_steps_manifests(tmp_path, monkeypatch):
    from ray_checkfreq.storage import commit

    store = CheckpointStore(str(tmp_path), keep_last=3, full_every=1)  # no deltas: each step reads alone
    for step in (1, 2, 3):
        store.save(step, {"w": torch.full((4,), float(step))})
    refs = store.list()
    read: list[str] = []
    real_read = commit.read_listed_manifest

    def counted(backend, name):
        read.append(name)
        return real_read(backend, name)

    monkeypatch.setattr(commit, "read_listed_manifest", counted)
    fresh = CheckpointStore(str(tmp_path), keep_last=3, full_every=1)  # nothing decoded yet
    assert fresh.list(step=2) == [refs[1]] and fresh.list(step=4) == []
    assert torch.equal(fresh.load(3)["w"], torch.full((4,), 3.0))  # a step resolves the same way
    assert set(read) == {refs[1].name, refs[2].name}
    assert fresh.list() == refs and refs[0].name in read  # a full listing reads them all
    with pytest.raises(TypeError, match="step"):
        fresh.list(step="2")
