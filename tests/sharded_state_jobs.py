"""Ranks for tests/test_engine_state.py: FSDP2, HSDP and TP on CPU gloo, spawned with
``torch.multiprocessing`` (2-4 processes), plus a trivial chunk store (one ``.npy`` per
owned chunk and a JSON index) that restores by box intersection at any world size.

Every job writes what it saw under its directory; the tests compare in the parent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ray_checkfreq.engine.state import LocalState, StateAdapter, TensorChunk, is_sharded, state_adapter
from ray_checkfreq.storage.tree import flatten_state, leaves_of, skeleton_leaf_refs, unflatten_state

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4: the same global batch at every world size
SAVED_AT = 3
MORE = 2


# ------------------------------------------------------------------ process group
def spawn(job: Any, world: int, root: str) -> None:
    """``job(rank, world, Path(root))`` on ``world`` gloo ranks: the benchmarks' launcher (the
    ranks meet through a fresh file; a finished rank skips the teardown where gloo can abort)."""
    from benchmarks.sharded_job import spawn as spawn_gloo

    spawn_gloo(job, world, Path(root))


def spawn_within(job: Any, world: int, root: str, timeout_s: float) -> None:
    """``spawn``, but ranks still running after ``timeout_s`` (a hang in a collective) are
    killed and TimeoutError raised: a hang fails the test, not the suite."""
    import time
    import uuid

    import torch.multiprocessing as mp

    from benchmarks.sharded_job import _entry

    rendezvous = Path(root) / f"rendezvous-{uuid.uuid4().hex}"
    context = mp.spawn(_entry, args=(world, f"file://{rendezvous}", job, str(root)), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            alive = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{job.__name__}: ranks {alive} of {world} still running after {timeout_s} s (a hang)")


# ------------------------------------------------------------------ model and training
class Net(torch.nn.Module):
    """Uneven on purpose: 7, 5 and 2 rows split unevenly over 2, 3 and 4 ranks (2 over 3
    leaves one rank an empty shard). ``scale`` is a buffer: a plain tensor under FSDP2."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.out = torch.nn.Linear(7, 5)
        self.gate = torch.nn.Linear(7, 2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)) * self.scale)
        return self.out(h) + self.gate(h).sum(-1, keepdim=True)


