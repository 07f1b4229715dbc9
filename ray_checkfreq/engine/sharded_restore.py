"""Loading one rank's share of a sharded checkpoint, at any world size.

Every rank calls ``load_rank_state`` (a collective: the adapter's load is). It reads
the skeleton of its own rank in the saved world (rank 0's when the saved world was
smaller: the per-rank leaves of a rank that did not exist are rank 0's), then fetches in
ONE ranged-read pass (``CheckpointStore.reader``) the box of every model and optimizer
tensor this rank holds now, plus its per-rank leaves (RNG, extra and data state), fills
model and optimizer in place, and returns the rest of the state. All of that but the final
load is ``prepare_rank_state``, on the rank alone, so that the ranks can agree that every
one of them read its part before any enters the load (engine/agreement.py). A replicated
checkpoint (one part of whole tensors, numbered optimizer state) loads the same way: each
rank reads its boxes of the whole tensors, the optimizer's numbers taken as the live
groups' names.

A rank's own snapshot (its RAM copy, at the same world size and sharding) loads without
storage: ``snapshot_mismatch`` says whether it fits, ``load_rank_snapshot`` fills it in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ray_checkfreq.engine.restore import RestoreMismatchError, exact_checkpoints, optimizer_by_name
from ray_checkfreq.engine.state import ChunkPlace, Fill, SavedLeaf, StateAdapter, TensorChunk
from ray_checkfreq.errors import CheckpointNotFoundError, CorruptCheckpointError
from ray_checkfreq.storage.arrays import torch_dtype
from ray_checkfreq.storage.chunks import Box, whole
from ray_checkfreq.storage.manifest import GlobalManifest
from ray_checkfreq.storage.rank_state import parse_rank_skeleton
from ray_checkfreq.storage.reader import BoxReader
from ray_checkfreq.storage.store import CheckpointRef, CheckpointStore
from ray_checkfreq.storage.tree import KeyPath, SkeletonError, leaves_of, unflatten_state


@dataclass(frozen=True)
class RankState:
    """What a sharded restore hands back once model and optimizer are filled."""

    state: dict[str, Any]  # the saved state (model/optimizer tensors as None): extra, data, rng, checkfreq
    rng: Any  # what the rank-aware RNG setter takes (engine/rng.py ``set_own_rng``)


@dataclass
class PhaseClock:
    """Seconds spent in each phase of a restore, in the order the phases ran."""

    seconds: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.perf_counter)

    def lap(self, phase: str) -> None:
        """``phase`` ended now: it took the time since the previous lap."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def find_ref(store: CheckpointStore, step: int) -> CheckpointRef:
    """The newest complete exact checkpoint of ``step``, of either placement."""
    matches = exact_checkpoints(store, step)
    if not matches:
        raise CheckpointNotFoundError(f"no complete checkpoint of step {step} in {store.uri}")
    return matches[-1]


@dataclass(frozen=True)
class PreparedRankState:
    """A rank's share of a checkpoint, read, checked and in its targets (``prepare_rank_state``),
    not yet loaded into model and optimizer: ``load`` does that (a collective)."""

    filled: dict[str, Any]  # the adapter's filled targets (``StateAdapter.fill_targets``)
    state: dict[str, Any]
    rng: Any

    def load(self, adapter: StateAdapter, clock: PhaseClock | None = None) -> RankState:
        """Model and optimizer loaded (every rank calls it, or none: the DTensor load is a
        collective); the rest of the saved state returned."""
        adapter.load_filled(self.filled)
        if clock is not None:
            clock.lap("fill")
        return RankState(state=self.state, rng=self.rng)


def load_rank_state(store: CheckpointStore, ref: CheckpointRef, adapter: StateAdapter, *, rank: int,
                    optimizer_class: str, clock: PhaseClock | None = None) -> RankState:
    """Fill model and optimizer from ``ref`` in place (every rank calls it) and return the
    rest of this rank's saved state: ``prepare_rank_state``, then its ``load``. Where one
    rank's part may be damaged and another's not, a caller agrees between the two
    (``agreement.RankAgreement``), so that no rank enters the load alone."""
    clock = clock or PhaseClock()
    return prepare_rank_state(store, ref, adapter, rank=rank, optimizer_class=optimizer_class,
                              clock=clock).load(adapter, clock)


