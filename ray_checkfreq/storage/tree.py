"""One walker over nested training state, and the storage split built on it.

``walk_state`` visits a state once, checks every key and value, and hands each node
to a ``StateVisitor`` together with its key path twice: as a tuple of the real keys
(``("optimizer", "state", 0, "exp_avg")``, unique within a state, used wherever code
keys something by leaf) and as a name (``"optimizer/state/0/exp_avg"``, the manifest's
``key`` and the export name). Names are the keys joined by ``/`` as they always were,
except where that would let two leaves share a name: a str key holding ``/`` or ``%``
is percent-encoded (``"a/b"`` -> ``"a%2Fb"``), and a str key that reads like a non-str
key beside it (``"0"`` next to ``0``, ``"True"`` next to ``True``) also has its first
character encoded (``"%30"``). Distinct leaves therefore always have distinct names.

The storage split: the skeleton is plain JSON in which every container is a one-key
object naming its type, so that int dict keys (an optimizer's ``state``), tuples
(Adam's ``betas``), ``OrderedDict`` with its ``_metadata`` (a module's ``state_dict()``)
and non-finite floats come back exactly as they were saved. Array leaves are replaced by
``{"tensor": i}``, ``{"ndarray": i}`` or ``{"npscalar": i}``, where ``i`` indexes the
leaf list. Nothing here is ever unpickled: unknown tags are rejected on load.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from ray_checkfreq.errors import UnsupportedStateError
from ray_checkfreq.storage.stored_json import MAX_DIGITS

MAX_DEPTH = 64
_LARGEST_STORED_INT = 10**MAX_DIGITS

Leaf = torch.Tensor | np.ndarray
KeyPath = tuple[Any, ...]
T = TypeVar("T")


class _MetadataKey:
    """The path part of an ``OrderedDict``'s ``_metadata``: never equal to a dict key."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "METADATA"


METADATA = _MetadataKey()
_METADATA_NAME = "%metadata"  # escaped names only hold %XX (hex), so this one is free


class StateVisitor(Generic[T]):
    """What ``walk_state`` builds: one method per kind of node, children visited first."""

    def leaf(self, path: KeyPath, name: str, value: Any) -> T:
        """A (dense) tensor, numpy array or numpy scalar."""
        raise NotImplementedError

    def scalar(self, path: KeyPath, name: str, value: Any) -> T:
        """None, bool, int, float or str."""
        raise NotImplementedError

    def mapping(self, path: KeyPath, name: str, value: Mapping, items: list[tuple[Any, T]],
                metadata: T | None) -> T:
        """``metadata``: the visited ``_metadata`` of an ``OrderedDict`` (None when it has none)."""
        raise NotImplementedError

    def sequence(self, path: KeyPath, name: str, value: list | tuple, items: list[T]) -> T:
        raise NotImplementedError


class ContainerRebuilder(StateVisitor[Any]):
    """A visitor that rebuilds the visited containers as they were (dict, ``OrderedDict``
    with its ``_metadata``, list, tuple); subclasses say what becomes of leaves and scalars."""

    def mapping(self, path: KeyPath, name: str, value: Mapping, items: list[tuple[Any, Any]],
                metadata: Any) -> Any:
        if not isinstance(value, OrderedDict):
            return dict(items)
        ordered: OrderedDict = OrderedDict(items)
        if metadata is not None:
            ordered._metadata = metadata  # type: ignore[attr-defined]
        return ordered

    def sequence(self, path: KeyPath, name: str, value: list | tuple, items: list[Any]) -> Any:
        return tuple(items) if isinstance(value, tuple) else items


def walk_state(state: Any, visitor: StateVisitor[T]) -> T:
    """Visit ``state``; raises UnsupportedStateError naming the first bad key path."""
    return _visit(state, (), "", visitor)


def _visit(value: Any, path: KeyPath, name: str, visitor: StateVisitor[T]) -> T:
    if len(path) > MAX_DEPTH:
        raise UnsupportedStateError(_shown(name), f"nesting deeper than {MAX_DEPTH} (a cycle?)")
    if value is None or isinstance(value, (bool, int, float, str)):
        return visitor.scalar(path, name, value)
    if isinstance(value, torch.Tensor):
        return visitor.leaf(path, name, _checked_tensor(value, name))
    if isinstance(value, np.ndarray):
        return visitor.leaf(path, name, _checked_ndarray(value, name))
    if isinstance(value, np.generic):
        _checked_ndarray(np.asarray(value), name)
        return visitor.leaf(path, name, value)
    if isinstance(value, Mapping):
        return _visit_mapping(value, path, name, visitor)
    if isinstance(value, (list, tuple)):
        items = [_visit(v, path + (i,), _child(path, name, str(i)), visitor) for i, v in enumerate(value)]
        return visitor.sequence(path, name, value, items)
    raise UnsupportedStateError(
        _shown(name),
        f"value of type {type(value).__module__}.{type(value).__qualname__} is not a tensor, "
        "numpy array or JSON-able value (None, bool, int, float, str, list, tuple, dict)",
    )


