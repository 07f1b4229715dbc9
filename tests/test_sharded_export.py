"""Export of sharded (format 3) checkpoints (storage/export.py): a PyTorch
Distributed Checkpoint directory that torch.distributed.checkpoint loads into full tensors
and into DTensors of another sharding, and .safetensors / .pt with every tensor gathered."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from sharded_state_jobs import spawn
from store_helpers import newest_sharded, part_store

from ray_checkfreq.cli import main
from ray_checkfreq.errors import CheckpointNotFoundError
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.arrays import leaf_bytes
from ray_checkfreq.storage.chunks import Box, whole
from ray_checkfreq.storage.export import dcp_fqn, export_store
from ray_checkfreq.storage.store import CheckpointStore, ChunkSource

WORLD = 4
STEP = 5


def full_state() -> dict:
    """Known full tensors, by manifest key (``%2F``: a ``/`` inside a key)."""
    g = torch.Generator().manual_seed(3)
    return {
        "model/w": torch.randn(7, 5, generator=g),  # rows 2 2 2 1 on 4 ranks
        "model/grid": torch.randn(6, 8, generator=g, dtype=torch.float64),  # 2x2 uneven boxes
        "model/odd%2Fname": torch.randn(5, 3, generator=g).bfloat16(),  # columns 1 1 1 0 (an empty box)
        "optim/state/0/exp_avg": np.random.default_rng(3).standard_normal(10).astype("<f4"),  # numpy rows
        "optim/step": torch.tensor(12, dtype=torch.int64),  # 0-d: rank 0's
        "model/empty": torch.zeros(0, 4, dtype=torch.int32),  # no element at all: rank 0's empty box
    }


def saved_boxes(key: str, shape: tuple[int, ...]) -> list[Box]:
    """The saving layout: one box per rank 0..3."""
    if key in ("optim/step", "model/empty"):
        return [whole(shape)]
    if key == "model/grid":
        return [Box((r, c), (rs, cs)) for r, rs in ((0, 4), (4, 2)) for c, cs in ((0, 3), (3, 5))]
    if key == "model/odd%2Fname":
        return [Box((0, c), (shape[0], s)) for c, s in ((0, 1), (1, 1), (2, 1), (3, 0))]
    bounds = [0, 2, 4, 6, shape[0]] if key == "model/w" else [0, 3, 6, 9, 10]
    return [Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:]) for lo, hi in zip(bounds, bounds[1:])]


def piece(value, box: Box):
    out = value[box.slices()]
    return out.contiguous() if isinstance(out, torch.Tensor) else np.ascontiguousarray(out)


def write_sharded(root: Path, codec: str = "raw") -> CheckpointStore:
    """Two writers (ranks 0-1 and 2-3) save step STEP; the second commits."""
    state = full_state()
    store = part_store(str(root), codec=codec, crc_block_bytes=64 * 1024)
    generation = store.acquire_writer()
    for ranks in ([0, 1], [2, 3]):
        writer = part_store(str(root), writer_generation=generation, codec=codec, crc_block_bytes=64 * 1024)
        chunks = [ChunkSource(key=key, data=piece(value, box), global_shape=tuple(value.shape), offsets=box.offsets,
                              rank=rank)
                  for key, value in state.items()
                  for rank, box in enumerate(saved_boxes(key, tuple(value.shape))) if rank in ranks]
        writer.save_part(STEP, world_size=WORLD, skeletons={r: {"rank": r, "lr": 0.5} for r in ranks}, chunks=chunks)
        result = writer.try_commit(STEP)
    assert result.committed
    return store


def export(root: Path, target: Path, fmt: str | None = None, step: int | None = STEP) -> str:
    return export_store(CheckpointStore(str(root)), step, str(target), fmt=fmt)


def as_torch(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(value)


def same_bits(a, b) -> bool:
    a, b = as_torch(a), as_torch(b)
    return a.dtype == b.dtype and a.shape == b.shape and bytes(leaf_bytes(a)) == bytes(leaf_bytes(b))


def nested_empty(state: dict) -> dict:
    """A nested state dict of zero tensors, keyed like DCP's fqn mapping expects."""
    out: dict = {}
    for key, value in state.items():
        parts = dcp_fqn(key).split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = torch.zeros_like(as_torch(value))
    return out


