"""Shared-memory snapshot slots: round trip, torn writes, corruption, leftover sweeping."""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import tempfile
import time
import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from state_strategies import assert_same_state, states

from ray_checkfreq.ray import slots
from ray_checkfreq.ray.slots import (
    SLOT_COMPLETE,
    SLOT_EMPTY,
    SLOT_WRITING,
    MappedSlot,
    SlotError,
    create_slot_file,
    data_capacity_for,
    meta_capacity_for,
    process_start_time,
    shm_free_bytes,
    slot_file_bytes,
    slot_layout,
    sweep_leftovers,
)
from ray_checkfreq.storage.tree import flatten_state, unflatten_state

LAYOUT = slot_layout([(("model", "w"), (64, 33), torch.float32), (("model", "b"), (7,), torch.bfloat16),
                      (("opt", 0, "step"), (), torch.int64)])


def make_slot(path: str, layout: slots.SlotLayout = LAYOUT, **names: str) -> MappedSlot:
    create_slot_file(path, run=names.get("run", "run-1"), node=names.get("node", "node-a"), incarnation=3,
                     data_capacity=data_capacity_for(layout), meta_capacity=meta_capacity_for(layout))
    return MappedSlot.open(path)


def write_complete(slot: MappedSlot, step: int, fill: float) -> dict:
    """A full snapshot of ``LAYOUT`` whose values all derive from ``fill``; returns a private copy."""
    views = slot.begin_write(step=step, generation=1, layout=LAYOUT)
    for view in views.values():
        view.fill_(fill)
    state = {"model": {"w": views[("model", "w")], "b": views[("model", "b")]},
             "opt": {0: {"step": views[("opt", 0, "step")]}}, "data": {"epoch": 2, "seen": np.arange(4)}}
    slot.finish_write(state)
    return _cloned(state)


def _cloned(state: dict) -> dict:
    flat = flatten_state(state)
    return unflatten_state(flat.skeleton, [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf.copy()
                                           for leaf in flat.leaves])


# ------------------------------------------------------------------ round trip
@settings(max_examples=60, deadline=None)
@given(states)
def test_any_state_round_trips_through_slot_views(state):
    flat = flatten_state(state)
    tensor_paths = [(p, leaf) for p, leaf in zip(flat.paths, flat.leaves) if isinstance(leaf, torch.Tensor)]
    layout = slot_layout([(p, leaf.shape, leaf.dtype) for p, leaf in tensor_paths])
    with tempfile.TemporaryDirectory() as directory, make_slot(os.path.join(directory, "rcf-s"), layout) as slot:
        views = slot.begin_write(step=9, generation=4, layout=layout)
        for path, leaf in tensor_paths:
            views[path].copy_(leaf)
        written = unflatten_state(flat.skeleton, [views.get(p, leaf) if isinstance(leaf, torch.Tensor) else leaf
                                                  for p, leaf in zip(flat.paths, flat.leaves)])
        written["off-slot tensor"] = torch.arange(5, dtype=torch.int16)
        expected = {**state, "off-slot tensor": torch.arange(5, dtype=torch.int16)}
        slot.finish_write(written)

        header, mapped = slot.read()
        assert (header.state, header.step, header.generation, header.layout_hash) == (SLOT_COMPLETE, 9, 4, layout.hash)
        assert_same_state(expected, mapped)
        _, copied = slot.read(copy=True)
        assert_same_state(expected, copied)
        _assert_stored_by_offset(views, mapped, copied)
        del views, mapped, copied


def _assert_stored_by_offset(views: dict, mapped: dict, copied: dict) -> None:
    """Slot tensors come back as views of the mapping (no copy) or, with copy=True, off it."""
    read_back = {p: leaf for p, leaf in zip(flatten_state(mapped).paths, flatten_state(mapped).leaves)}
    private = {p: leaf for p, leaf in zip(flatten_state(copied).paths, flatten_state(copied).leaves)}
    for path, view in views.items():
        if view.numel():
            assert read_back[path].data_ptr() == view.data_ptr(), path
            assert private[path].data_ptr() != view.data_ptr(), path


def test_copied_read_is_private_and_mapped_read_follows_the_slot(tmp_path):
    slot = make_slot(str(tmp_path / "rcf-a"))
    write_complete(slot, step=1, fill=1.0)
    _, mapped = slot.read()
    _, copied = slot.read(copy=True)
    write_complete(slot, step=2, fill=2.0)
    assert copied["model"]["w"].eq(1.0).all()
    assert mapped["model"]["w"].eq(2.0).all()


