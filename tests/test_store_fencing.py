"""Writer fencing: two writers on one URI, e.g. an old rank 0 still running after a restart.

Writer A is the older writer, B the newer one. The interleavings are staged by hooking
A's or B's backend at the exact point where the other writer acts; the last test races
two real processes.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import time
from urllib.parse import urlparse

import pytest
import torch
from faultproxy import FaultProxy

from ray_checkfreq import CheckpointStore, FencedWriterError, S3Options, StorageError


def _state(step: int) -> dict:
    return {"w": torch.full((4096,), float(step)), "step": step}


@pytest.fixture(params=["posix", "pyarrow", pytest.param("s3", marks=pytest.mark.s3)])
def open_store(request, tmp_path):
    """A store opener for one URI: ``open_store(**store_options)``. "pyarrow" is a pyarrow.fs
    filesystem without conditional creates (a local one wrapped, so it is not the POSIX backend)."""
    if request.param == "posix":
        return functools.partial(CheckpointStore, str(tmp_path / "run"))
    if request.param == "pyarrow":
        from pyarrow import fs as pafs

        filesystem = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
        return functools.partial(CheckpointStore, "run", filesystem=filesystem)
    return functools.partial(CheckpointStore, f"s3://{request.getfixturevalue('s3_bucket')}/run")


def _steps(open_store) -> list[int]:
    return [ref.step for ref in open_store().list()]


def _all_verify(open_store) -> None:
    reader = open_store()
    for ref, name, fault in reader.scan():
        assert fault is None and ref is not None, f"{name} is torn or uncommitted: {fault}"
        reader.verify(ref)


def _hook(store: CheckpointStore, method: str, action, *, after: bool = False, when=lambda path: True) -> None:
    """Run ``action()`` once, before (or after) ``store.backend.<method>`` on a matching path."""
    real = getattr(store.backend, method)
    pending = [True]

    def hooked(path, *args, **kwargs):
        fire = pending[0] and when(path)
        if fire and not after:
            pending[0] = False
            action()
        result = real(path, *args, **kwargs)
        if fire and after:
            pending[0] = False
            action()
        return result

    setattr(store.backend, method, hooked)


def _is_manifest(path: str) -> bool:
    return path.endswith("manifest.json")


def test_a_stale_writer_is_fenced_and_the_new_writers_saves_stay_latest(open_store):
    a = open_store(keep_last=2)
    a.save(1, _state(1))
    a.save(5, _state(5))
    b = open_store(keep_last=2)
    b.save(2, _state(2))
    with pytest.raises(FencedWriterError) as info:
        a.save(9, _state(9))
    assert a.writer_generation < b.writer_generation
    assert (info.value.writer_generation, info.value.newer_generation) == (a.writer_generation, b.writer_generation)
    assert f"writer generation {a.writer_generation} is fenced: generation {b.writer_generation}" in str(info.value)
    assert isinstance(info.value, StorageError)
    assert pickle.loads(pickle.dumps(info.value)).args == info.value.args
    reader = open_store()
    assert reader.latest().step == 2 and reader.latest().writer_generation == b.writer_generation
    assert not [name for _, name, _ in reader.scan() if name.startswith("step-000000000009-")], "A committed nothing"
    b.save(3, _state(3))
    assert _steps(open_store) == [2, 3]  # B's retention ordered A's checkpoints below its own
    assert torch.equal(reader.load()["w"], _state(3)["w"])
    with pytest.raises(FencedWriterError):
        a.save(10, _state(10))


def test_a_commit_that_slips_past_the_fence_never_becomes_latest_and_spares_the_new_writer(open_store):
    """B takes over between A's last fence check and A's commit: A's save goes through (the
    documented race), but its checkpoint sorts below B's and A's retention leaves B's alone."""
    a = open_store(keep_last=1, full_every=1)  # no deltas: 9 does not need 5, 3 not 2
    a.save(5, _state(5))
    b = open_store(keep_last=5, full_every=1)
    _hook(a, "create_exclusive", b.acquire_writer, when=_is_manifest)
    _hook(a, "create_exclusive", lambda: (b.save(2, _state(2)), b.save(3, _state(3))), after=True, when=_is_manifest)
    a.save(9, _state(9))
    assert _steps(open_store) == [9, 2, 3]  # A's retention (keep_last=1) removed only its own older 5
    assert open_store().latest().step == 3
    _all_verify(open_store)


def test_the_new_writer_removing_an_old_writers_save_in_flight_fences_it_and_nothing_is_torn(open_store):
    """B's leftover cleanup removes A's directory between A's fence check and A's commit
    (on S3 A's manifest PUT then succeeds anyway): A must undo its commit and say why."""
    a = open_store(keep_last=2)
    a.save(1, _state(1))
    b = open_store(keep_last=2)
    _hook(a, "create_exclusive", lambda: b.save(2, _state(2)), when=_is_manifest)
    with pytest.raises(FencedWriterError):
        a.save(9, _state(9))
    assert _steps(open_store) == [1, 2]
    assert open_store().latest().step == 2
    _all_verify(open_store)


def test_an_old_writer_never_removes_the_new_writers_save_in_flight(open_store):
    a = open_store()
    a.save(1, _state(1))
    b = open_store()
    b.acquire_writer()
    fenced = []

    def old_writer_saves():
        with pytest.raises(FencedWriterError) as info:
            a.save(9, _state(9))
        fenced.append(info.value)

    _hook(b, "write", old_writer_saves, after=True)  # B has written a shard, not its manifest
    assert b.save(2, _state(2)).step == 2
    assert fenced and open_store().latest().step == 2
    _all_verify(open_store)