def leaf_at(nested: dict, key: str):
    node = nested
    for part in dcp_fqn(key).split("."):
        node = node[part]
    return node


@pytest.fixture(scope="module", params=["raw", "rcfz"])
def sharded_root(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"sharded-{request.param}")
    write_sharded(root, codec=request.param)
    return root


# ------------------------------------------------------------------ DCP
def test_fqn_is_dcps_name_of_the_nested_state_dict():
    assert dcp_fqn("optim/state/0/exp_avg") == "optim.state.0.exp_avg"
    assert dcp_fqn("model/odd%2Fname") == "model.odd/name"
    assert dcp_fqn("model/layers.0.weight") == "model.layers.0.weight"


def test_dcp_export_loads_into_full_tensors_bit_for_bit(sharded_root, tmp_path):
    out = tmp_path / "dcp"
    export(sharded_root, out, "dcp")
    state = full_state()
    loaded = nested_empty(state)
    dcp.load(loaded, checkpoint_id=str(out), no_dist=True)
    for key, value in state.items():
        assert same_bits(leaf_at(loaded, key), value), key


def test_dcp_export_keeps_every_stored_chunk_as_one_dcp_chunk_and_the_skeletons(sharded_root, tmp_path):
    out = tmp_path / "dcp"
    export(sharded_root, out, "dcp")
    metadata = dcp.FileSystemReader(str(out)).read_metadata()
    for key, value in full_state().items():
        chunks = metadata.state_dict_metadata[dcp_fqn(key)].chunks
        want = {(b.offsets, b.sizes) for b in saved_boxes(key, tuple(value.shape)) if b.volume}
        assert {(tuple(c.offsets), tuple(c.sizes)) for c in chunks} == want, key
    skeletons = {f"__ray_checkfreq__.skeleton.{r}": None for r in range(WORLD)}
    dcp.load(skeletons, checkpoint_id=str(out), no_dist=True)
    assert [json.loads(skeletons[f"__ray_checkfreq__.skeleton.{r}"]) for r in range(WORLD)] == \
        [{"rank": r, "lr": 0.5} for r in range(WORLD)]