def test_close_with_live_views_keeps_them_valid(tmp_path):
    slot = make_slot(str(tmp_path / "rcf-a"))
    write_complete(slot, step=1, fill=3.0)
    _, mapped = slot.read()
    slot.close()  # views alive: must neither raise nor unmap under them
    assert mapped["model"]["w"].eq(3.0).all()
    with pytest.raises(ValueError):
        slot.header()


# ------------------------------------------------------------------ torn writes
def test_begun_but_unfinished_slot_is_refused_and_the_other_slot_stays(tmp_path):
    slot_a, slot_b = make_slot(str(tmp_path / "rcf-a")), make_slot(str(tmp_path / "rcf-b"))
    expected_a = write_complete(slot_a, step=1, fill=1.0)
    write_complete(slot_b, step=2, fill=2.0)
    views = slot_b.begin_write(step=3, generation=1, layout=LAYOUT)
    for view in views.values():
        view.fill_(3.0)  # the whole copy happened, only finish_write is missing
    with pytest.raises(SlotError, match=r"rcf-b.*WRITING"):
        slot_b.read()
    header, restored = slot_a.read()
    assert header.step == 1
    assert_same_state(expected_a, restored)


def _copy_half_then_hang(path: str, copied_half) -> None:
    slot = MappedSlot.open(path)
    views = slot.begin_write(step=7, generation=2, layout=LAYOUT)
    weight = views[("model", "w")].view(-1)
    weight[: weight.numel() // 2].fill_(7.0)
    copied_half.set()
    time.sleep(120)


def test_sigkill_mid_copy_leaves_a_slot_that_is_never_restored(tmp_path):
    path_a, path_b = str(tmp_path / "rcf-a"), str(tmp_path / "rcf-b")
    slot_a, slot_b = make_slot(path_a), make_slot(path_b)
    expected_a = write_complete(slot_a, step=5, fill=5.0)
    write_complete(slot_b, step=4, fill=4.0)  # the older content the child overwrites
    context = multiprocessing.get_context("spawn")
    copied_half = context.Event()
    child = context.Process(target=_copy_half_then_hang, args=(path_b, copied_half))
    child.start()
    try:
        assert copied_half.wait(timeout=120), "child never started copying"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(timeout=30)
    assert child.exitcode == -signal.SIGKILL
    reopened = MappedSlot.open(path_b)
    assert (reopened.header().state, reopened.header().step) == (SLOT_WRITING, 7)
    with pytest.raises(SlotError, match="rcf-b.*torn"):
        reopened.read()
    header, restored = MappedSlot.open(path_a).read(copy=True)
    assert header.step == 5
    assert_same_state(expected_a, restored)


def test_finish_interrupted_before_its_checksum_is_stored_stays_writing(tmp_path, monkeypatch):
    slot = make_slot(str(tmp_path / "rcf-a"))
    write_complete(slot, step=1, fill=1.0)

    def die(*args):
        raise KeyboardInterrupt("killed while sealing")

    monkeypatch.setattr(slots, "_digest", die)
    with pytest.raises(KeyboardInterrupt):
        write_complete(slot, step=2, fill=2.0)
    assert slot.header().state == SLOT_WRITING
    with pytest.raises(SlotError, match="WRITING"):
        slot.read()


def test_finish_without_begin_is_refused(tmp_path):
    slot = make_slot(str(tmp_path / "rcf-a"))
    with pytest.raises(SlotError, match="EMPTY"):
        slot.finish_write({"x": 1})
    with pytest.raises(SlotError, match="EMPTY"):
        slot.read()


def test_meta_overflow_names_the_size_and_leaves_the_slot_unreadable(tmp_path):
    slot = make_slot(str(tmp_path / "rcf-a"))
    write_complete(slot, step=1, fill=1.0)
    slot.begin_write(step=2, generation=1, layout=LAYOUT)
    too_big = np.zeros(meta_capacity_for(LAYOUT), dtype=np.uint8)
    with pytest.raises(SlotError, match=r"meta needs \d+ bytes, the slot holds \d+"):
        slot.finish_write({"big": too_big})
    with pytest.raises(SlotError, match="WRITING"):
        slot.read()


# ------------------------------------------------------------------ corruption
def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x10]))


