"""Checks before loading a checkpoint into a live model and optimizer.

``load_state_dict`` either fails with a list of every difference or, for an optimizer,
silently accepts state of the wrong shape; these checks name the first mismatch instead.

Across placements the optimizer's state is keyed two ways: ``optimizer.state_dict()``
numbers the parameters (0, 1, ... in ``param_groups`` order), a sharded checkpoint names
them (``get_optimizer_state_dict``). ``optimizer_by_name`` and ``optimizer_by_number``
turn one into the other, as torch's own state-dict helpers do: by place in the groups.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ray_checkfreq.errors import CheckFreqError
from ray_checkfreq.storage.store import CheckpointRef, CheckpointStore

logger = logging.getLogger("ray_checkfreq.engine")


class RestoreMismatchError(CheckFreqError, ValueError):
    """The checkpoint does not fit the model or optimizer; names the first mismatching key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason)
        self.key = key
        self.reason = reason

    def __str__(self) -> str:
        return f"checkpoint does not fit at {self.key!r}: {self.reason}"


def check_model_state(model: torch.nn.Module, saved: Mapping[str, Any]) -> None:
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key not in saved:
            raise RestoreMismatchError(f"model/{key}", "missing from the checkpoint")
        _check_tensor(f"model/{key}", saved[key], tensor.shape, tensor.dtype)
    for key in saved:
        if key not in expected:
            raise RestoreMismatchError(f"model/{key}", "in the checkpoint but not in the model")


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], info: Mapping[str, Any]) -> None:
    kind = type(optimizer).__qualname__
    if info.get("optimizer_class") != kind:
        raise RestoreMismatchError("optimizer", f"saved by {info.get('optimizer_class')}, loading into {kind}")
    groups = optimizer.param_groups
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(groups):
        raise RestoreMismatchError("optimizer/param_groups", f"{len(saved_groups)} saved, {len(groups)} now")
    index = 0
    for g, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved_group["params"]):
            raise RestoreMismatchError(
                f"optimizer/param_groups/{g}/params",
                f"{len(saved_group['params'])} parameters saved, {len(group['params'])} now",
            )
        for param, saved_id in zip(group["params"], saved_group["params"]):
            _check_param_state(index, param, saved.get("state", {}).get(saved_id, {}))
            index += 1


def _check_param_state(index: int, param: torch.Tensor, state: Mapping[str, Any]) -> None:
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != 1:
            if value.shape != param.shape:
                raise RestoreMismatchError(
                    f"optimizer/state/{index}/{name}",
                    f"shape {tuple(value.shape)} in the checkpoint, parameter has {tuple(param.shape)}",
                )


def _check_tensor(key: str, value: Any, shape: torch.Size, dtype: torch.dtype) -> None:
    if not isinstance(value, torch.Tensor):
        raise RestoreMismatchError(key, f"expected a tensor, the checkpoint has {type(value).__name__}")
    if value.shape != shape:
        raise RestoreMismatchError(key, f"shape {tuple(value.shape)} in the checkpoint, {tuple(shape)} in the model")
    if value.dtype != dtype:
        raise RestoreMismatchError(key, f"dtype {value.dtype} in the checkpoint, {dtype} in the model")


def exact_checkpoints(store: CheckpointStore, step: int | None = None) -> list[CheckpointRef]:
    """Every complete checkpoint of either placement a resume may take, oldest first
    (never a near-lossless history copy); only those of ``step`` when given (only their
    manifests are read)."""
    return [ref for ref in store.list(step=step) if not ref.trimmed]


# ------------------------------------------------------------------ optimizer keys
def keyed_by_name(optimizer_state: Mapping[str, Any]) -> bool:
    """Whether the optimizer state names its parameters (a sharded checkpoint's) rather
    than numbering them (``optimizer.state_dict()``'s)."""
    return any(isinstance(param, str) for group in optimizer_state.get("param_groups", [])
               for param in group.get("params", []))


def parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The name in ``model`` of each parameter of each of the optimizer's groups."""
    names = {id(param): name for name, param in model.named_parameters()}
    out = []
    for index, group in enumerate(optimizer.param_groups):
        unknown = [i for i, param in enumerate(group["params"]) if id(param) not in names]
        if unknown:
            raise RestoreMismatchError(f"optimizer/param_groups/{index}/params/{unknown[0]}",
                                       "the optimizer holds a parameter that is not the model's")
        out.append([names[id(param)] for param in group["params"]])
    return out


def optimizer_by_name(saved: Mapping[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """A numbered optimizer state keyed by the parameter names of the live groups
    ``names`` instead: the number at each place of a saved group takes the name at the
    same place of the live one."""
    groups = saved.get("param_groups", [])
    _check_group_sizes([list(group.get("params", [])) for group in groups], names)
    return _renamed(saved, {number: name for group, live in zip(groups, names)
                            for number, name in zip(group["params"], live)})


def optimizer_by_number(saved: Mapping[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """A named optimizer state numbered as ``optimizer.state_dict()`` numbers the live
    groups ``names``; every saved group must name the live group's parameters in order."""
    groups = [list(group.get("params", [])) for group in saved.get("param_groups", [])]
    _check_group_sizes(groups, names)
    for index, (group, live) in enumerate(zip(groups, names)):
        if group != live:
            wrong = next(i for i, (a, b) in enumerate(zip(group, live)) if a != b)
            raise RestoreMismatchError(f"optimizer/param_groups/{index}/params/{wrong}",
                                       f"{group[wrong]!r} saved, {live[wrong]!r} now")
    return _renamed(saved, {name: number for number, name in enumerate(n for live in names for n in live)})


def _check_group_sizes(saved: list[list[Any]], live: list[list[str]]) -> None:
    if len(saved) != len(live):
        raise RestoreMismatchError("optimizer/param_groups", f"{len(saved)} saved, {len(live)} now")
    for index, (group, names) in enumerate(zip(saved, live)):
        if len(group) != len(names):
            raise RestoreMismatchError(f"optimizer/param_groups/{index}/params",
                                       f"{len(group)} parameters saved, {len(names)} now")


def _renamed(saved: Mapping[str, Any], new_key: Mapping[Any, Any]) -> dict[str, Any]:
    state = {}
    for key, value in saved.get("state", {}).items():
        if key not in new_key:
            raise RestoreMismatchError(f"optimizer/state/{key}", "state of a parameter that no param group holds")
        state[new_key[key]] = value
    groups = [{**group, "params": [new_key[param] for param in group["params"]]}
              for group in saved.get("param_groups", [])]
    return {**saved, "state": state, "param_groups": groups}
