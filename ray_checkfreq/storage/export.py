"""Export a checkpoint as a ``.safetensors`` file (flattened key paths) or a ``.pt`` state dict.

Tensor names are the leaves' unique names from ``storage.tree`` (``"optimizer/state/0/exp_avg"``;
``/`` and ``%`` inside a key percent-encoded), so no two leaves share one; a leaf named
``__metadata__`` (safetensors' own entry) is written as ``%5F_metadata__``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ray_checkfreq import codec
from ray_checkfreq.storage.arrays import leaf_bytes
from ray_checkfreq.storage.history import trim_state
from ray_checkfreq.storage.tree import flatten_state

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    getattr(torch, "uint16", None): "U16", getattr(torch, "uint32", None): "U32",
    getattr(torch, "uint64", None): "U64",
    getattr(torch, "float8_e4m3fn", None): "F8_E4M3", getattr(torch, "float8_e5m2", None): "F8_E5M2",
    torch.complex64: "C64",
}


def export_checkpoint(store: Any, step: int | None, target: str, *, precision_factor: int | float | None = None,
                      precision_bits: int | None = None) -> str:
    """Write checkpoint ``step`` (None: newest valid) of ``store`` to ``target``.

    ``precision_factor`` / ``precision_bits`` (one or the other): floating tensors are
    trimmed near-lossless first (:mod:`ray_checkfreq.codec.nearlossless`), so the file
    compresses better; a .safetensors file records the setting in its metadata.
    """
    check_file_target(target)
    trim = {"precision_factor": precision_factor, "precision_bits": precision_bits}
    given = {k: v for k, v in trim.items() if v is not None}
    if given:  # a bad setting is refused before anything is read
        codec.trim(torch.zeros(1), precision_factor=precision_factor, precision_bits=precision_bits)
    setting = {f"ray_checkfreq.{k}": str(int(v)) for k, v in given.items()}
    state = store.load(step)
    if setting:
        state, _ = trim_state(state, precision_factor=precision_factor, precision_bits=precision_bits)
    if target.endswith(".safetensors"):
        write_safetensors(state, target, metadata={"step": str(step) if step is not None else "latest", **setting})
    else:
        torch.save(state, target)
    return target


def check_file_target(target: str) -> None:
    """Refuses, before the checkpoint is read, a target that is not FILE.safetensors /
    FILE.pt in an existing directory."""
    if not (target.endswith(".safetensors") or target.endswith(".pt")):
        raise ValueError(f"--to {target!r}: the file name must end in .safetensors or .pt")
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise ValueError(f"--to {target!r}: directory {directory!r} does not exist")


def _safetensors_name(name: str) -> str:
    return "%5F_metadata__" if name == "__metadata__" else name


def safetensors_dtype(dtype: torch.dtype, name: str) -> str:
    """The safetensors name of a torch dtype; refuses one it has no equivalent for, naming ``name``."""
    found = _SAFETENSORS_DTYPES.get(dtype)
    if found is None:
        raise ValueError(f"{name}: dtype {dtype} has no safetensors equivalent; export to .pt")
    return found


def write_safetensors(state: dict, path: str, *, metadata: dict[str, str] | None = None) -> None:
    """Tensors and numpy arrays under their key paths ("optimizer/state/0/exp_avg");
    the JSON-able rest of the state goes to the metadata entry ``ray_checkfreq.state``, whose
    leaf references ``{"tensor": i}`` name the tensor ``names[i]`` of ``ray_checkfreq.names``."""
    flat = flatten_state(state)
    entries: list[SafetensorsEntry] = []
    payload = []
    names = [_safetensors_name(name) for name in flat.key_paths]
    for key, leaf in zip(names, flat.leaves):
        tensor = torch.from_numpy(leaf) if not isinstance(leaf, torch.Tensor) else leaf
        data = leaf_bytes(tensor)
        entries.append(SafetensorsEntry(key, safetensors_dtype(tensor.dtype, key), tuple(tensor.shape), data.nbytes))
        payload.append(data)
    metadata = dict(metadata or {}, **{"ray_checkfreq.state": json.dumps(flat.skeleton),
                                       "ray_checkfreq.names": json.dumps(names)})
    write_safetensors_stream(path, entries, iter(payload), metadata=metadata)


@dataclass(frozen=True)
class SafetensorsEntry:
    name: str
    dtype: str  # safetensors' name ("F32")
    shape: tuple[int, ...]
    nbytes: int


def write_safetensors_stream(path: str, entries: list[SafetensorsEntry], payloads: Iterator[Any], *,
                             metadata: dict[str, str]) -> None:
    """A .safetensors file of ``entries``, whose bytes ``payloads`` yields one entry at a
    time (each of exactly the entry's ``nbytes``), so only one is held at once. Written
    to ``path.tmp``, made durable, then renamed over ``path``."""
    header: dict[str, Any] = {}
    offset = 0
    for entry in entries:
        if entry.name in header:  # names are unique by construction: this would lose a tensor
            raise ValueError(f"{entry.name}: two leaves of the state have this name")
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for entry in entries:
            data = next(payloads)
            if memoryview(data).nbytes != entry.nbytes:
                raise ValueError(f"{entry.name}: {memoryview(data).nbytes} bytes where {entry.nbytes} were announced")
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