def test_flipped_data_byte_fails_the_crc(tmp_path):
    path = str(tmp_path / "rcf-a")
    slot = make_slot(path)
    write_complete(slot, step=1, fill=1.0)
    _flip_byte(path, slots.HEADER_BYTES + 1000)
    for copy in (False, True):
        with pytest.raises(SlotError, match=r"rcf-a.*data crc32 mismatch"):
            slot.read(copy=copy)


def test_a_store_keeps_the_seals_checksums_so_bytes_changed_before_the_persist_fail_the_load(tmp_path):
    from ray_checkfreq.errors import CorruptCheckpointError
    from ray_checkfreq.storage import CheckpointStore

    path = str(tmp_path / "rcf-a")
    slot = make_slot(path)
    expected = write_complete(slot, step=1, fill=1.5)
    store = CheckpointStore(str(tmp_path / "store"), full_every=1)
    _, state, crcs = slot.read_with_checksums(verify_data=False)
    assert len(crcs) == len(flatten_state(state).leaves) and crcs.count(None) == 1  # data/seen: in the meta region
    store.save(1, state, codec="raw", raw_crc32=crcs)
    del state
    assert torch.equal(store.load()["model"]["w"], expected["model"]["w"])
    _flip_byte(path, slots.HEADER_BYTES + 1000)  # RAM changed after the seal, before the persist
    _, state, crcs = slot.read_with_checksums(verify_data=False)
    for codec in ("raw", "rcfz"):
        store.save(2, state, codec=codec, raw_crc32=crcs)
        with pytest.raises(CorruptCheckpointError, match="model"):
            store.load(2)
        store.delete(2)
    with pytest.raises(ValueError, match="raw_crc32 has 1 checksums for 4 leaves"):
        store.save(3, state, raw_crc32=[0])


def test_flipped_meta_byte_is_refused(tmp_path):
    path = str(tmp_path / "rcf-a")
    slot = make_slot(path)
    write_complete(slot, step=1, fill=1.0)
    _flip_byte(path, slots.HEADER_BYTES + slot.header().data_capacity + 40)
    with pytest.raises(SlotError, match=r"rcf-a.*meta"):
        slot.read()


@pytest.mark.parametrize("damage", ["empty", "short header", "cut data", "bad magic", "bad version"])
def test_damaged_file_is_not_opened(tmp_path, damage):
    path = str(tmp_path / "rcf-a")
    make_slot(path).close()
    with open(path, "r+b") as file:
        if damage == "empty":
            file.truncate(0)
        elif damage == "short header":
            file.truncate(100)
        elif damage == "cut data":
            file.truncate(slots.HEADER_BYTES + 10)
        elif damage == "bad magic":
            file.write(b"NOTASLOT")
        else:
            file.seek(8)
            file.write(struct.pack("<I", 99))
    with pytest.raises(SlotError, match=f"^{path}: "):
        MappedSlot.open(path)


# ------------------------------------------------------------------ leftovers
def _create_and_exit(path: str) -> None:
    create_slot_file(path, run="dead-run", node="n", incarnation=0, data_capacity=4096, meta_capacity=4096)


def _rewrite_creator(path: str, *, pid: int | None = None, start: int | None = None) -> None:
    """Rewrite the creator fields: pid at byte 56, start time at 60 (after magic, version,
    state, seq, step, generation and layout hash)."""
    with open(path, "r+b") as file:
        if pid is not None:
            file.seek(56)
            file.write(struct.pack("<I", pid))
        if start is not None:
            file.seek(60)
            file.write(struct.pack("<Q", start))