def _visit_mapping(value: Mapping, path: KeyPath, name: str, visitor: StateVisitor[T]) -> T:
    parts = key_names(list(value.keys()), name)
    items = [(k, _visit(v, path + (k,), _child(path, name, part), visitor))
             for (k, v), part in zip(value.items(), parts)]
    metadata = None
    if isinstance(value, OrderedDict):
        raw = getattr(value, "_metadata", None)
        if raw is not None:
            metadata = _visit(raw, path + (METADATA,), _child(path, name, _METADATA_NAME), visitor)
    return visitor.mapping(path, name, value, items, metadata)


def key_names(keys: list, parent: str = "") -> list[str]:
    """The name part of each key of one mapping: distinct for distinct keys."""
    if all(type(k) is str for k in keys):  # the common case, on every snapshot's path
        return [_escape(k, lookalike=False) if "%" in k or "/" in k else k for k in keys]
    plain = [_checked_key(k, parent) for k in keys]
    taken = {p for k, p in zip(keys, plain) if not isinstance(k, str)}
    return [_escape(k, lookalike=k in taken) if isinstance(k, str) else p for k, p in zip(keys, plain)]


def _checked_key(key: Any, parent: str) -> str:
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, bool) or key is None:
        return str(key)
    if isinstance(key, int):
        return int.__repr__(key)
    if isinstance(key, float) and math.isfinite(key):
        return float.__repr__(key)
    raise UnsupportedStateError(
        f"{parent}/{key}" if parent else str(key),
        f"dict key of type {type(key).__name__} (allowed: str, int, bool, finite float, None)",
    )


def _escape(key: str, *, lookalike: bool) -> str:
    """Percent-encoding of ``%`` and ``/`` (and of the first character when ``lookalike``)."""
    text = str.__str__(key).replace("%", "%25").replace("/", "%2F")
    if lookalike:  # then ``key`` reads like an int, float, bool or None: no % or / in it
        text = f"%{ord(text[0]):02X}{text[1:]}"
    return text


def _child(parent: KeyPath, name: str, part: str) -> str:
    return f"{name}/{part}" if parent else part  # a key "" still adds its "/"


def _shown(name: str) -> str:
    return name or "<root>"


def _checked_tensor(tensor: torch.Tensor, name: str) -> torch.Tensor:
    where = _shown(name)
    if tensor.layout is not torch.strided:
        raise UnsupportedStateError(where, f"tensor layout {tensor.layout} is not supported (only dense)")
    if tensor.is_quantized:
        raise UnsupportedStateError(where, "quantized tensors are not supported")
    if tensor.is_meta:
        raise UnsupportedStateError(where, "tensor on the meta device has no data")
    return tensor


_NUMPY_KINDS = frozenset("biufc")


def _checked_ndarray(array: np.ndarray, name: str) -> np.ndarray:
    if array.dtype.kind not in _NUMPY_KINDS or array.dtype.fields is not None:
        raise UnsupportedStateError(
            _shown(name), f"numpy dtype {array.dtype} is not supported (only bool, integer, float, complex)",
        )
    return array


class _LeafCollector(StateVisitor[None]):
    def __init__(self) -> None:
        self.found: list[tuple[KeyPath, str, Any]] = []

    def leaf(self, path: KeyPath, name: str, value: Any) -> None:
        self.found.append((path, name, value))

    def scalar(self, path: KeyPath, name: str, value: Any) -> None:
        return None

    def mapping(self, path: KeyPath, name: str, value: Mapping, items: list, metadata: Any) -> None:
        return None

    def sequence(self, path: KeyPath, name: str, value: list | tuple, items: list) -> None:
        return None


def leaves_of(state: Any) -> list[tuple[KeyPath, str, Any]]:
    """``(path, name, leaf)`` of every tensor and array of ``state``, in order."""
    collector = _LeafCollector()
    walk_state(state, collector)
    return collector.found


