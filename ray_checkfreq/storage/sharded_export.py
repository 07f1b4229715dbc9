"""Export a sharded (format 3) checkpoint: as a PyTorch Distributed Checkpoint (DCP)
directory, or gathered into one full tensor per key (.safetensors / .pt).

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
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ray_checkfreq import codec
from ray_checkfreq.errors import CheckpointNotFoundError
from ray_checkfreq.storage.arrays import leaf_bytes, numpy_dtype, torch_dtype
from ray_checkfreq.storage.export import (
    SafetensorsEntry,
    check_file_target,
    export_checkpoint,
    safetensors_dtype,
    write_safetensors_stream,
)
from ray_checkfreq.storage.history import trim_leaf
from ray_checkfreq.storage.names import parse_checkpoint_dir
from ray_checkfreq.storage.sharded_load import BoxReader, full_box
from ray_checkfreq.storage.sharded_manifest import PART_MANIFEST, ChunkRecord, ShardedManifest, TensorIndex
from ray_checkfreq.storage.store import CheckpointRef, CheckpointStore

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


def _dcp_tensor_metadata(manifest: ShardedManifest) -> tuple[dict[str, Any], dict[Any, Any]]:
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


def _chunks_by_rank(manifest: ShardedManifest) -> dict[int, list[tuple[TensorIndex, ChunkRecord]]]:
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


def _gathered(reader: BoxReader, manifest: ShardedManifest, trim: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
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
    """Export checkpoint ``step`` (None: the newest) of the root both stores open, in the
    format of what the root holds: a sharded (format 3) checkpoint by ``export_sharded``,
    a format 1/2 one by ``export.export_checkpoint``. ``fmt``: "dcp", "safetensors", "pt"
    or None (from the name of ``target``)."""
    fmt = fmt or ("pt" if target.endswith(".pt") else "safetensors")
    if fmt not in ("dcp", "safetensors", "pt"):
        raise ValueError(f"--format {fmt!r}: expected dcp, safetensors or pt")
    if fmt != "dcp":
        check_file_target(target)
        if not target.endswith(f".{fmt}"):
            raise ValueError(f"--to {target!r}: --format {fmt} writes a .{fmt} file")
    if precision_factor is not None or precision_bits is not None:  # refused before anything is read
        if fmt == "dcp":
            raise ValueError("--format dcp: near-lossless trimming (--precision-*) is for .safetensors / .pt only")
        codec.trim(torch.zeros(1), precision_factor=precision_factor, precision_bits=precision_bits)
    ref = find_parted(store, step, replicated=fmt == "dcp")
    if ref is not None:
        return export_sharded(store, ref, target, fmt=fmt, precision_factor=precision_factor,
                              precision_bits=precision_bits)
    if fmt == "dcp":
        what = "the newest checkpoint" if step is None else f"step {step}"
        raise ValueError(f"{store.uri}: {what} is a format 1 or 2 checkpoint; --format dcp exports "
                         "checkpoints of format 3 and later")
    return export_checkpoint(store, step, target, precision_factor=precision_factor, precision_bits=precision_bits)


def export_sharded(store: CheckpointStore, ref: CheckpointRef, target: str, *, fmt: str,
                   precision_factor: int | float | None = None, precision_bits: int | None = None) -> str:
    """``fmt``: "dcp" (``target`` a directory), "safetensors" or "pt"."""
    if fmt == "dcp":
        if precision_factor is not None or precision_bits is not None:
            raise ValueError("--format dcp: near-lossless trimming (--precision-*) is for .safetensors / .pt only")
        return export_dcp(store, ref, target)
    if precision_factor is not None or precision_bits is not None:  # refused before anything is read
        codec.trim(torch.zeros(1), precision_factor=precision_factor, precision_bits=precision_bits)
    return export_gathered(store, ref, target, precision_factor=precision_factor, precision_bits=precision_bits)


__all__ = ["dcp_fqn", "export_dcp", "export_gathered", "export_sharded", "export_store", "find_parted"]