def test_sweep_removes_only_slots_of_dead_creators(tmp_path):
    directory = str(tmp_path)
    dead, live, reused = (os.path.join(directory, f"rcf-{name}") for name in ("dead", "live", "reused"))
    not_a_slot, other_prefix = os.path.join(directory, "rcf-junk"), os.path.join(directory, "other-dead")
    child = multiprocessing.get_context("spawn").Process(target=_create_and_exit, args=(dead,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0 and MappedSlot.open(dead).header().creator_pid == child.pid
    for path in (live, reused, other_prefix):
        create_slot_file(path, run="r", node="n", incarnation=0, data_capacity=4096, meta_capacity=4096)
    _rewrite_creator(reused, start=process_start_time(os.getpid()) + 1)  # our pid, another process's start
    _rewrite_creator(other_prefix, pid=child.pid, start=MappedSlot.open(dead).header().creator_start)
    with open(not_a_slot, "wb") as file:
        file.write(b"x" * 5000)

    removed = sweep_leftovers(directory, prefix="rcf-")

    assert sorted(removed) == sorted([dead, reused])
    assert sorted(os.listdir(directory)) == ["other-dead", "rcf-junk", "rcf-live"]
    assert MappedSlot.open(live).header().creator_pid == os.getpid()


def test_process_start_time():
    assert process_start_time(os.getpid()) == process_start_time(os.getpid()) > 0
    assert 0 <= process_start_time(1) < process_start_time(os.getpid())  # pid 1 started first
    assert process_start_time(2**22 + 12345) is None


# ------------------------------------------------------------------ layout and header
def test_layout_offsets_are_aligned_and_in_order():
    layout = slot_layout([(("a",), (3,), torch.float32), (("b",), (5,), torch.int8), (("c",), (2, 2), torch.float64)])
    assert [layout.entries[(k,)][0] for k in "abc"] == [0, 64, 128]
    assert layout.data_bytes == 128 + 32


def test_layout_hash_changes_with_key_shape_dtype_and_order():
    base = [(("a",), (3,), torch.float32), (("b", 0), (2, 2), torch.bfloat16)]
    variants = [
        [(("a",), (4,), torch.float32), base[1]],
        [(("a",), (3,), torch.float16), base[1]],
        [(("x",), (3,), torch.float32), base[1]],
        [(("a",), (3,), torch.float32), (("b", "0"), (2, 2), torch.bfloat16)],
        [base[1], base[0]],
        [(("a",), (3,), torch.float32), (("b", 0), (4,), torch.bfloat16)],
    ]
    hashes = {slot_layout(v).hash for v in variants}
    assert slot_layout(list(base)).hash == slot_layout(list(base)).hash
    assert len(hashes) == len(variants) and slot_layout(base).hash not in hashes
    with pytest.raises(ValueError, match="twice"):
        slot_layout([base[0], base[0]])


def test_fits_and_begin_write_on_a_small_slot(tmp_path):
    small = slot_layout([(("w",), (1000,), torch.float32)])
    large = slot_layout([(("w",), (1025,), torch.float32)])
    slot = make_slot(str(tmp_path / "rcf-a"), small)
    assert slot.fits(small) and not slot.fits(large)
    with pytest.raises(SlotError, match="needs 4100 data bytes"):
        slot.begin_write(step=1, generation=1, layout=large)
    assert slot.header().state == SLOT_EMPTY


def test_header_after_create_and_bad_names(tmp_path):
    path = str(tmp_path / "rcf-a")
    slot = make_slot(path, run="r" * 64, node="nöde")
    header = slot.header()
    assert (header.run, header.node, header.incarnation, header.state, header.seq) == ("r" * 64, "nöde", 3, 0, 0)
    assert (header.creator_pid, header.creator_start) == (os.getpid(), process_start_time(os.getpid()))
    assert os.path.getsize(path) == slot_file_bytes(LAYOUT)
    write_complete(slot, step=1, fill=1.0)
    write_complete(slot, step=2, fill=1.0)
    assert slot.header().seq == 2
    with pytest.raises(ValueError, match="64"):
        create_slot_file(str(tmp_path / "rcf-b"), run="r" * 65, node="n", incarnation=0,
                         data_capacity=4096, meta_capacity=4096)
    assert not os.path.exists(tmp_path / "rcf-b")
    with pytest.raises(FileExistsError):
        make_slot(path)


class _FakeCudart:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(("register", address, nbytes))
        return 0

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0


def test_pinning_is_a_no_op_without_cuda_and_undone_on_close(tmp_path, monkeypatch):
    slot = make_slot(str(tmp_path / "rcf-a"))
    if not torch.cuda.is_available():
        assert slots.register_pinned(slot) is False
        slots.unregister_pinned(slot)
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    views = slot.begin_write(step=1, generation=1, layout=LAYOUT)
    assert slots.register_pinned(slot)
    (_, address, nbytes), = fake.calls
    assert address == views[("model", "w")].data_ptr() - slots.HEADER_BYTES
    assert nbytes == slot_file_bytes(LAYOUT)
    slot.close()
    slot.close()
    assert fake.calls[1:] == [("unregister", address)]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_slot_in_dev_shm():
    assert shm_free_bytes() > 0
    path = f"/dev/shm/rcf-test-{uuid.uuid4().hex}"
    try:
        slot = make_slot(path)
        expected = write_complete(slot, step=1, fill=6.0)
        _, restored = MappedSlot.open(path).read(copy=True)
        assert_same_state(expected, restored)
    finally:
        os.unlink(path)
