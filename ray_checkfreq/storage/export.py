"""Export a checkpoint as a ``.safetensors`` file, a ``.pt`` file or a PyTorch Distributed
Checkpoint (DCP) directory (``export_store``, what ``ray-checkfreq export`` runs).

A replicated checkpoint exports as its state (``export_checkpoint``): tensor names are the
leaves' unique names from ``storage.tree`` (``"optimizer/state/0/exp_avg"``; ``/`` and
``%`` inside a key percent-encoded), so no two leaves share one; a leaf named
``__metadata__`` (safetensors' own entry) is written as ``%5F_metadata__``. A sharded
checkpoint (and, as DCP, any checkpoint of format 3 and later) exports by its parts:

DCP: every stored chunk becomes one DCP chunk of its tensor (same offsets and sizes),
written with ``torch.save`` into ``__<rank>_0.distcp`` of the rank whose piece it is; the
``.metadata`` file (DCP's own pickled ``Metadata``) is written last, by rename, so a
directory without it is an unfinished export. One stored chunk is held at a time.
A tensor's DCP name (fqn) is its manifest key with the ``/`` between key-path parts made
``.`` and each part's percent-escapes undone (``"optim/state/0/exp_avg"`` ->
``"optim.state.0.exp_avg"``): DCP's own name for the same nested state dict. Each rank's
non-tensor state (its skeleton, JSON) is a bytes entry ``__ray_checkfreq__.skeleton.<rank>``
holding the JSON text.

Gathered: each tensor is read whole (ranged reads of its chunks, ``BoxReader``) and written
before the next is read, under its manifest key; the skeletons go to the safetensors
metadata entry ``ray_checkfreq.skeletons`` (JSON, by rank). A ``.pt`` file is one
``torch.save`` of ``{key: tensor}``, so it holds every tensor in memory at once.
"""

from __future__ import annotations

import json
import math
import os
import struct
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ray_checkfreq import codec
from ray_checkfreq.errors import CheckpointNotFoundError
from ray_checkfreq.storage.arrays import leaf_bytes, numpy_dtype, torch_dtype
from ray_checkfreq.storage.history import trim_leaf, trim_state
from ray_checkfreq.storage.manifest import PART_MANIFEST, ChunkRecord, GlobalManifest, TensorIndex
from ray_checkfreq.storage.names import parse_checkpoint_dir
from ray_checkfreq.storage.reader import BoxReader, full_box
from ray_checkfreq.storage.store import CheckpointRef, CheckpointStore
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


def export_checkpoint(store: CheckpointStore, step: int | None, target: str, *,
                      precision_factor: int | float | None = None, precision_bits: int | None = None) -> str:
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


SKELETON_FQN = "__ray_checkfreq__.skeleton.{rank}"
DCP_METADATA = ".metadata"


# ------------------------------------------------------------------ which checkpoint
def find_parted(store: CheckpointStore, step: int | None, *, replicated: bool = False) -> CheckpointRef | None:
    """The checkpoint to export by parts (a sharded one, or with ``replicated`` any of
    format 3 and later), or None when the one asked for is exported as its state (a
    replicated one).

    With ``step``: its newest complete checkpoint; an incomplete one (part manifests but
    no commit, or a file missing) is an error naming the store and step. Without: the
    newest complete checkpoint, if it is one of those.
    """
    refs = store.list()
    if step is not None:
        refs = [r for r in refs if r.step == step]
        if not refs and _has_parts(store, step):
            raise CheckpointNotFoundError(f"{store.uri}: the checkpoint of step {step} is incomplete "
                                          "(not committed, or a part or data file is missing or damaged)")
    if not refs:
        return None
    ref = refs[-1]
    if ref.placement == "sharded" or (replicated and ref.format_version >= 3):
        return ref
    return None


def _has_parts(store: CheckpointStore, step: int) -> bool:
    for name, files in store.backend.list_tree().items():
        parsed = parse_checkpoint_dir(name)
        if parsed is not None and parsed[0] == step and any(PART_MANIFEST.match(f) for f in files):
            return True
    return False


def as_torch(leaf: Any) -> torch.Tensor:
    """A CPU tensor of the leaf (a numpy leaf in native byte order; a torch leaf as it is)."""
    if isinstance(leaf, torch.Tensor):
        return leaf
    return torch.from_numpy(np.ascontiguousarray(leaf, dtype=leaf.dtype.newbyteorder("=")))


