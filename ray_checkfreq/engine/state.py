"""The engine's view of model and optimizer state as local chunks of global tensors.

Two adapters, chosen by ``state_adapter(model, optimizer)``:

- ``PlainStateAdapter`` (DDP, one process): today's behaviour. Every tensor is whole,
  ``model.state_dict()`` / ``optimizer.state_dict()``, restored by ``load_state_dict``.
- ``DTensorStateAdapter`` (FSDP2 ``fully_shard`` on a 1-D mesh, HSDP's replicate x shard
  2-D mesh, tensor parallel ``Shard(d)``): the state comes from
  ``torch.distributed.checkpoint.state_dict.get_*_state_dict``, which keys the optimizer's
  state by parameter name (so keys do not depend on the world size) and is not a
  collective. Each ``DTensor`` leaf becomes its local piece (``to_local()``, a view of the
  live shard) plus the box it covers in the global tensor.

Ownership: exactly one rank owns each distinct chunk, so that a writer that persists only
owned chunks stores every element once. A DTensor chunk is owned by the rank whose mesh
coordinate is 0 on every ``Replicate`` mesh dimension (under HSDP the other replica groups
hold free RAM copies). A plain tensor in a sharded state (an optimizer's ``step``, a
module buffer) is taken to be the same on every rank and is owned by global rank 0, the
rank whose copy today's replica mode persists. The plain adapter owns everything.

Restoring (``apply``) fills the live shards in place: the adapter builds its targets from
the live model and optimizer, hands each tensor leaf with its global box to the caller's
``fill``, takes every non-tensor leaf from the saved state, and loads the result. No rank
ever allocates more than its own shards.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from ray_checkfreq.engine.restore import RestoreMismatchError, parameter_names
from ray_checkfreq.errors import UnsupportedStateError
from ray_checkfreq.storage.tree import METADATA, ContainerRebuilder, KeyPath, StateVisitor, leaves_of, walk_state


class Box(NamedTuple):
    """A chunk's place in its global tensor: per dimension, first index and length."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorChunk:
    """One tensor leaf as this rank holds it.

    ``local`` is a view of the live tensor (the ``to_local()`` of a DTensor), never a copy:
    a snapshot copies from it, a restore writes into it. ``box`` is where ``local`` lies in
    the global tensor of shape ``global_shape``; ``box.sizes == local.shape``.
    """

    path: KeyPath
    name: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    box: Box
    local: torch.Tensor
    owner: bool
    sharded: bool  # a DTensor's piece (False: a whole tensor)