def sharded_net(seed: int, mesh: Any = None) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net().double()
    for part in (model.inp, model.out, model.gate):
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optimizer_of(model: torch.nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> None:
    """Step ``s`` uses global batch ``s``; each rank takes its equal share of it."""
    share = GLOBAL_BATCH // world
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(GLOBAL_BATCH, 8, generator=gen, dtype=torch.float64)
        y = torch.randn(GLOBAL_BATCH, 5, generator=gen, dtype=torch.float64)
        mine = slice(rank * share, (rank + 1) * share)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """The whole state by name on rank 0 (a collective; {} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=options),
             "optimizer": get_optimizer_state_dict(model, opt, options=options)}
    return {name: leaf.numpy().copy() for _, name, leaf in leaves_of(state)}


def gather_json(path: Path, rank: int, world: int, item: Any) -> None:
    """All-gather ``item`` from every rank; rank 0 writes the list to ``path`` as JSON."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, item)
    if rank == 0:
        path.write_text(json.dumps(gathered))


def save_full(path: Path, rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    """The full state with the scheduler's position, written by rank 0 (a collective)."""
    state = full_state(model, opt)
    if rank == 0:
        save_arrays(path, {**state, "sched/last_epoch": np.array(sched.last_epoch)})


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez(path, **{name.replace("/", "|"): value for name, value in arrays.items()})


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as found:
        return {name.replace("|", "/"): found[name] for name in found.files}


# ------------------------------------------------------------------ a trivial chunk store
def save_chunks(root: Path, rank: int, world: int, view: LocalState) -> None:
    """Every rank writes its owned chunks; rank 0 writes the index and the skeleton."""
    root.mkdir(parents=True, exist_ok=True)
    records = []
    for i, chunk in enumerate(view.chunks):
        if not chunk.owner or chunk.local.numel() == 0:
            continue
        file = f"r{rank}-{i}.npy"
        np.save(root / file, chunk.local.detach().numpy())
        records.append({"name": chunk.name, "dtype": str(chunk.dtype), "global_shape": list(chunk.global_shape),
                        "offsets": list(chunk.box.offsets), "sizes": list(chunk.box.sizes), "file": file,
                        "rank": rank})
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        index = {"chunks": [r for rs in gathered for r in rs], "skeleton": flatten_state(view.state).skeleton}
        (root / "index.json").write_text(json.dumps(index))
    dist.barrier()


class ChunkFiles:
    """Reads ``save_chunks``' output: ``fill`` copies each saved chunk's overlap with the
    target box into the target; ``saved`` is the checkpointed tree (tensors as None)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        index = json.loads((root / "index.json").read_text())
        self.by_name: dict[str, list[dict]] = {}
        for record in index["chunks"]:
            self.by_name.setdefault(record["name"], []).append(record)
        skeleton = index["skeleton"]
        self.saved = unflatten_state(skeleton, [None] * len(skeleton_leaf_refs(skeleton)))

    def fill(self, chunk: TensorChunk) -> None:
        covered = 0
        for record in self.by_name.get(chunk.name, []):
            if tuple(record["global_shape"]) != chunk.global_shape or record["dtype"] != str(chunk.dtype):
                raise ValueError(f"{chunk.name}: saved {record['global_shape']} {record['dtype']}, "
                                 f"now {chunk.global_shape} {chunk.dtype}")
            low = [max(a, b) for a, b in zip(record["offsets"], chunk.box.offsets)]
            high = [min(a + n, b + m) for a, n, b, m in
                    zip(record["offsets"], record["sizes"], chunk.box.offsets, chunk.box.sizes)]
            if any(lo >= hi for lo, hi in zip(low, high)):
                continue
            data = torch.from_numpy(np.load(self.root / record["file"]))
            source = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, record["offsets"]))
            target = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, chunk.box.offsets))
            chunk.local[target].copy_(data[source])
            covered += data[source].numel()
        if covered != chunk.local.numel():
            raise ValueError(f"{chunk.name}: saved chunks cover {covered} of the {chunk.local.numel()} elements "
                             f"of box {chunk.box}")


def boxes(view: LocalState) -> list[dict]:
    return [{"name": c.name, "offsets": list(c.box.offsets), "sizes": list(c.box.sizes), "owner": c.owner,
             "sharded": c.sharded, "global_shape": list(c.global_shape)} for c in view.chunks]


def gather_to(path: Path, rank: int, world: int, item: Any) -> None:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, item)
    if rank == 0:
        path.write_text(str(all(gathered)) if path.suffix == ".txt" else json.dumps(gathered))


def fsdp_adapter(model: torch.nn.Module, opt: torch.optim.Optimizer) -> StateAdapter:
    adapter = state_adapter(model, opt)
    assert adapter.sharded, type(adapter).__name__
    return adapter


# ------------------------------------------------------------------ jobs
def save_job(rank: int, world: int, root: Path) -> None:
    """Train SAVED_AT steps, save the chunks, then go on MORE steps (the run that never stopped)."""
    model = sharded_net(seed=0)
    opt = optimizer_of(model)
    train(model, opt, range(SAVED_AT), rank, world)
    adapter = fsdp_adapter(model, opt)
    view = adapter.local_view(adapter.live_state())
    gather_to(root / "is-sharded.txt", rank, world, is_sharded(adapter.live_state()))
    save_chunks(root / "store", rank, world, view)
    gather_to(root / "saved-boxes.json", rank, world, boxes(view))
    saved = full_state(model, opt)
    train(model, opt, range(SAVED_AT, SAVED_AT + MORE), rank, world)
    after = full_state(model, opt)
    if rank == 0:
        save_arrays(root / "ref-saved.npz", saved)
        save_arrays(root / "ref-after.npz", after)


def restore_job(rank: int, world: int, root: Path) -> None:
    """A fresh model (other weights) restored from the store, then the same MORE steps."""
    model = sharded_net(seed=123)
    opt = optimizer_of(model, lr=0.5)  # the saved hyper-parameters must replace these
    adapter = fsdp_adapter(model, opt)
    store = ChunkFiles(root / "store")
    adapter.apply(store.fill, store.saved)
    gather_to(root / f"boxes-w{world}.json", rank, world, boxes(adapter.local_view(adapter.live_state())))
    restored = full_state(model, opt)
    train(model, opt, range(SAVED_AT, SAVED_AT + MORE), rank, world)
    continued = full_state(model, opt)
    if rank == 0:
        save_arrays(root / f"restored-w{world}.npz", restored)
        save_arrays(root / f"continued-w{world}.npz", continued)
    if world == 1:
        _try_mixed(root)


def _try_mixed(root: Path) -> None:
    """A model with only some parameters sharded: the adapter must refuse it by name."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net().double()
    fully_shard(model.inp)
    try:
        state_adapter(model, optimizer_of(model))
    except Exception as err:  # the test checks the type and the message
        (root / "mixed.txt").write_text(f"{type(err).__name__}: {err}")
    else:
        (root / "mixed.txt").write_text("accepted")


def hsdp_tp_job(rank: int, world: int, root: Path) -> None:
    """HSDP on a 2 x 2 mesh and TP (Colwise/Rowwise) on a 1-D mesh of 4: chunks, owners, and
    a save of owned chunks restored into fresh models equal to the saved local pieces."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = sharded_net(seed=0, mesh=mesh)
    opt = optimizer_of(model)
    train(model, opt, range(2), mesh.get_coordinate()[1], world // 2)  # the same batches on both replicas
    _owners_and_round_trip(root / "hsdp", rank, world, model, opt, lambda: sharded_net(seed=5, mesh=mesh))

    tp_mesh = init_device_mesh("cpu", (world,))
    model = _tp_net(tp_mesh, seed=0)
    opt = optimizer_of(model)
    train(model, opt, range(2), 0, 1)  # TP: every rank sees the whole batch
    _owners_and_round_trip(root / "tp", rank, world, model, opt, lambda: _tp_net(tp_mesh, seed=5))


class _FirstFive(torch.nn.Module):
    """The first 5 outputs (the targets' width); no state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :5]


def _tp_net(mesh: Any, seed: int) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    # Both layers 8 x 8: the same global shapes under other placements (weights Shard(0) and
    # Shard(1), biases Shard(0) and Replicate), which a layout cache must tell apart.
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), _FirstFive()).double()
    return parallelize_module(plain, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _owners_and_round_trip(root: Path, rank: int, world: int, model: torch.nn.Module,
                           opt: torch.optim.Optimizer, fresh: Any) -> None:
    adapter = fsdp_adapter(model, opt)
    view = adapter.local_view(adapter.live_state())
    gather_to(root.with_suffix(".json"), rank, world, boxes(view))
    save_chunks(root, rank, world, view)
    saved = {c.name: c.local.clone() for c in view.chunks}
    other = fresh()
    other_opt = optimizer_of(other, lr=0.5)
    other_adapter = fsdp_adapter(other, other_opt)
    store = ChunkFiles(root)
    other_adapter.apply(store.fill, store.saved)
    now = {c.name: c.local for c in other_adapter.local_view(other_adapter.live_state()).chunks}
    equal = sorted(name for name in saved if torch.equal(saved[name], now[name]))
    gather_to(root.with_suffix(".equal.json"), rank, world, {"equal": equal, "all": sorted(saved)})