def export_torch_dtype(tensor: TensorIndex) -> torch.dtype:
    if tensor.kind == "torch":
        return torch_dtype(tensor.dtype)
    return as_torch(np.empty(0, numpy_dtype(tensor.dtype))).dtype


# ------------------------------------------------------------------ DCP
def dcp_fqn(key: str) -> str:
    """The DCP name of manifest key ``key``: its key-path parts, unescaped, joined by ``.``."""
    return ".".join(urllib.parse.unquote(part) for part in key.split("/"))


def export_dcp(store: CheckpointStore, ref: CheckpointRef, out_dir: str) -> str:
    """Write checkpoint ``ref`` as a DCP directory ``out_dir`` (new, or empty)."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    _prepare_out_dir(out_dir)
    reader = store.reader(ref)
    manifest = reader.manifest
    state_md, storage_data = _dcp_tensor_metadata(manifest)
    for rank, chunks in _chunks_by_rank(manifest).items():
        storage_data.update(_write_rank_file(reader, out_dir, rank, chunks))
    _write_skeletons(reader, out_dir, state_md, storage_data)
    metadata = Metadata(state_dict_metadata=state_md, storage_data=storage_data, version=CURRENT_DCP_VERSION,
                        storage_meta=StorageMeta(checkpoint_id=out_dir, save_id=uuid.uuid4().hex))
    _write_pickled_metadata(out_dir, metadata)
    return out_dir


def _prepare_out_dir(out_dir: str) -> None:
    if os.path.isdir(out_dir):
        if os.listdir(out_dir):
            raise ValueError(f"--to {out_dir!r}: directory is not empty (a DCP export writes a new directory)")
        return
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise ValueError(f"--to {out_dir!r}: directory {parent!r} does not exist")
    os.mkdir(out_dir)


def _dcp_tensor_metadata(manifest: GlobalManifest) -> tuple[dict[str, Any], dict[Any, Any]]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    state_md: dict[str, Any] = {}
    for tensor in manifest.tensors:
        fqn = dcp_fqn(tensor.key)
        if fqn in state_md:
            raise ValueError(f"tensors {tensor.key!r} and another one share the DCP name {fqn!r}")
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c.box.offsets), sizes=torch.Size(c.box.sizes))
                  for c in tensor.chunks if c.box.volume]
        state_md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=export_torch_dtype(tensor)),
                                              size=torch.Size(tensor.global_shape), chunks=chunks)
    return state_md, {}


def _chunks_by_rank(manifest: GlobalManifest) -> dict[int, list[tuple[TensorIndex, ChunkRecord]]]:
    by_rank: dict[int, list[tuple[TensorIndex, ChunkRecord]]] = {}
    for tensor in manifest.tensors:
        for chunk in tensor.chunks:
            if chunk.box.volume:  # an empty box has no element to load
                by_rank.setdefault(chunk.rank, []).append((tensor, chunk))
    return dict(sorted(by_rank.items()))


def _write_rank_file(reader: BoxReader, out_dir: str, rank: int,
                     chunks: list[tuple[TensorIndex, ChunkRecord]]) -> dict[Any, Any]:
    """``__<rank>_0.distcp``: each chunk read (checked) and ``torch.save``d in turn."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    relative = f"__{rank}_0.distcp"
    storage: dict[Any, Any] = {}
    with open(os.path.join(out_dir, relative), "wb") as f:
        for tensor, chunk in chunks:
            piece = as_torch(reader.load_boxes({tensor.key: [chunk.box]})[tensor.key][0])
            start = f.tell()
            torch.save(piece, f)
            index = MetadataIndex(fqn=dcp_fqn(tensor.key), offset=torch.Size(chunk.box.offsets))
            storage[index] = _StorageInfo(relative_path=relative, offset=start, length=f.tell() - start)
        _durable(f)
    return storage