def _load_as_dtensors(rank: int, world: int, root: Path) -> None:
    """Rank ``rank`` of a gloo group loads the export into DTensors of its own sharding
    (columns of w, rows of grid, replicated rest) and reports whether each local shard and
    the gathered tensor equal the saved values."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    checkpoint, report = str(root / "dcp"), root
    mesh = init_device_mesh("cpu", (world,))
    state = full_state()
    placement = {"model/w": Shard(1), "model/grid": Shard(0), "optim/state/0/exp_avg": Shard(0)}
    target: dict = {}
    for key, value in state.items():
        zero = torch.zeros_like(as_torch(value))
        target[dcp_fqn(key)] = distribute_tensor(zero, mesh, [placement.get(key, Replicate())])
    dcp.load(target, checkpoint_id=checkpoint)
    result = {}
    for key, value in state.items():
        loaded = target[dcp_fqn(key)]
        local = loaded.to_local()
        expected_local = distribute_tensor(as_torch(value).clone(), mesh, loaded.placements).to_local()
        result[key] = {"local": same_bits(local, expected_local), "full": same_bits(loaded.full_tensor(), value),
                       "local_shape": list(local.shape)}
    Path(report, f"rank{rank}.json").write_text(json.dumps(result))


def test_dcp_export_loads_into_dtensors_of_another_world_size(tmp_path):
    root = tmp_path / "store"
    write_sharded(root)
    out = tmp_path / "dcp"
    export(root, out, "dcp")
    world = 2
    spawn(_load_as_dtensors, world, str(tmp_path))
    for rank in range(world):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert all(r["local"] and r["full"] for r in result.values()), (rank, result)
        assert result["model/w"]["local_shape"] == [7, 3 - rank]  # 5 columns on 2 ranks: 3 and 2
        assert result["model/grid"]["local_shape"] == [3, 8]


def test_dcp_export_refuses_a_non_empty_directory_and_a_trim(sharded_root, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "x").write_text("keep")
    with pytest.raises(ValueError, match="not empty"):
        export(sharded_root, out, "dcp")
    assert (out / "x").read_text() == "keep"
    with pytest.raises(ValueError, match="precision"):
        export_store(CheckpointStore(str(sharded_root)), STEP, str(tmp_path / "d"),
                     fmt="dcp", precision_bits=8)


# ------------------------------------------------------------------ gathered
def test_safetensors_export_of_a_sharded_checkpoint_holds_the_full_tensors(sharded_root, tmp_path):
    target = tmp_path / "out.safetensors"
    export(sharded_root, target)
    state = full_state()
    with safe_open(str(target), framework="pt") as f:
        assert set(f.keys()) == set(state)
        for key, value in state.items():
            assert same_bits(f.get_tensor(key), value), key
        metadata = f.metadata()
    assert metadata["step"] == str(STEP)
    assert json.loads(metadata["ray_checkfreq.skeletons"]) == {str(r): {"rank": r, "lr": 0.5} for r in range(WORLD)}


def test_pt_export_of_a_sharded_checkpoint_holds_the_full_tensors(sharded_root, tmp_path):
    target = tmp_path / "out.pt"
    export(sharded_root, target, step=None)
    loaded = torch.load(str(target), weights_only=True)
    state = full_state()
    assert set(loaded) == set(state)
    assert all(same_bits(loaded[key], value) for key, value in state.items())


def test_a_missing_or_incomplete_step_is_an_error_naming_store_and_step(tmp_path):
    root = tmp_path / "store"
    write_sharded(root)
    writer = part_store(str(root), writer_generation=newest_sharded(part_store(str(root))).writer_generation)
    value = full_state()["model/w"]
    writer.save_part(9, world_size=2, skeletons={0: {}},
                     chunks=[ChunkSource(key="model/w", data=value[:4].contiguous(), global_shape=(7, 5),
                                         offsets=(0, 0), rank=0)])  # rank 1 never saves: not committed
    with pytest.raises(CheckpointNotFoundError, match="step 9 is incomplete") as err:
        export(root, tmp_path / "out.safetensors", step=9)
    assert str(root) in str(err.value)
    with pytest.raises(CheckpointNotFoundError, match="step 8"):
        export(root, tmp_path / "out.safetensors", step=8)
    assert not (tmp_path / "out.safetensors").exists()


# ------------------------------------------------------------------ CLI
def test_cli_exports_dcp_and_safetensors(tmp_path, capsys):
    root = tmp_path / "store"
    write_sharded(root)
    out = tmp_path / "dcp"
    assert main(["export", str(root), "--step", str(STEP), "--format", "dcp", "--to", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    loaded = nested_empty(full_state())
    dcp.load(loaded, checkpoint_id=str(out), no_dist=True)
    assert same_bits(leaf_at(loaded, "model/grid"), full_state()["model/grid"])
    assert main(["export", str(root), "--to", str(tmp_path / "out.safetensors")]) == 0
    assert main(["export", str(root), "--step", "99", "--to", str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "step 99" in err and str(root) in err


def test_the_format_exported_follows_what_the_root_holds(tmp_path):
    root = tmp_path / "store"
    write_sharded(root)  # generation 1, step 5
    plain = CheckpointStore(str(root))
    plain.save(3, {"model": {"w": torch.arange(4.0)}})  # a newer writer generation: the newest checkpoint
    newest = tmp_path / "newest.safetensors"
    export(root, newest, step=None)
    with safe_open(str(newest), framework="pt") as f:
        assert set(f.keys()) == {"model/w"} and torch.equal(f.get_tensor("model/w"), torch.arange(4.0))
    sharded = tmp_path / "sharded.safetensors"
    export(root, sharded, step=STEP)
    with safe_open(str(sharded), framework="pt") as f:
        assert set(f.keys()) == set(full_state())
    # A replicated checkpoint is a one-part checkpoint of whole tensors: DCP export takes it too.
    export(root, tmp_path / "dcp", "dcp", step=3)
    loaded = {"model.w": torch.zeros(4)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(loaded["model.w"], torch.arange(4.0))