def prepare_rank_state(store: CheckpointStore, ref: CheckpointRef, adapter: StateAdapter, *, rank: int,
                       optimizer_class: str, clock: PhaseClock | None = None) -> PreparedRankState:
    """This rank's boxes of ``ref`` read (every CRC block checked) into its targets, on this
    rank alone (no collective); RestoreMismatchError names the first key that does not fit,
    CorruptCheckpointError a damaged skeleton or block. The targets are the live tensors
    where a read can write straight into them: a failed read may leave them half written,
    which a later successful load of any step overwrites whole. ``clock`` times the phases:
    manifest, skeleton, plan, read (and fill, in ``load``)."""
    clock = clock or PhaseClock()
    reader = store.reader(ref)
    if ref.placement == "replicated":
        return _prepare_replicated(reader, ref.uri, adapter, optimizer_class)
    manifest = reader.manifest
    clock.lap("manifest")
    source = rank if rank < manifest.world_size else 0
    tree, keys, per_rank = parse_rank_skeleton(reader.skeletons([source])[source], ref.uri)
    indexed = _unflatten(tree, [_LeafIndex(i) for i in range(len(keys))], ref.uri)
    adapter.prepare_optimizer_state(saved_optimizer_leaves(indexed.get("optimizer"), keys, manifest))
    clock.lap("skeleton")
    targets = adapter.restore_targets()
    boxes = {chunk.name: chunk.box for chunk in targets}
    _check_targets(targets, manifest, set(keys) - per_rank)
    wanted: dict[str, list[Box]] = {name: [Box(box.offsets, box.sizes)] for name, box in boxes.items()}
    for key in per_rank:
        wanted[key] = [whole(_tensor_of(manifest, key, ref.uri).global_shape)]
    into = _in_place(targets, manifest)
    clock.lap("plan")
    loaded = reader.load_boxes(wanted, into=into)
    clock.lap("read")
    state = unflatten_state(tree, [loaded[key][0] if key in per_rank else None for key in keys])
    _check_optimizer_class(state, optimizer_class)
    filled = adapter.fill_targets(_filler(loaded, boxes, {name: name for name in boxes}),
                                  {"model": state["model"], "optimizer": state["optimizer"]})
    own = {rank: state["rng"]} if rank < manifest.world_size else {}
    return PreparedRankState(filled=filled, state=state, rng={"world_size": manifest.world_size, "ranks": own})


class _LeafIndex(int):
    """Where a tensor leaf of a replicated skeleton stands: its index in the leaf keys. An
    int to the state walker, so a skeleton filled with them checks structure like a state."""

    def __getitem__(self, _: Any) -> _LeafIndex:  # a numpy scalar's leaf is read as leaf[()]
        return self


def _prepare_replicated(reader: BoxReader, where: str, adapter: StateAdapter,
                        optimizer_class: str) -> PreparedRankState:
    """A replicated checkpoint for this rank's shards: its boxes of each whole tensor, the
    numbered optimizer state named after the live groups by place, the rest read whole."""
    skeleton, keys, _ = reader.whole_state()
    indexed = _unflatten(skeleton, [_LeafIndex(i) for i in range(len(keys))], where)
    _check_optimizer_class(indexed, optimizer_class)
    live_groups = adapter.live_state()["optimizer"].get("param_groups", [])  # the names torch's state dicts use
    named = optimizer_by_name(indexed["optimizer"], [list(group["params"]) for group in live_groups])
    adapter.prepare_optimizer_state(saved_optimizer_leaves(named, keys, reader.manifest))
    targets = adapter.restore_targets()
    saved = {"model": indexed["model"], "optimizer": named}
    source = {chunk.name: keys[_leaf_index(saved, chunk.path, chunk.name)] for chunk in targets}
    rest = {key for key in keys if key.split("/", 1)[0] not in ("model", "optimizer")}
    wanted = {source[chunk.name]: [Box(chunk.box.offsets, chunk.box.sizes)] for chunk in targets}
    wanted.update({key: [whole(reader.manifest.tensor(key).global_shape)] for key in rest})  # type: ignore[union-attr]
    loaded = reader.load_boxes(wanted)
    filled = adapter.fill_targets(_filler(loaded, {chunk.name: chunk.box for chunk in targets}, source), saved)
    state = _unflatten(skeleton, [loaded[key][0] if key in rest else None for key in keys], where)
    return PreparedRankState(filled=filled, state=state, rng=state["rng"])