def _write_skeletons(reader: BoxReader, out_dir: str, state_md: dict[str, Any], storage_data: dict[Any, Any]) -> None:
    """One bytes entry per rank: its skeleton's JSON text (``torch.save`` of a str)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    relative = "__skeletons_0.distcp"
    with open(os.path.join(out_dir, relative), "wb") as f:
        for part in reader.manifest.parts:
            for rank, skeleton in sorted(reader.skeletons(part.ranks).items()):
                fqn = SKELETON_FQN.format(rank=rank)
                if fqn in state_md:
                    raise ValueError(f"a tensor's DCP name {fqn!r} is the one of rank {rank}'s skeleton")
                start = f.tell()
                torch.save(json.dumps(skeleton), f)
                state_md[fqn] = BytesStorageMetadata()
                storage_data[MetadataIndex(fqn=fqn)] = _StorageInfo(relative_path=relative, offset=start,
                                                                    length=f.tell() - start)
        _durable(f)


def _write_pickled_metadata(out_dir: str, metadata: Any) -> None:
    """DCP's ``.metadata`` is a pickle by DCP's definition; we write it, never read one."""
    import pickle

    tmp = os.path.join(out_dir, f"{DCP_METADATA}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        _durable(f)
    os.replace(tmp, os.path.join(out_dir, DCP_METADATA))


def _durable(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


# ------------------------------------------------------------------ gathered
def export_gathered(store: CheckpointStore, ref: CheckpointRef, target: str, *,
                    precision_factor: int | float | None = None, precision_bits: int | None = None) -> str:
    """Write checkpoint ``ref`` with each tensor gathered whole, to .safetensors or .pt."""
    trim = {"precision_factor": precision_factor, "precision_bits": precision_bits}
    reader = store.reader(ref)
    manifest = reader.manifest
    tensors = _gathered(reader, manifest, trim)
    if target.endswith(".pt"):
        torch.save(dict(tensors), target)
        return target
    entries = [SafetensorsEntry(t.key if t.key != "__metadata__" else "%5F_metadata__",
                                safetensors_dtype(export_torch_dtype(t), t.key), t.global_shape,
                                _nbytes(t)) for t in manifest.tensors]
    setting = {f"ray_checkfreq.{k}": str(int(v)) for k, v in trim.items() if v is not None}
    metadata = {"step": str(ref.step), "ray_checkfreq.format": "sharded", **setting,
                "ray_checkfreq.skeletons": json.dumps(reader.skeletons(), sort_keys=True)}
    write_safetensors_stream(target, entries, (leaf_bytes(t) for _, t in tensors), metadata=metadata)
    return target


def _gathered(reader: BoxReader, manifest: GlobalManifest, trim: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor whole, in manifest order, read only when the previous one is consumed."""
    for tensor in manifest.tensors:
        value = as_torch(reader.load_boxes({tensor.key: [full_box(tensor)]})[tensor.key][0])
        if any(v is not None for v in trim.values()):
            value = trim_leaf(value, **trim)
        yield tensor.key, value


def _nbytes(tensor: TensorIndex) -> int:
    return math.prod(tensor.global_shape) * export_torch_dtype(tensor).itemsize


def export_store(store: CheckpointStore, step: int | None, target: str, *,
                 fmt: str | None = None, precision_factor: int | float | None = None,
                 precision_bits: int | None = None) -> str:
    """Export checkpoint ``step`` (None: the newest) of ``store``: a sharded one by its
    parts (``export_dcp``, ``export_gathered``), a replicated one as its state
    (``export_checkpoint``), any of format 3 and later by its parts as DCP. ``fmt``: "dcp",
    "safetensors", "pt" or None (from the name of ``target``). Every bad argument is
    refused before anything is read."""
    fmt = fmt or ("pt" if target.endswith(".pt") else "safetensors")
    if fmt not in ("dcp", "safetensors", "pt"):
        raise ValueError(f"--format {fmt!r}: expected dcp, safetensors or pt")
    if fmt != "dcp":
        check_file_target(target)
        if not target.endswith(f".{fmt}"):
            raise ValueError(f"--to {target!r}: --format {fmt} writes a .{fmt} file")
    if precision_factor is not None or precision_bits is not None:
        if fmt == "dcp":
            raise ValueError("--format dcp: near-lossless trimming (--precision-*) is for .safetensors / .pt only")
        codec.trim(torch.zeros(1), precision_factor=precision_factor, precision_bits=precision_bits)
    ref = find_parted(store, step, replicated=fmt == "dcp")
    if ref is not None and fmt == "dcp":
        return export_dcp(store, ref, target)
    if ref is not None:
        return export_gathered(store, ref, target, precision_factor=precision_factor, precision_bits=precision_bits)
    if fmt == "dcp":
        what = "the newest checkpoint" if step is None else f"step {step}"
        raise ValueError(f"{store.uri}: {what} is a format 1 or 2 checkpoint; --format dcp exports "
                         "checkpoints of format 3 and later")
    return export_checkpoint(store, step, target, precision_factor=precision_factor, precision_bits=precision_bits)


__all__ = ["dcp_fqn", "export_checkpoint", "export_dcp", "export_gathered", "export_store", "find_parted"]
