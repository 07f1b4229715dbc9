"""Raw byte views of array leaves and their inverse, for torch and numpy.

``leaf_bytes`` gives the little-endian-as-stored bytes of a leaf without copying when
the leaf is already a contiguous CPU tensor; ``leaf_from_buffer`` rebuilds it as a view
of the buffer it was read into (no copy), contiguous, on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.complex128, torch.complex64, torch.complex32,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        getattr(torch, "uint16", None), getattr(torch, "uint32", None),
        getattr(torch, "uint64", None),
        getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None),
        getattr(torch, "float8_e8m0fnu", None),
    )
    if dtype is not None
}


@dataclass(frozen=True)
class LeafSpec:
    """What the manifest records about a leaf to rebuild it."""

    kind: str  # "torch" or "numpy"
    dtype: str  # torch dtype name ("bfloat16") or numpy dtype str ("<f4")
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize  # Python ints: no overflow

    @property
    def itemsize(self) -> int:
        if self.kind == "torch":
            return torch_dtype(self.dtype).itemsize
        return numpy_dtype(self.dtype).itemsize


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown torch dtype {name!r}") from None


def numpy_dtype(name: str) -> np.dtype:
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ValueError(f"unknown numpy dtype {name!r}") from None
    if dtype.kind not in "biufc" or dtype.fields is not None:
        raise ValueError(f"numpy dtype {name!r} is not a plain numeric dtype")
    return dtype


def leaf_spec(leaf: Any) -> LeafSpec:
    if isinstance(leaf, torch.Tensor):
        name = str(leaf.dtype).removeprefix("torch.")
        torch_dtype(name)
        return LeafSpec(kind="torch", dtype=name, shape=tuple(leaf.shape))
    return LeafSpec(kind="numpy", dtype=leaf.dtype.str, shape=tuple(leaf.shape))


def leaf_bytes(leaf: Any) -> memoryview:
    """A flat byte view of the leaf's elements in C order (copies only if needed)."""
    if isinstance(leaf, torch.Tensor):
        tensor = leaf.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
        if tensor.numel() == 0:
            return memoryview(b"")
        if tensor.stride(0) != 1:  # a one-element "contiguous" tensor may keep any stride
            tensor = tensor.as_strided((tensor.numel(),), (1,))
        return tensor.view(torch.uint8).numpy().data.cast("B")
    array = np.ascontiguousarray(leaf)
    return array.reshape(-1).view(np.uint8).data.cast("B")


def leaf_from_buffer(spec: LeafSpec, buffer: Any, offset: int) -> Any:
    """View ``spec.nbytes`` bytes of a writable buffer at ``offset`` as the leaf.

    ``offset`` must be a multiple of the item size (shards align every leaf).
    """
    if spec.kind == "torch":
        dtype = torch_dtype(spec.dtype)
        if spec.nbytes == 0:
            return torch.empty(spec.shape, dtype=dtype)
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=spec.nbytes, offset=offset)
        return raw.view(dtype).reshape(spec.shape)
    array_dtype = numpy_dtype(spec.dtype)
    count = math.prod(spec.shape)
    return np.frombuffer(buffer, dtype=array_dtype, count=count, offset=offset).reshape(spec.shape)
