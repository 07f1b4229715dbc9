"""Hypothesis strategies for nested training state, and an exact comparison."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

TORCH_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
] + [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32") if hasattr(torch, name)]

NUMPY_DTYPES = ["<f8", "<f4", "<f2", ">f4", "<i8", "<i4", "|u1", "|b1", "<c8"]


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    """Any dtype and shape (empty, 0-d included), arbitrary bit patterns, maybe a view."""
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    numel = math.prod(shape)
    itemsize = dtype.itemsize
    if dtype == torch.bool:
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    tensor = base.view(dtype).reshape(shape)
    view = draw(st.sampled_from(["none", "transpose", "stride"]))
    if view == "transpose" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    elif view == "stride" and tensor.dim() >= 1:
        tensor = tensor[::2]
    return tensor


@st.composite
def arrays(draw: Any) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    numel = math.prod(shape)
    if dtype.kind == "b":
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8),
    st.floats(allow_nan=False), st.sampled_from([math.inf, -math.inf]),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))


def _containers(children: Any) -> Any:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(st.text(max_size=6), children, max_size=3).map(OrderedDict),
    )


# Keys whose "/"-joined names used to collide: "/" inside keys, ints beside strings that
# read like them ("0", "-1", "True", "None", "1.5"), "%" (the escape character itself).
tricky_keys = st.one_of(
    st.sampled_from([0, "0", 1, "1", True, "True", None, "None", 1.5, "1.5", "a", "b", "a/b", "a/0", "0/a"]),
    st.sampled_from(["/", "", "%", "%30", "%2F", "a%2Fb"]),
)


def _tricky_containers(children: Any) -> Any:
    return st.one_of(
        st.dictionaries(tricky_keys, children, max_size=4),
        st.dictionaries(st.sampled_from(["a", "b", "0", "a/b", "%2F"]), children, max_size=3).map(OrderedDict),
        st.lists(children, max_size=3),
    )


def map_tensors(value: Any, fn: Any) -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)``, in order (dicts, lists)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, OrderedDict):
        return OrderedDict((k, map_tensors(v, fn)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    return value


def _number_leaves(value: Any, counter: list[int]) -> Any:
    """Every tensor becomes ``full((3,), n)`` with its own n: same shape and dtype, so that a
    buffer or base shared by two leaves shows as equal values."""

    def numbered(_: torch.Tensor) -> torch.Tensor:
        counter[0] += 1
        return torch.full((3,), float(counter[0]))

    return map_tensors(value, numbered)


tricky_values = st.recursive(st.just(torch.zeros(3)) | st.integers(-2, 2), _tricky_containers, max_leaves=12)


def _add_twins(value: Any) -> Any:
    """Beside each key k of a dict, the keys a "/"-joined name would confuse with it:
    ``str(k)`` for a non-str k, and ``f"{k}/{k2}"`` for each key k2 of a dict under k."""
    if isinstance(value, list):
        return [_add_twins(v) for v in value]
    if not isinstance(value, dict):
        return value
    twins: dict = {}
    for key, child in value.items():
        if not isinstance(key, str):
            twins[str(key)] = torch.zeros(3)
        if isinstance(child, dict):
            twins.update({f"{key}/{inner}": torch.zeros(3) for inner in child})
    result = {k: _add_twins(v) for k, v in value.items()}
    result.update({k: v for k, v in twins.items() if k not in result})
    return OrderedDict(result) if isinstance(value, OrderedDict) else result


@st.composite
def tricky_states(draw: Any) -> dict:
    """Nested state whose leaves would collide under "/"-joined names, each leaf its own value."""
    state = draw(st.dictionaries(tricky_keys, tricky_values, min_size=1, max_size=4))
    if draw(st.booleans()):
        state = _add_twins(state)
    return _number_leaves(state, [0])


nested_values = st.recursive(st.one_of(json_scalars, tensors(), arrays()), _containers, max_leaves=8)
states = st.dictionaries(st.text(min_size=1, max_size=6), nested_values, min_size=1, max_size=4)


def assert_same_state(expected: Any, actual: Any, path: str = "") -> None:
    """Equal structure, types and bit-identical arrays (NaN payloads included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.device.type == "cpu" and actual.is_contiguous(), path
        assert _tensor_bytes(actual) == _tensor_bytes(expected), path
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype, path
        assert actual.shape == expected.shape, path
        assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes(), path
    elif isinstance(expected, dict):
        assert type(actual) is type(expected), path
        assert [(type(k), k) for k in actual] == [(type(k), k) for k in expected], path
        for key in expected:
            assert_same_state(expected[key], actual[key], f"{path}/{key!r}")
        if getattr(expected, "_metadata", None) is not None:
            assert_same_state(expected._metadata, getattr(actual, "_metadata", None), f"{path}._metadata")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same_state(e, a, f"{path}/{i}")
    else:
        assert type(actual) is type(expected), path
        assert actual == expected or (actual != actual and expected != expected), path


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.numpy(force=True).tobytes()) if tensor.dtype in _NUMPY_OK else _via_uint8(tensor)


def _via_uint8(tensor: torch.Tensor) -> bytes:
    flat = tensor.reshape(-1).clone()
    if flat.numel() == 0:
        return b""
    fresh = torch.empty(flat.shape, dtype=flat.dtype)
    fresh.copy_(flat)
    return fresh.view(torch.uint8).numpy().tobytes()


_NUMPY_OK = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
             torch.int8, torch.uint8, torch.bool, torch.complex64}
