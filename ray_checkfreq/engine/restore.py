"""Checks before loading a checkpoint into a live model and optimizer.

``load_state_dict`` either fails with a list of every difference or, for an optimizer,
silently accepts state of the wrong shape; these checks name the first mismatch instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ray_checkfreq.errors import CheckFreqError


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
