"""The engine's state adapter (ray_checkfreq/engine/state.py) on real FSDP2, HSDP and TP
ranks (CPU gloo, spawned processes, float64): local chunks with their global boxes and
owners, restore in place at the same and at other world sizes, and the plain adapter's
equality with today's flattened state.

The spawned runs share one directory per module: a save at world size 2, restores at 2, 3
and 1 from it, and one 4-rank run for HSDP and TP (tests/sharded_state_jobs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sharded_state_jobs as jobs
import torch

from ray_checkfreq.engine.restore import RestoreMismatchError
from ray_checkfreq.engine.state import Box, PlainStateAdapter, is_sharded, state_adapter
from ray_checkfreq.errors import UnsupportedStateError
from ray_checkfreq.storage.tree import flatten_state, leaves_of, skeleton_leaf_refs, unflatten_state


@pytest.fixture(scope="module")
def saved_w2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded")
    jobs.spawn(jobs.save_job, 2, str(root))
    return root


def _restored(root: Path, world: int) -> tuple[dict, dict]:
    if not (root / f"restored-w{world}.npz").exists():
        jobs.spawn(jobs.restore_job, world, str(root))
    return jobs.load_arrays(root / f"restored-w{world}.npz"), jobs.load_arrays(root / f"continued-w{world}.npz")


def _mismatches(expected: dict, got: dict) -> list[str]:
    assert sorted(expected) == sorted(got)
    return [name for name in expected if not np.array_equal(expected[name], got[name])]


def _tiles_exactly(records: list[dict]) -> None:
    """The owned boxes of each tensor cover it once: no element twice, none missing."""
    by_name: dict[str, list[dict]] = {}
    for record in records:
        if record["owner"]:
            by_name.setdefault(record["name"], []).append(record)
    every = {record["name"]: record["global_shape"] for record in records}
    for name, shape in every.items():
        hits = np.zeros(shape, dtype=np.int64)
        for record in by_name.get(name, []):
            hits[tuple(slice(o, o + n) for o, n in zip(record["offsets"], record["sizes"]))] += 1
        assert (hits == 1).all(), f"{name}: owned boxes cover elements {sorted(set(hits.ravel().tolist()))} times"


def test_fsdp2_chunks_are_global_boxes_owned_once(saved_w2: Path) -> None:
    per_rank = json.loads((saved_w2 / "saved-boxes.json").read_text())
    mine = [{r["name"]: r for r in records} for records in per_rank]
    assert [(m["model/inp.weight"]["offsets"], m["model/inp.weight"]["sizes"]) for m in mine] == \
        [([0, 0], [4, 8]), ([4, 0], [3, 8])]  # 7 rows over 2 ranks: 4 + 3 (ceil-div)
    exp_avg = "optimizer/state/out.weight/exp_avg"  # keyed by parameter name, not index
    assert [(m[exp_avg]["offsets"], m[exp_avg]["global_shape"]) for m in mine] == [([0, 0], [5, 7]), ([3, 0], [5, 7])]
    assert [m["model/scale"]["owner"] for m in mine] == [True, False]  # a plain buffer: rank 0's copy
    assert [m["optimizer/state/inp.weight/step"]["sharded"] for m in mine] == [False, False]
    _tiles_exactly([r for records in per_rank for r in records])


def test_same_world_restore_is_bit_identical_and_training_continues_identically(saved_w2: Path) -> None:
    restored, continued = _restored(saved_w2, 2)
    assert _mismatches(jobs.load_arrays(saved_w2 / "ref-saved.npz"), restored) == []
    assert _mismatches(jobs.load_arrays(saved_w2 / "ref-after.npz"), continued) == []


@pytest.mark.parametrize("world", [3, 1])
def test_restore_at_another_world_size_reshards(saved_w2: Path, world: int) -> None:
    restored, continued = _restored(saved_w2, world)
    assert _mismatches(jobs.load_arrays(saved_w2 / "ref-saved.npz"), restored) == []
    after = jobs.load_arrays(saved_w2 / "ref-after.npz")
    worst = max(float(np.max(np.abs(after[name] - continued[name]), initial=0.0)) for name in after)
    print(f"world size {world}: largest difference after {jobs.MORE} more steps: {worst:.3g}")
    assert worst <= 1e-9  # the same global batch; another reduction order, so not bit for bit
    per_rank = json.loads((saved_w2 / f"boxes-w{world}.json").read_text())
    rows = [next(r for r in records if r["name"] == "model/inp.weight") for records in per_rank]
    assert [(r["offsets"][0], r["sizes"][0]) for r in rows] == ([(0, 3), (3, 3), (6, 1)] if world == 3 else [(0, 7)])
    if world == 3:
        gate = [next(r for r in records if r["name"] == "model/gate.weight") for records in per_rank]
        assert [r["sizes"][0] for r in gate] == [1, 1, 0]  # an empty local shard is filled with nothing


def test_partly_sharded_model_is_refused_by_name(saved_w2: Path) -> None:
    _restored(saved_w2, 1)  # the world-size-1 run also tries a model with one layer sharded
    message = (saved_w2 / "mixed.txt").read_text()
    assert message.startswith("UnsupportedStateError") and "'model/norm.weight'" in message, message


@pytest.fixture(scope="module")
def hsdp_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hsdp_tp")
    jobs.spawn(jobs.hsdp_tp_job, 4, str(root))
    return root


def test_hsdp_has_one_owner_per_chunk_and_restores_every_replica(hsdp_tp: Path) -> None:
    per_rank = json.loads((hsdp_tp / "hsdp.json").read_text())
    weight = [next(r for r in records if r["name"] == "model/inp.weight") for records in per_rank]
    # mesh (replicate, shard) = [[0, 1], [2, 3]]: ranks 2 and 3 hold replicas of 0's and 1's chunks
    assert [(w["offsets"], w["owner"]) for w in weight] == [([0, 0], True), ([4, 0], True), ([0, 0], False),
                                                           ([4, 0], False)]
    _tiles_exactly([r for records in per_rank for r in records])
    for rank, found in enumerate(json.loads((hsdp_tp / "hsdp.equal.json").read_text())):
        assert found["equal"] == found["all"], f"rank {rank}"


def test_tensor_parallel_shard1_chunks_restore(hsdp_tp: Path) -> None:
    per_rank = json.loads((hsdp_tp / "tp.json").read_text())
    rowwise = [next(r for r in records if r["name"] == "model/2.weight") for records in per_rank]
    assert [(w["offsets"], w["sizes"]) for w in rowwise] == [([0, 2 * r], [8, 2]) for r in range(4)]
    colwise = [next(r for r in records if r["name"] == "model/0.weight") for records in per_rank]
    assert [(w["offsets"], w["sizes"]) for w in colwise] == [([2 * r, 0], [2, 8]) for r in range(4)]
    bias = [next(r for r in records if r["name"] == "model/2.bias") for records in per_rank]
    assert [b["owner"] for b in bias] == [True, False, False, False]  # Replicate: the first coordinate owns
    _tiles_exactly([r for records in per_rank for r in records])
    for rank, found in enumerate(json.loads((hsdp_tp / "tp.equal.json").read_text())):
        assert found["equal"] == found["all"], f"rank {rank}"


# ------------------------------------------------------------------ the plain adapter
def _plain_run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = jobs.Net().double()
    opt = jobs.optimizer_of(model)
    jobs.train(model, opt, range(2), 0, 1)
    return model, opt


def test_plain_adapter_gives_todays_flattened_leaves() -> None:
    model, opt = _plain_run()
    adapter = state_adapter(model, opt)
    assert isinstance(adapter, PlainStateAdapter) and not adapter.sharded
    model_state = model.state_dict()
    params = {k for k, v in model_state.items() if v.data_ptr() in {p.data_ptr() for p in model.parameters()}}
    assert adapter.param_keys(model_state) == params == {n for n, _ in model.named_parameters()}
    # the engine's live dict as _take_snapshot builds it today
    live = {"model_params": {k: v for k, v in model_state.items() if k in params},
            "model_buffers": {k: v for k, v in model_state.items() if k not in params},
            "optimizer": opt.state_dict(), "data": {"position": 3, "order": np.arange(4)}, "rng": torch.get_rng_state()}
    today, view = flatten_state(live), adapter.local_view(live)
    ours = flatten_state(view.state)
    assert (ours.key_paths, ours.paths, ours.skeleton) == (today.key_paths, today.paths, today.skeleton)
    assert len(ours.leaves) == len(today.leaves)
    for a, b in zip(ours.leaves, today.leaves):  # the same live memory (flatten_state detaches), not copies
        assert type(a) is type(b) and (a is b if isinstance(a, np.ndarray) else
                                       (a.data_ptr(), a.shape, a.dtype) == (b.data_ptr(), b.shape, b.dtype))
    tensors = [(p, leaf) for p, _, leaf in leaves_of(live) if isinstance(leaf, torch.Tensor)]
    assert [c.path for c in view.chunks] == [p for p, _ in tensors]
    for chunk, (_, leaf) in zip(view.chunks, tensors):
        assert chunk.local is leaf and chunk.owner and not chunk.sharded
        assert chunk.box == Box((0,) * leaf.dim(), tuple(leaf.shape)) and chunk.global_shape == tuple(leaf.shape)
    assert not is_sharded(live)


def test_plain_adapter_restores_like_load_state_dict(tmp_path: Path) -> None:
    model, opt = _plain_run()
    adapter = state_adapter(model, opt)
    view = adapter.local_view(adapter.live_state())
    saved = {c.name: c.local.clone() for c in view.chunks}
    skeleton = flatten_state(view.state).skeleton
    torch.manual_seed(9)
    other = jobs.Net().double()
    other_opt = jobs.optimizer_of(other, lr=0.5)

    def fill(chunk):  # whole tensors: the box is the tensor
        assert chunk.box.offsets == (0,) * len(chunk.global_shape)
        chunk.local.copy_(saved[chunk.name])

    state_adapter(other, other_opt).apply(fill, unflatten_state(skeleton, [None] * len(skeleton_leaf_refs(skeleton))))
    for name, value in other.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    ref = opt.state_dict()
    got = other_opt.state_dict()
    assert got["param_groups"] == ref["param_groups"]
    for index, entry in ref["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_restore_names_what_the_checkpoint_lacks() -> None:
    model, opt = _plain_run()
    adapter = state_adapter(model, opt)
    live = adapter.live_state()
    skeleton = flatten_state(live).skeleton

    saved = unflatten_state(skeleton, [None] * len(skeleton_leaf_refs(skeleton)))
    del saved["model"]["gate.bias"]
    with pytest.raises(RestoreMismatchError, match="model/gate.bias"):
        adapter.apply(lambda chunk: None, saved)
    saved = unflatten_state(skeleton, [None] * len(skeleton_leaf_refs(skeleton)))
    saved["optimizer"]["param_groups"][0]["params"] = saved["optimizer"]["param_groups"][0]["params"][::-1]
    with pytest.raises(RestoreMismatchError, match="optimizer/param_groups/0/params"):
        adapter.apply(lambda chunk: None, saved)


def test_is_sharded_needs_a_dtensor(saved_w2: Path) -> None:
    assert (saved_w2 / "is-sharded.txt").read_text() == "True"  # FSDP2's live state, on every rank
    assert not is_sharded({"a": torch.zeros(3), "b": [np.zeros(2), 1.0]})
    with pytest.raises(UnsupportedStateError, match="'a'"):
        is_sharded({"a": object()})