def test_reading_takes_no_generation_and_creates_nothing(tmp_path):
    missing = tmp_path / "missing"
    reader = CheckpointStore(str(missing))
    assert reader.list() == [] and reader.latest() is None and reader.scan() == []
    assert not missing.exists()
    writer = CheckpointStore(str(tmp_path / "run"))
    writer.save(1, _state(1))
    markers = sorted(os.listdir(tmp_path / "run" / "writers"))
    reader = CheckpointStore(str(tmp_path / "run"))
    reader.load()
    reader.verify(reader.latest())
    assert reader.writer_generation is None
    assert sorted(os.listdir(tmp_path / "run" / "writers")) == markers
    writer.save(2, _state(2))  # a reader does not fence the writer


def test_a_pickled_store_is_a_new_writer_and_a_generation_can_be_handed_over(tmp_path):
    uri = str(tmp_path / "run")
    original = CheckpointStore(uri)
    original.save(1, _state(1))
    clone = pickle.loads(pickle.dumps(original))
    assert clone.writer_generation is None
    clone.save(2, _state(2))
    with pytest.raises(FencedWriterError):
        original.save(3, _state(3))

    generation = CheckpointStore(uri).acquire_writer()  # e.g. taken by a driver, handed to a worker
    worker = CheckpointStore(uri, writer_generation=generation)
    assert worker.save(3, _state(3)).writer_generation == generation
    with pytest.raises(FencedWriterError):
        clone.save(4, _state(4))
    with pytest.raises(StorageError, match="writer generation 99 was never taken"):
        CheckpointStore(uri, writer_generation=99).save(5, _state(5))
    for bad in (0, True, "1"):
        with pytest.raises(ValueError, match="writer_generation"):
            CheckpointStore(uri, writer_generation=bad)


def test_checkpoints_written_before_fencing_still_load_and_sort_below_new_ones(tmp_path):
    from legacy_writer import write_format_1

    root = tmp_path / "run"
    old_name = "step-000000000007-c21e37fd"  # the pre-fencing layout: no generation anywhere
    write_format_1(str(root / old_name), 7, _state(7))

    reader = CheckpointStore(str(root))
    assert [(r.step, r.writer_generation, r.name) for r in reader.list()] == [(7, 0, old_name)]
    assert torch.equal(reader.load()["w"], _state(7)["w"])
    writer = CheckpointStore(str(root), keep_last=3)
    writer.save(3, _state(3))
    assert writer.writer_generation == 1
    assert [r.step for r in reader.list()] == [7, 3] and reader.latest().step == 3


@pytest.mark.s3
def test_s3_commits_and_generations_are_conditional_puts_and_survive_a_lost_reply(s3_server, s3_bucket):
    with FaultProxy(urlparse(s3_server).port) as proxy:
        store = CheckpointStore(f"s3://{s3_bucket}/cond", s3=S3Options(endpoint_url=proxy.url))
        proxy.add_rule(lambda m, p: m == "PUT" and "manifest.json" in p, "lose_reply", times=1)
        store.save(1, _state(1))  # the retried conditional PUT finds its own manifest there
        assert [action for _, _, action in proxy.injected] == ["lose_reply"]
        puts = [(path, headers) for method, path, headers in proxy.headers if method == "PUT"]
        conditional = {path.split("?")[0].rsplit("/", 2)[-2] for path, headers in puts
                       if headers.get("If-None-Match") == "*"}
        assert "writers" in conditional and any(part.startswith("step-000000000001-") for part in conditional)
        assert not store.backend.create_exclusive("writers/gen-000000000001.json", b"someone else")
        assert CheckpointStore(f"s3://{s3_bucket}/cond").load()["step"] == 1


_RACER = """
import json, os, sys, time
import numpy as np
from ray_checkfreq import CheckpointStore, FencedWriterError

uri, first_step, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = CheckpointStore(uri, keep_last=2, shard_size_bytes=1 << 20, io_threads=2)
while not os.path.exists(go):
    time.sleep(0.01)
saved, fenced, after_both = [], None, 0
try:
    # Save until fenced, or until 25 saves went through after both writers took a generation.
    for step in range(first_step, first_step + 10_000):
        state = {"w": np.full(600_000, step, dtype=np.float32), "step": step}
        saved.append([step, store.save(step, state, codec="raw").name])
        after_both += len(os.listdir(os.path.join(uri, "writers"))) >= 2
        if after_both >= 25:
            break
except FencedWriterError as err:
    fenced = [err.writer_generation, err.newer_generation]
print(json.dumps({"generation": store.writer_generation, "saved": saved, "fenced": fenced}))
"""


def test_two_processes_racing_saves_leave_the_newest_writers_newest_save_latest(tmp_path):
    uri, go = str(tmp_path / "run"), str(tmp_path / "go")
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, uri, str(first), go], stdout=subprocess.PIPE, text=True)
              for first in (1, 1000)]
    time.sleep(1.0)
    open(go, "w").close()
    results = []
    for racer in racers:
        out, _ = racer.communicate(timeout=240)
        assert racer.returncode == 0
        results.append(json.loads(out))
    loser, winner = sorted(results, key=lambda r: r["generation"])
    assert winner["fenced"] is None and len(winner["saved"]) >= 25
    assert loser["fenced"] == [loser["generation"], winner["generation"]]
    latest = CheckpointStore(uri).latest()
    assert latest.name == winner["saved"][-1][1] and latest.writer_generation == winner["generation"]
    _all_verify(functools.partial(CheckpointStore, uri))
