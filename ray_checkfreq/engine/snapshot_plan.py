"""The local view a sharded snapshot copies from, kept from one checkpoint to the next.

Building that view (``get_*_state_dict``, every DTensor's ``to_local()`` and box, which
leaves are parameters) costs milliseconds of Python per checkpoint on the critical path,
more with every tensor. Yet nothing of it changes while the objects it came from stay
the same: the optimizer updates parameters and its state in place. ``LocalViews`` keeps
the view built at one checkpoint (a ``_Plan``) with a fingerprint of those objects; a
later checkpoint whose fingerprint matches reuses it, with the live tensors and the
optimizer's hyper-parameters of now filled in. Anything else misses and builds the view
again: a parameter, buffer or state tensor replaced, its storage swapped or resized, a
DTensor's placement changed, a param group or hyper-parameter key added, the optimizer's
state created or reloaded.

Invariant: a view from a plan has the tensors (the same memory, shape, stride and dtype)
and the non-tensor leaves the full build would give now. A build keeps no plan where it
could not promise that: a tensor leaf that is not the memory of a parameter, buffer or
optimizer state tensor (a state-dict hook that copies), a non-tensor leaf in the model's
state other than its ``_metadata`` (``get_extra_state``) or in the optimizer's state, a
tensor in a container that cannot be refilled (a tuple), or a hyper-parameter that is a
tensor or differs from the live one. The plan holds the live objects only weakly, and
its view's tensors only while a snapshot is being taken (``SnapshotView.release``).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ray_checkfreq.engine.state import ChunkPlace, StateAdapter, scalar_paths
from ray_checkfreq.storage.tree import METADATA, KeyPath

logger = logging.getLogger("ray_checkfreq.engine")

_Geometry = tuple[int, torch.Size, tuple[int, ...], torch.dtype]


@dataclass
class SnapshotView:
    """The live model and optimizer state as local tensors (``state``), which of the
    model's keys are parameters, and every tensor leaf's place in its global tensor."""

    state: dict[str, Any]
    param_keys: frozenset[str]
    places: Mapping[KeyPath, ChunkPlace]
    _holes: list[tuple[Any, Any]] = field(default_factory=list)

    def release(self) -> None:
        """Drop the plan's references to the live tensors (the snapshot has its copies)."""
        for container, key in self._holes:
            container[key] = None