@dataclass(frozen=True)
class ChunkPlace:
    """Where a snapshot's copy of a chunk belongs, without the live tensor: a chunk
    record the persist thread may keep after the training moved on."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    owner: bool

    @staticmethod
    def of(chunk: TensorChunk) -> ChunkPlace:
        return ChunkPlace(name=chunk.name, global_shape=chunk.global_shape, offsets=chunk.box.offsets,
                          owner=chunk.owner)


@dataclass(frozen=True)
class LocalState:
    """``state`` with every tensor leaf replaced by ``TensorChunk.local``, and its chunks in
    walk order (the order ``flatten_state(state)`` lists its tensor leaves)."""

    state: Any
    chunks: list[TensorChunk]


Fill = Callable[[TensorChunk], None]
"""Writes the saved values of ``chunk.name`` inside ``chunk.box`` into ``chunk.local``."""


def is_sharded(state: Any) -> bool:
    """Whether any tensor leaf of ``state`` is a DTensor."""
    return any(isinstance(leaf, DTensor) for _, _, leaf in leaves_of(state))


def state_adapter(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StateAdapter:
    """The adapter for this model: DTensor when its parameters are DTensors, else plain.

    Raises UnsupportedStateError naming the first plain parameter of a model whose other
    parameters are DTensors: such a parameter is neither sharded nor kept in sync by FSDP.
    """
    named = list(model.named_parameters())
    distributed = [isinstance(param, DTensor) for _, param in named]
    if not any(distributed):
        return PlainStateAdapter(model, optimizer)
    if not all(distributed):
        plain = next(name for (name, _), is_dt in zip(named, distributed) if not is_dt)
        raise UnsupportedStateError(
            f"model/{plain}",
            "a plain torch.Tensor parameter beside DTensor parameters: shard every parameter "
            "(fully_shard the root module too) or none")
    return DTensorStateAdapter(model, optimizer)


class StateAdapter(ABC):
    """Model and optimizer state as tensor chunks, and back."""

    sharded: bool = False

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    @abstractmethod
    def live_state(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}``: the live state dicts (their tensors alias
        the live parameters and optimizer state; no collective)."""

    @abstractmethod
    def plain_owner(self) -> bool:
        """Whether this rank owns the state's whole (non-DTensor) tensors."""

    def local_view(self, state: Any) -> LocalState:
        """Any nested state (say the engine's live dict) as local tensors and chunk records;
        non-tensor leaves are kept as they are."""
        builder = _LocalViewBuilder(self.plain_owner())
        return LocalState(state=walk_state(state, builder), chunks=builder.chunks)

    def param_keys(self, model_state: Mapping[str, Any]) -> set[str]:
        """The keys of ``model_state`` that hold parameters (the rest are buffers and a
        module's ``get_extra_state()``), by the identity of the local piece's memory: a
        DTensor's own ``data_ptr()`` is 0."""
        pointers = {_local(p).data_ptr() for p in self.model.parameters() if _local(p).numel()}
        names = {name for name, _ in self.model.named_parameters()}
        return {key for key, value in model_state.items() if isinstance(value, torch.Tensor)
                and (_local(value).data_ptr() in pointers if _local(value).numel() else key in names)}

    def prepare_optimizer_state(self, saved: Mapping[str, Mapping[str, SavedLeaf]]) -> bool:
        """Create the optimizer's lazily made state as a checkpoint holds it (``saved``: each
        parameter's name -> its state keys), so that ``restore_targets`` need not take the
        zero-gradient optimizer step, which costs as much as a training step's update.
        Nothing is created, and False returned, when the optimizer has state already or the
        checkpoint lacks some parameter's state (the restore then takes that step). The new
        tensors are uninitialized until the restore fills them."""
        if self.optimizer.state:
            return False
        groups = parameter_names(self.model, self.optimizer)
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        names = [name for group in groups for name in group]
        if any(not saved.get(name) for name in names):
            return False
        numbered = {number: {key: _empty_like_saved(param, leaf) for key, leaf in saved[name].items()}
                    for number, (param, name) in enumerate(zip(params, names))}
        first = 0
        param_groups = []
        for group in self.optimizer.param_groups:
            count = len(group["params"])
            param_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": list(range(first, first + count))})
            first += count
        # torch's own load puts each value where the optimizer keeps it (``step`` on the CPU
        # unless capturable or fused, the rest on the parameter's device and dtype).
        self.optimizer.load_state_dict({"state": numbered, "param_groups": param_groups})
        return True

    def restore_targets(self) -> list[TensorChunk]:
        """The chunks ``apply`` will hand to ``fill``, in order (lazily made optimizer state
        is created first), so that a reader can fetch all of them in one pass."""
        _initialize_optimizer_state(self.optimizer)
        return self.local_view(self.live_state()).chunks

    def apply(self, fill: Fill, saved: Mapping[str, Any]) -> None:
        """Restore model and optimizer in place: ``fill`` writes each tensor leaf's local
        piece, every non-tensor leaf (hyper-parameters, ``_metadata``) comes from
        ``saved`` (``{"model": ..., "optimizer": ...}`` as checkpointed; its tensor leaves
        may be any placeholder, only its structure and other leaves are read).

        Raises RestoreMismatchError naming the first key that the checkpoint and the live
        state do not share. Every rank must call it: the DTensor path loads collectively.
        """
        self.load_filled(self.fill_targets(fill, saved))

    def fill_targets(self, fill: Fill, saved: Mapping[str, Any]) -> dict[str, Any]:
        """``apply``'s first half, on this rank alone (no collective): every check, and
        every target filled; what ``load_filled`` then loads."""
        _initialize_optimizer_state(self.optimizer)
        target = self.live_state()
        _check_same_structure(target, saved)
        return walk_state(target, _RestoreBuilder(fill, saved, self.plain_owner()))

    def load_filled(self, filled: dict[str, Any]) -> None:
        """``apply``'s second half: the filled targets into model and optimizer (the DTensor
        path loads collectively: every rank calls it, or none)."""
        with torch.no_grad():
            self._load(filled)

    @abstractmethod
    def _load(self, state: dict[str, Any]) -> None:
        """Load the filled targets into the model and optimizer."""


