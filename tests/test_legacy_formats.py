"""Checkpoints written before the one-format change (formats 1, 2 and 3, committed under
``tests/fixtures/legacy`` by the code that wrote them: ``make_legacy.py`` there) still load,
bit for bit, through today's store, with their deltas, history copies and sharded parts."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from store_helpers import part_store

from ray_checkfreq import CheckpointStore, codec
from ray_checkfreq.storage.chunks import Box
from ray_checkfreq.storage.store import CheckpointStore

FIXTURES = Path(__file__).parent / "fixtures" / "legacy"


def state_of(step: int) -> dict:
    """What the fixtures' step ``step`` holds (as make_legacy.py wrote it)."""
    g = np.random.default_rng(step)
    return {"model": {"w": torch.from_numpy(g.uniform(-0.5, 0.5, (16, 8)).astype(np.float32)),
                      "half": torch.from_numpy(g.uniform(-1, 1, 40)).to(torch.bfloat16)},
            "optimizer": {"step": torch.tensor(step), "counts": np.arange(step, step + 5)},
            "iterator": {"epoch": step // 2, "lr": 0.1 / step, "name": "legacy"}}


def copy_of(tmp_path: Path, name: str) -> str:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    return str(target)


def assert_same(loaded: dict, expected: dict) -> None:
    for key in ("w", "half"):
        assert loaded["model"][key].dtype == expected["model"][key].dtype
        assert torch.equal(loaded["model"][key], expected["model"][key])
    assert torch.equal(loaded["optimizer"]["step"], expected["optimizer"]["step"])
    assert np.array_equal(loaded["optimizer"]["counts"], expected["optimizer"]["counts"])
    assert loaded["iterator"] == expected["iterator"]


def test_format_1_checkpoints_and_their_deltas_load_bit_for_bit(tmp_path):
    store = CheckpointStore(copy_of(tmp_path, "format1"))
    refs = store.list()
    assert [(r.step, r.epoch_boundary, dict(r.meta)) for r in refs] == [
        (1, False, {"note": "full"}), (2, False, {"note": "delta"}), (3, True, {})]
    for ref in refs:
        assert_same(store.load(ref), state_of(ref.step))
        store.verify(ref)
    assert store.latest().step == 3


def test_format_2_history_copies_load_trimmed_and_are_never_latest(tmp_path):
    store = CheckpointStore(copy_of(tmp_path, "format2"))
    refs = store.list()
    assert [(r.step, r.trimmed) for r in refs] == [(1, True), (3, True), (4, False), (5, False)]
    assert store.latest().step == 5
    assert_same(store.load(), state_of(5))
    copy = store.load(3)
    exact = state_of(3)
    for key in ("w", "half"):
        trimmed = codec.trim(exact["model"][key], precision_factor=1024)
        assert torch.equal(copy["model"][key], trimmed)
    assert copy["iterator"] == exact["iterator"]


def test_format_3_sharded_checkpoints_load_and_reshard(tmp_path):
    store = part_store(copy_of(tmp_path, "format3"))
    (ref,) = store.list()
    assert (ref.step, ref.world_size) == (7, 2)
    w = torch.arange(48, dtype=torch.float32).reshape(12, 4)
    got = store.reader(ref).load_boxes({"model/w": [Box((0, 0), (12, 4)), Box((3, 0), (5, 4))]})["model/w"]
    assert torch.equal(torch.as_tensor(got[0]), w) and torch.equal(torch.as_tensor(got[1]), w[3:8])
    assert store.reader(ref).skeletons() == {0: {"rank": 0, "step": 7}, 1: {"rank": 1, "step": 7}}


def test_a_sharded_checkpoint_with_foreign_skeletons_loads_as_saved(tmp_path):
    """``save_part`` with skeletons of the caller's own (not the engine's): ``load`` by step,
    and with no step (the store's newest), gives every tensor whole and each rank's skeleton."""
    store = part_store(copy_of(tmp_path, "format3"))
    w = torch.arange(48, dtype=torch.float32).reshape(12, 4)
    for state in (store.load(7), store.load()):
        assert sorted(state) == ["skeletons", "tensors"] and sorted(state["tensors"]) == ["model/w"]
        assert torch.equal(torch.as_tensor(state["tensors"]["model/w"]), w)
        assert state["skeletons"] == {0: {"rank": 0, "step": 7}, 1: {"rank": 1, "step": 7}}
    assert store.latest().step == 7


@pytest.mark.parametrize("name", ["format1", "format2", "format3"])
def test_the_fixtures_are_not_changed_by_reading(tmp_path, name):
    before = {p.relative_to(FIXTURES): p.read_bytes() for p in (FIXTURES / name).rglob("*") if p.is_file()}
    store = CheckpointStore(str(FIXTURES / name))
    store.list()
    after = {p.relative_to(FIXTURES): p.read_bytes() for p in (FIXTURES / name).rglob("*") if p.is_file()}
    assert before == after
