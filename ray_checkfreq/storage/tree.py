"""Split a nested training state into a JSON skeleton and a list of array leaves.

The skeleton is plain JSON in which every container is a one-key object naming its
type, so that int dict keys (an optimizer's ``state``), tuples (Adam's ``betas``),
``OrderedDict`` with its ``_metadata`` (a module's ``state_dict()``) and non-finite
floats come back exactly as they were saved. Array leaves are replaced by
``{"tensor": i}``, ``{"ndarray": i}`` or ``{"npscalar": i}``, where ``i`` indexes the
leaf list. Nothing here is ever unpickled: unknown tags are rejected on load.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from ray_checkfreq.errors import UnsupportedStateError

MAX_DEPTH = 64

Leaf = Union[torch.Tensor, np.ndarray]


@dataclass(frozen=True)
class FlatState:
    """A state split for storage: ``skeleton`` is JSON, ``leaves[i]`` are arrays."""

    skeleton: Any
    leaves: list[Leaf]
    key_paths: list[str]


def format_key_path(path: tuple) -> str:
    """``("optimizer", "state", 0, "exp_avg")`` -> ``"optimizer/state/0/exp_avg"``."""
    return "/".join(str(part) for part in path) if path else "<root>"


def flatten_state(state: Mapping[str, Any]) -> FlatState:
    """Split ``state``; raises UnsupportedStateError naming the first bad key path."""
    if not isinstance(state, Mapping):
        raise UnsupportedStateError("<root>", f"state must be a mapping, got {type(state).__name__}")
    leaves: list[Leaf] = []
    key_paths: list[str] = []
    skeleton = _encode(state, (), leaves, key_paths)
    return FlatState(skeleton=skeleton, leaves=leaves, key_paths=key_paths)


def _encode(value: Any, path: tuple, leaves: list, key_paths: list) -> Any:
    if len(path) > MAX_DEPTH:
        raise UnsupportedStateError(format_key_path(path), f"nesting deeper than {MAX_DEPTH} (a cycle?)")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _encode_float(float(value))
    if isinstance(value, torch.Tensor):
        return {"tensor": _add_leaf(_checked_tensor(value, path), path, leaves, key_paths)}
    if isinstance(value, np.ndarray):
        return {"ndarray": _add_leaf(_checked_ndarray(value, path), path, leaves, key_paths)}
    if isinstance(value, np.generic):
        array = _checked_ndarray(np.asarray(value), path)
        return {"npscalar": _add_leaf(array, path, leaves, key_paths)}
    if isinstance(value, Mapping):
        return _encode_mapping(value, path, leaves, key_paths)
    if isinstance(value, (list, tuple)):
        tag = "tuple" if isinstance(value, tuple) else "list"
        return {tag: [_encode(v, path + (i,), leaves, key_paths) for i, v in enumerate(value)]}
    raise UnsupportedStateError(
        format_key_path(path),
        f"value of type {type(value).__module__}.{type(value).__qualname__} is not a tensor, "
        "numpy array or JSON-able value (None, bool, int, float, str, list, tuple, dict)",
    )


def _encode_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _encode_mapping(value: Mapping, path: tuple, leaves: list, key_paths: list) -> dict:
    for key in value:
        _check_key(key, path)
    if all(isinstance(k, str) for k in value):
        body: Any = {k: _encode(v, path + (k,), leaves, key_paths) for k, v in value.items()}
        tag = "dict"
    else:
        body = [[k, _encode(v, path + (k,), leaves, key_paths)] for k, v in value.items()]
        tag = "items"
    node: dict[str, Any] = {tag: body}
    if isinstance(value, OrderedDict):
        node["ordered"] = True
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            node["metadata"] = _encode(metadata, path + ("_metadata",), leaves, key_paths)
    return node


def _check_key(key: Any, path: tuple) -> None:
    ok = key is None or isinstance(key, (str, bool, int)) or (
        isinstance(key, float) and math.isfinite(key)
    )
    if not ok:
        raise UnsupportedStateError(
            format_key_path(path + (key,)),
            f"dict key of type {type(key).__name__} (allowed: str, int, bool, finite float, None)",
        )


def _add_leaf(leaf: Leaf, path: tuple, leaves: list, key_paths: list) -> int:
    leaves.append(leaf)
    key_paths.append(format_key_path(path))
    return len(leaves) - 1


def _checked_tensor(tensor: torch.Tensor, path: tuple) -> torch.Tensor:
    where = format_key_path(path)
    if tensor.layout != torch.strided:
        raise UnsupportedStateError(where, f"tensor layout {tensor.layout} is not supported (only dense)")
    if tensor.is_quantized:
        raise UnsupportedStateError(where, "quantized tensors are not supported")
    if tensor.device.type == "meta":
        raise UnsupportedStateError(where, "tensor on the meta device has no data")
    return tensor.detach()


_NUMPY_KINDS = frozenset("biufc")


def _checked_ndarray(array: np.ndarray, path: tuple) -> np.ndarray:
    if array.dtype.kind not in _NUMPY_KINDS or array.dtype.fields is not None:
        raise UnsupportedStateError(
            format_key_path(path),
            f"numpy dtype {array.dtype} is not supported (only bool, integer, float, complex)",
        )
    return array


def unflatten_state(skeleton: Any, leaves: list[Any]) -> Any:
    """Rebuild the state from a validated skeleton; leaves are indexed by position."""
    return _decode(skeleton, leaves)


class SkeletonError(ValueError):
    """The skeleton is not one this module writes."""


def _decode(node: Any, leaves: list[Any]) -> Any:
    if node is None or isinstance(node, (bool, str, int, float)):
        return node
    if not isinstance(node, dict) or not node:
        raise SkeletonError(f"unexpected skeleton node {node!r:.80}")
    tag = next(iter(node))
    if tag in ("tensor", "ndarray", "npscalar"):
        return _decode_leaf(tag, node[tag], leaves)
    if tag == "float":
        return _decode_float(node["float"])
    if tag in ("list", "tuple"):
        items = [_decode(v, leaves) for v in _expect_list(node[tag])]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict":
        return _finish_mapping(node, [(k, _decode(v, leaves)) for k, v in node["dict"].items()], leaves)
    if tag == "items":
        pairs = [_decode_pair(pair, leaves) for pair in _expect_list(node["items"])]
        return _finish_mapping(node, pairs, leaves)
    raise SkeletonError(f"unknown skeleton tag {tag!r}")


def _decode_leaf(tag: str, index: Any, leaves: list[Any]) -> Any:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(leaves):
        raise SkeletonError(f"{tag} reference {index!r} out of range")
    leaf = leaves[index]
    return leaf[()] if tag == "npscalar" else leaf


def _decode_float(text: Any) -> float:
    if text not in ("nan", "inf", "-inf"):
        raise SkeletonError(f"bad float literal {text!r}")
    return float(text)


def _decode_pair(pair: Any, leaves: list[Any]) -> tuple:
    if not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], (dict, list)):
        raise SkeletonError(f"bad dict item {pair!r:.80}")
    return pair[0], _decode(pair[1], leaves)


def _finish_mapping(node: dict, pairs: list, leaves: list[Any]) -> dict:
    if not node.get("ordered"):
        return dict(pairs)
    result: OrderedDict = OrderedDict(pairs)
    if "metadata" in node:
        result._metadata = _decode(node["metadata"], leaves)  # type: ignore[attr-defined]
    return result


def _expect_list(value: Any) -> list:
    if not isinstance(value, list):
        raise SkeletonError(f"expected a list, got {type(value).__name__}")
    return value


def skeleton_leaf_refs(node: Any) -> list[tuple[str, Any]]:
    """All ``(tag, index)`` leaf references of a skeleton, in order, for validation.

    Walks by tag, so a user key that happens to be called "tensor" is not a reference.
    """
    refs: list[tuple[str, Any]] = []
    _collect_refs(node, refs, 0)
    return refs


def _collect_refs(node: Any, refs: list, depth: int) -> None:
    if depth > 4 * MAX_DEPTH:
        raise SkeletonError("skeleton nested too deeply")
    if not isinstance(node, dict) or not node:
        return
    tag = next(iter(node))
    if tag in ("tensor", "ndarray", "npscalar"):
        refs.append((tag, node[tag]))
        return
    children: list = []
    if tag in ("list", "tuple") and isinstance(node[tag], list):
        children = node[tag]
    elif tag == "dict" and isinstance(node[tag], dict):
        children = list(node[tag].values())
    elif tag == "items" and isinstance(node[tag], list):
        children = [pair[1] for pair in node[tag] if isinstance(pair, list) and len(pair) == 2]
    if "metadata" in node:
        children = children + [node["metadata"]]
    for child in children:
        _collect_refs(child, refs, depth + 1)