class PlainStateAdapter(StateAdapter):
    """Every tensor whole: today's replica (DDP) behaviour."""

    sharded = False

    def live_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def plain_owner(self) -> bool:
        return True

    def _load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class DTensorStateAdapter(StateAdapter):
    """FSDP2 / HSDP / TP state: DTensor leaves as local chunks of global tensors."""

    sharded = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        # Imported with the engine, not by the first checkpoint: the package takes ~70 ms to
        # import, which the run's first snapshot would otherwise stall for.
        import torch.distributed.checkpoint.state_dict  # noqa: F401

    def live_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # One call, not one per dict: each call first maps every parameter's name (a few ms).
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        _check_optimizer_leaves(optimizer_state)
        return {"model": model_state, "optimizer": optimizer_state}

    def plain_owner(self) -> bool:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0

    def _load(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        # Separately, not set_state_dict: on its broadcast path an empty model dict on one
        # rank makes that rank skip the model's collectives while the others wait in them.
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])


# ------------------------------------------------------------------ chunks of one leaf
# A DTensor's box and ownership on this rank follow from its global shape, placements and
# mesh alone; a walk meets the same few layouts many times (each moment has its
# parameter's), and working one out costs ~0.1 ms of Python.
_LayoutKey = tuple[tuple[int, ...], tuple[Any, ...], int]
Layouts = dict[_LayoutKey, tuple[Box, bool]]


def chunk_of(path: KeyPath, name: str, tensor: torch.Tensor, *, plain_owner: bool,
             layouts: Layouts) -> TensorChunk:
    """The chunk record of one tensor leaf (a DTensor's local piece, or a whole tensor);
    ``layouts`` remembers the DTensor layouts met so far in one walk."""
    if not isinstance(tensor, DTensor):
        shape = tuple(tensor.shape)
        return TensorChunk(path=path, name=name, dtype=tensor.dtype, global_shape=shape,
                           box=Box((0,) * len(shape), shape), local=tensor, owner=plain_owner, sharded=False)
    local = _local(tensor)
    global_shape = tuple(tensor.shape)
    key = (global_shape, tuple(tensor.placements), id(tensor.device_mesh))
    known = layouts.get(key)
    if known is None:
        known = layouts[key] = (_dtensor_box(name, tensor), _owns(name, tensor))
    box, owner = known
    if box.sizes != tuple(local.shape):
        raise UnsupportedStateError(
            name, f"placements {tensor.placements}: local piece {tuple(local.shape)} is not its box {box.sizes}")
    return TensorChunk(path=path, name=name, dtype=tensor.dtype, global_shape=global_shape, box=box,
                       local=local, owner=owner, sharded=True)


def _dtensor_box(name: str, tensor: DTensor) -> Box:
    pieces = tensor.__create_chunk_list__()
    if len(pieces) != 1:
        raise UnsupportedStateError(name, f"a DTensor whose local piece is {len(pieces)} chunks, not one box")
    return Box(tuple(int(i) for i in pieces[0].offsets), tuple(int(n) for n in pieces[0].sizes))


def _owns(name: str, tensor: DTensor) -> bool:
    """The first replica (coordinate 0 on every Replicate mesh dimension) owns the chunk."""
    if any(placement.is_partial() for placement in tensor.placements):
        raise UnsupportedStateError(name, f"a DTensor with a Partial placement {tensor.placements} (not reduced)")
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh: it holds nothing of it
        return False
    return all(index == 0 for index, placement in zip(coordinate, tensor.placements) if placement.is_replicate())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece: the tensor ``to_local()`` returns a view of, without the
    autograd function ``to_local()`` runs (~10 us a call; a walk makes hundreds)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _check_optimizer_leaves(optimizer_state: Mapping[str, Any]) -> None:
    """A plain tensor with dimensions in a sharded optimizer's state would be ambiguous
    (a whole tensor, or a rank's piece?): refused by name. 0-d ones (``step``) are whole."""
    for _, name, leaf in leaves_of({"optimizer": {"state": optimizer_state.get("state", {})}}):
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) and leaf.dim() > 0:
            raise UnsupportedStateError(name, "a plain torch.Tensor with dimensions in the state of a sharded "
                                              "optimizer (expected a DTensor, or a 0-d tensor such as step)")