def saved_optimizer_leaves(optimizer: Any, keys: list[str],
                           manifest: GlobalManifest) -> dict[str, dict[str, SavedLeaf]]:
    """Each parameter name's saved state tensors (shape and dtype), from an optimizer state
    skeleton whose tensor leaves are ``_LeafIndex`` values into ``keys``; {} where the
    skeleton does not have that form (the restore then creates the state itself)."""
    out: dict[str, dict[str, SavedLeaf]] = {}
    state = optimizer.get("state") if isinstance(optimizer, Mapping) else None
    if not isinstance(state, Mapping):
        return {}
    for name, entries in state.items():
        if not isinstance(entries, Mapping):
            return {}
        leaves = {}
        for key, leaf in entries.items():
            record = manifest.tensor(keys[leaf]) if isinstance(leaf, _LeafIndex) else None
            if record is None:
                return {}
            leaves[key] = SavedLeaf(tuple(record.global_shape), torch_dtype(record.dtype))
        out[str(name)] = leaves
    return out


def _leaf_index(saved: Mapping[str, Any], path: KeyPath, name: str) -> int:
    node: Any = saved
    for key in path:
        if isinstance(node, Mapping):
            node = node.get(key)
        else:
            node = node[key] if isinstance(node, list) and isinstance(key, int) and key < len(node) else None
    if not isinstance(node, _LeafIndex):
        raise RestoreMismatchError(name, "missing from the checkpoint")
    return int(node)


def _unflatten(skeleton: Any, leaves: list[Any], where: str) -> Any:
    try:
        return unflatten_state(skeleton, leaves)
    except SkeletonError as err:
        raise CorruptCheckpointError(where, f"skeleton: {err}") from None


def _check_optimizer_class(state: Mapping[str, Any], optimizer_class: str) -> None:
    saved_class = state.get("checkfreq", {}).get("optimizer_class")
    if saved_class != optimizer_class:
        raise RestoreMismatchError("optimizer", f"saved by {saved_class}, loading into {optimizer_class}")


def _filler(loaded: Mapping[str, list[Any]], boxes: Mapping[str, Any], source: Mapping[str, str]) -> Fill:
    """``fill`` for ``adapter.apply``: each target's box as read (under its saved key)."""

    def fill(chunk: TensorChunk) -> None:
        if boxes.get(chunk.name) != chunk.box:
            raise RuntimeError(f"{chunk.name}: the restore asked for box {chunk.box}, not the one read "
                               f"({boxes.get(chunk.name)})")
        data = loaded[source[chunk.name]][0]
        tensor = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
        if tensor.dtype != chunk.dtype:
            raise RestoreMismatchError(chunk.name, f"dtype {tensor.dtype} in the checkpoint, {chunk.dtype} now")
        if tensor.data_ptr() != chunk.local.data_ptr() or tensor.numel() == 0:  # else read in place already
            chunk.local.copy_(tensor)

    return fill


def _in_place(targets: list[TensorChunk], manifest: GlobalManifest) -> dict[str, np.ndarray]:
    """The targets a read can write straight into: host memory, contiguous, of the saved
    dtype; each as its bytes (the rest are read into new memory and copied)."""
    into = {}
    for chunk in targets:
        saved = manifest.tensor(chunk.name)
        local = chunk.local
        if (saved is None or local.device.type != "cpu" or not local.is_contiguous() or local.numel() == 0
                or torch_dtype(saved.dtype) != local.dtype or saved.kind != "torch"):
            continue
        into[chunk.name] = local.detach().reshape(-1).view(torch.uint8).numpy().reshape(
            tuple(local.shape) + (local.element_size(),))
    return into