# ------------------------------------------------------------------ storage split
@dataclass(frozen=True)
class FlatState:
    """A state split for storage: ``skeleton`` is JSON, ``leaves[i]`` are arrays.

    ``key_paths[i]`` is the unique name of leaf i, ``paths[i]`` its tuple path.
    """

    skeleton: Any
    leaves: list[Leaf]
    key_paths: list[str]
    paths: list[KeyPath]


def flatten_state(state: Mapping[str, Any]) -> FlatState:
    """Split ``state``; raises UnsupportedStateError naming the first bad key path."""
    if not isinstance(state, Mapping):
        raise UnsupportedStateError("<root>", f"state must be a mapping, got {type(state).__name__}")
    encoder = _SkeletonEncoder()
    skeleton = walk_state(state, encoder)
    return FlatState(skeleton=skeleton, leaves=encoder.leaves, key_paths=encoder.names, paths=encoder.paths)


class _SkeletonEncoder(StateVisitor[Any]):
    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.names: list[str] = []
        self.paths: list[KeyPath] = []

    def leaf(self, path: KeyPath, name: str, value: Any) -> Any:
        tag = "tensor" if isinstance(value, torch.Tensor) else (
            "ndarray" if isinstance(value, np.ndarray) else "npscalar")
        self.leaves.append(value.detach() if tag == "tensor" else np.asarray(value) if tag == "npscalar" else value)
        self.names.append(name)
        self.paths.append(path)
        return {tag: len(self.leaves) - 1}

    def scalar(self, path: KeyPath, name: str, value: Any) -> Any:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, int):
            if abs(value) >= _LARGEST_STORED_INT:  # a reader would refuse the manifest
                raise UnsupportedStateError(_shown(name), f"an int of more than {MAX_DIGITS} digits")
            return int(value)
        return _encode_float(float(value))

    def mapping(self, path: KeyPath, name: str, value: Mapping, items: list[tuple[Any, Any]],
                metadata: Any) -> Any:
        node: dict[str, Any]
        if all(isinstance(k, str) for k, _ in items):
            node = {"dict": {str.__str__(k): v for k, v in items}}
        else:
            node = {"items": [[k, v] for k, v in items]}
        if isinstance(value, OrderedDict):
            node["ordered"] = True
            if metadata is not None:
                node["metadata"] = metadata
        return node

    def sequence(self, path: KeyPath, name: str, value: list | tuple, items: list[Any]) -> Any:
        return {"tuple" if isinstance(value, tuple) else "list": items}


def _encode_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


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
        _children("dict", node["dict"])  # checks it is an object
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


def skeleton_leaf_refs(node: Any) -> list[tuple[str, int]]:
    """All ``(tag, index)`` leaf references of a skeleton, in order, checking that every
    node is one ``unflatten_state`` decodes (SkeletonError naming the first that is not).

    Walks by tag, so a user key that happens to be called "tensor" is not a reference.
    """
    refs: list[tuple[str, int]] = []
    _collect_refs(node, refs, 0)
    return refs


def _collect_refs(node: Any, refs: list, depth: int) -> None:
    if depth > 4 * MAX_DEPTH:
        raise SkeletonError("skeleton nested too deeply")
    if node is None or isinstance(node, (bool, str, int, float)):
        return
    if not isinstance(node, dict) or not node:
        raise SkeletonError(f"unexpected skeleton node {node!r:.80}")
    tag = next(iter(node))
    value = node[tag]
    if tag in ("tensor", "ndarray", "npscalar"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise SkeletonError(f"{tag} reference {value!r:.80} is not an integer")
        refs.append((tag, value))
        return
    if tag == "float":
        _decode_float(value)
        return
    children = _children(tag, value)
    if "metadata" in node:
        if tag not in ("dict", "items"):
            raise SkeletonError(f"metadata on a {tag} node")
        children.append(node["metadata"])
    for child in children:
        _collect_refs(child, refs, depth + 1)


def _children(tag: str, value: Any) -> list:
    if tag in ("list", "tuple"):
        return list(_expect_list(value))
    if tag == "dict":
        if not isinstance(value, dict):
            raise SkeletonError(f"expected an object under dict, got {type(value).__name__}")
        return list(value.values())
    if tag == "items":
        for pair in _expect_list(value):
            if not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], (dict, list)):
                raise SkeletonError(f"bad dict item {pair!r:.80}")
        return [pair[1] for pair in value]
    raise SkeletonError(f"unknown skeleton tag {tag!r:.80}")