class SavedLeaf(NamedTuple):
    """A saved tensor's global shape and dtype: enough to make a target to read it into."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype


def _empty_like_saved(param: torch.Tensor, leaf: SavedLeaf) -> torch.Tensor:
    """A state tensor shaped as ``leaf``: laid out as the parameter (a DTensor with its
    placements) when it has the parameter's shape, else a plain one (``step``)."""
    if tuple(leaf.global_shape) == tuple(param.shape):
        return torch.empty_like(param, dtype=leaf.dtype, requires_grad=False)
    return torch.empty(leaf.global_shape, dtype=leaf.dtype)


def _initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create lazily made optimizer state (Adam's) so that there is something to fill: a
    step with zero gradients and a zero learning rate (torch's own helper)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


# ------------------------------------------------------------------ walkers' visitors
class _LocalViewBuilder(ContainerRebuilder):
    def __init__(self, plain_owner: bool) -> None:
        self.plain_owner = plain_owner
        self.chunks: list[TensorChunk] = []
        self.layouts: Layouts = {}

    def leaf(self, path: KeyPath, name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        chunk = chunk_of(path, name, value, plain_owner=self.plain_owner, layouts=self.layouts)
        self.chunks.append(chunk)
        return chunk.local

    def scalar(self, path: KeyPath, name: str, value: Any) -> Any:
        return value


class _RestoreBuilder(ContainerRebuilder):
    """The targets' tree, each tensor filled in place, each other leaf taken from ``saved``."""

    def __init__(self, fill: Fill, saved: Mapping[str, Any], plain_owner: bool) -> None:
        self.fill = fill
        self.saved = saved
        self.plain_owner = plain_owner
        self.layouts: Layouts = {}

    def leaf(self, path: KeyPath, name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return _saved_at(self.saved, path, name)
        with torch.no_grad():
            self.fill(chunk_of(path, name, value, plain_owner=self.plain_owner, layouts=self.layouts))
        return value

    def scalar(self, path: KeyPath, name: str, value: Any) -> Any:
        return _saved_at(self.saved, path, name)


class _PathCollector(StateVisitor[None]):
    """Every leaf's and scalar's path, by name, and the scalars' paths in order."""

    def __init__(self) -> None:
        self.names: dict[str, KeyPath] = {}
        self.scalars: list[KeyPath] = []

    def leaf(self, path: KeyPath, name: str, value: Any) -> None:
        self.names[name] = path

    def scalar(self, path: KeyPath, name: str, value: Any) -> None:
        self.names[name] = path
        self.scalars.append(path)

    def mapping(self, path: KeyPath, name: str, value: Mapping, items: list, metadata: Any) -> None:
        return None

    def sequence(self, path: KeyPath, name: str, value: list | tuple, items: list) -> None:
        return None


def _paths(state: Any) -> dict[str, KeyPath]:
    collector = _PathCollector()
    walk_state(state, collector)
    return collector.names


def scalar_paths(state: Any) -> list[KeyPath]:
    """The path of every non-tensor leaf (None, bool, int, float, str) of ``state``, in order."""
    collector = _PathCollector()
    walk_state(state, collector)
    return collector.scalars


def _check_same_structure(target: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """The same leaves on both sides, and the optimizer's groups naming the same parameters."""
    wanted, have = _paths(target), _paths(saved)
    for name in wanted:
        if name not in have:
            raise RestoreMismatchError(name, "missing from the checkpoint")
    for name in have:
        if name not in wanted:
            raise RestoreMismatchError(name, "in the checkpoint but not in the model or optimizer")
    for index, (group, saved_group) in enumerate(zip(target["optimizer"].get("param_groups", []),
                                                      saved["optimizer"].get("param_groups", []))):
        if list(group.get("params", [])) != list(saved_group.get("params", [])):
            raise RestoreMismatchError(f"optimizer/param_groups/{index}/params",
                                       f"{saved_group.get('params')!r:.200} saved, {group.get('params')!r:.200} now")


def _saved_at(saved: Any, path: KeyPath, name: str) -> Any:
    node = saved
    for key in path:
        if key is METADATA:
            node = getattr(node, "_metadata", _MISSING)
        elif isinstance(node, Mapping):
            node = node.get(key, _MISSING)
        elif isinstance(node, (list, tuple)) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            node = _MISSING
        if node is _MISSING:
            raise RestoreMismatchError(name, "missing from the checkpoint")
    return node


_MISSING = object()