class LocalViews:
    """The adapter's local view for each snapshot, from the plan while it still fits."""

    def __init__(self, adapter: StateAdapter) -> None:
        self.adapter = adapter
        self.builds = 0  # full builds (the first, and every miss)
        self.reuses = 0
        self._plan: _Plan | None = None
        self._warned = False

    def take(self) -> SnapshotView:
        """The view of the state now; ``release()`` it once its tensors are copied."""
        plan = self._plan
        if plan is not None:
            optimizer = self.adapter.optimizer
            view = plan.fill(_Fingerprint.of(self.adapter.model, optimizer), optimizer)
            if view is not None:
                self.reuses += 1
                return view
        return self._build()

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups as the view holds them (hyper-parameters of now)."""
        view = self.take()
        groups = view.state["optimizer"]["param_groups"]
        view.release()
        return groups

    def _build(self) -> SnapshotView:
        self.builds += 1
        adapter = self.adapter
        live = adapter.live_state()
        local = adapter.local_view(live)
        view = SnapshotView(state=local.state, param_keys=frozenset(adapter.param_keys(live["model"])),
                            places={chunk.path: ChunkPlace.of(chunk) for chunk in local.chunks})
        fingerprint = _Fingerprint.of(adapter.model, adapter.optimizer)
        plan, why_not = _Plan.build(view, [chunk.local for chunk in local.chunks],
                                    [chunk.path for chunk in local.chunks], fingerprint, adapter.optimizer)
        self._plan = plan
        if plan is None and not self._warned:
            self._warned = True
            logger.info("every sharded snapshot builds its view of the state again (a few ms each): %s", why_not)
        return view


@dataclass
class _Fingerprint:
    """What the view depends on: the live objects (compared by identity) and their
    shapes, memory and structure (compared by value)."""

    objects: list[Any]
    marks: list[Any]
    locals_: list[torch.Tensor]  # the live local tensors, in the order of ``objects``' tensors
    plain_state: bool  # every optimizer state value is a tensor

    @staticmethod
    def of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> _Fingerprint:
        found = _Fingerprint([], [], [], True)
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            found._add(tensor)
        found.marks.append((len(optimizer.param_groups), len(optimizer.state)))
        for group in optimizer.param_groups:
            found.marks.append(tuple(group.keys()))
            found.marks.append(len(group["params"]))
            for param in group["params"]:
                found.objects.append(param)
                found._add_state(optimizer.state.get(param))
        return found

    def _add_state(self, state: Mapping[str, Any] | None) -> None:
        if state is None:
            self.marks.append(None)
            return
        self.marks.append(tuple(state.keys()))
        for value in state.values():
            if isinstance(value, torch.Tensor):
                self._add(value)
            else:
                self.plain_state = False

    def _add(self, tensor: torch.Tensor) -> None:
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        self.objects.append(tensor)
        self.objects.append(local)
        if isinstance(tensor, DTensor):
            self.objects.append(tensor._spec)
        self.marks.append(_geometry(local))
        self.locals_.append(local)


def _geometry(tensor: torch.Tensor) -> _Geometry:
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype


@dataclass
class _Plan:
    """A view to refill: where its tensors go, which live tensor each is, and its groups."""

    view: SnapshotView
    slots: list[int]  # per hole, the index of its tensor in ``_Fingerprint.locals_``
    refs: list[weakref.ref]
    marks: list[Any]
    group_keys: list[tuple[str, ...]]  # per param group, the hyper-parameters the view holds

    @staticmethod
    def build(view: SnapshotView, tensors: list[torch.Tensor], paths: list[KeyPath], fingerprint: _Fingerprint,
              optimizer: torch.optim.Optimizer) -> tuple[_Plan | None, str]:
        """The plan of a freshly built view (its tensor leaves ``tensors`` at ``paths``), or
        None and why it could not reproduce that view from the fingerprint alone."""
        if not fingerprint.plain_state:
            return None, "the optimizer's state holds values that are not tensors"
        odd = _odd_scalar(view.state)
        if odd is not None:
            return None, f"{odd} is not a tensor (only the model's _metadata and param_groups may be)"
        by_geometry = {_geometry(local): index for index, local in enumerate(fingerprint.locals_)}
        slots, holes = [], []
        for tensor, path in zip(tensors, paths):
            slot = by_geometry.get(_geometry(tensor))
            container = _container(view.state, path)
            where = "/".join(map(str, path))
            if slot is None:
                return None, f"the tensor at {where} is not the memory of a parameter, buffer or optimizer state"
            if container is None:
                return None, f"the tensor at {where} is in a container other than a dict or list"
            slots.append(slot)
            holes.append((container, path[-1]))
        group_keys, why_groups = _group_keys(view.state["optimizer"].get("param_groups", []), optimizer)
        if group_keys is None:
            return None, why_groups
        view._holes = holes
        refs = [weakref.ref(obj) for obj in fingerprint.objects]
        return _Plan(view=view, slots=slots, refs=refs, marks=fingerprint.marks, group_keys=group_keys), ""

    def fill(self, now: _Fingerprint, optimizer: torch.optim.Optimizer) -> SnapshotView | None:
        """The view refilled with the live tensors and hyper-parameters; None on a miss."""
        if now.marks != self.marks or len(now.objects) != len(self.refs):
            return None
        if any(ref() is not obj for ref, obj in zip(self.refs, now.objects)):
            return None
        view = self.view
        for (container, key), slot in zip(view._holes, self.slots):
            container[key] = now.locals_[slot]
        groups = view.state["optimizer"].get("param_groups", [])
        for group, keys, live in zip(groups, self.group_keys, optimizer.param_groups):
            group.update((key, live[key]) for key in keys)
        return view


def _container(state: Any, path: KeyPath) -> Any:
    """The dict or list holding the leaf at ``path`` (None for any other container)."""
    node = state
    for key in path[:-1]:
        node = node._metadata if key is METADATA else node[key]
    return node if isinstance(node, (dict, list)) else None


def _group_keys(groups: list[Mapping[str, Any]],
                optimizer: torch.optim.Optimizer) -> tuple[list[tuple[str, ...]] | None, str]:
    """Per group, the hyper-parameters the view takes from the live group; None where a
    view's group is not the live group with ``params`` renamed."""
    if len(groups) != len(optimizer.param_groups):
        return None, f"{len(groups)} param groups in the state dict, {len(optimizer.param_groups)} in the optimizer"
    found = []
    for index, (group, live) in enumerate(zip(groups, optimizer.param_groups)):
        keys = tuple(key for key in group if key != "params")
        if set(keys) != set(live) - {"params"}:
            return None, f"param_groups/{index} has other keys than the optimizer's"
        for key in keys:
            value = live[key]
            if isinstance(value, torch.Tensor) or type(value) is not type(group[key]) or value != group[key]:
                return None, f"param_groups/{index}/{key} is a tensor or differs from the optimizer's"
        found.append(keys)
    return found, ""


def _odd_scalar(state: Mapping[str, Any]) -> str | None:
    """The first non-tensor leaf outside the model's ``_metadata`` and the param groups."""
    for path in scalar_paths(state):
        allowed = (path[0] == "model" and METADATA in path) or path[:2] == ("optimizer", "param_groups")
        if not allowed:
            return "/".join(map(str, path))
    return None