def _tensor_of(manifest: GlobalManifest, key: str, where: str) -> Any:
    tensor = manifest.tensor(key)
    if tensor is None:
        raise CorruptCheckpointError(where, f"the skeleton names tensor {key!r}, which no part holds")
    return tensor


def _check_targets(targets: list[TensorChunk], manifest: GlobalManifest, saved_names: set[str]) -> None:
    for chunk in targets:
        tensor = manifest.tensor(chunk.name)
        if tensor is None or chunk.name not in saved_names:
            raise RestoreMismatchError(chunk.name, "missing from the checkpoint")
        if tuple(tensor.global_shape) != chunk.global_shape:
            raise RestoreMismatchError(chunk.name, f"global shape {tuple(tensor.global_shape)} in the checkpoint, "
                                                   f"{chunk.global_shape} now")
    extra = saved_names - {chunk.name for chunk in targets}
    if extra:
        raise RestoreMismatchError(sorted(extra)[0], "in the checkpoint but not in the model or optimizer")


# ------------------------------------------------------------- a rank's own snapshot
SHARDING_KEY = "sharding"
"""The key of the sharding record in a rank's snapshot as its RAM copy holds it."""


def sharding_record(places: Mapping[Any, ChunkPlace], *, rank: int, world_size: int,
                    epoch_boundary: bool = False) -> dict[str, Any]:
    """What a RAM copy of a rank's snapshot carries beside its state, so that a restore can
    tell whether its pieces are this rank's pieces now: the saving rank, its world size and
    each model/optimizer tensor's offsets in its global tensor; and whether the snapshot
    ends an epoch (so that writing it again keeps what retention needs)."""
    return {"rank": rank, "world_size": world_size, "epoch_boundary": epoch_boundary,
            "offsets": {place.name: list(place.offsets) for place in places.values()}}


def snapshot_mismatch(state: Mapping[str, Any], adapter: StateAdapter, *, rank: int, world_size: int,
                      optimizer_class: str) -> str | None:
    """Why ``state`` (a rank's own snapshot with its ``sharding_record`` under
    ``SHARDING_KEY``) cannot fill this rank's shards as they are now; None when it can.
    No collective: every rank checks before any of them loads."""
    record = state.get(SHARDING_KEY)
    if not isinstance(record, Mapping) or not isinstance(record.get("offsets"), Mapping):
        return "it has no sharding record"
    if (record.get("rank"), record.get("world_size")) != (rank, world_size):
        return f"it was saved by rank {record.get('rank')} of {record.get('world_size')}, this is rank {rank} of " \
               f"{world_size}"
    saved_class = state.get("checkfreq", {}).get("optimizer_class")
    if saved_class != optimizer_class:
        return f"it was saved by {saved_class}, loading into {optimizer_class}"
    saved = {path: leaf for path, _, leaf in leaves_of(state)}
    for chunk in adapter.restore_targets():
        leaf = saved.get(chunk.path)
        if not isinstance(leaf, torch.Tensor):
            return f"{chunk.name}: missing"
        if record["offsets"].get(chunk.name) != list(chunk.box.offsets):
            return f"{chunk.name}: saved at offsets {record['offsets'].get(chunk.name)}, held at {chunk.box.offsets}"
        if tuple(leaf.shape) != chunk.box.sizes or leaf.dtype != chunk.dtype:
            return f"{chunk.name}: saved as {tuple(leaf.shape)} {leaf.dtype}, held as {chunk.box.sizes} {chunk.dtype}"
    return None


def load_rank_snapshot(state: Mapping[str, Any], adapter: StateAdapter) -> None:
    """Fill model and optimizer in place from a rank's own snapshot that
    ``snapshot_mismatch`` passed (every rank calls it: the adapter's load is a collective)."""
    saved = {path: leaf for path, _, leaf in leaves_of(state)}

    def fill(chunk: TensorChunk) -> None:
        chunk.local.copy_(saved[chunk.path])

    adapter.apply(fill, {"model": state["model"], "optimizer": state["optimizer"]})
