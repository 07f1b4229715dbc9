"""Writes a format 1 checkpoint (raw leaves, one shard) the way stores did before the
one-format change: for tests of how today's reader takes such checkpoints in."""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

from ray_checkfreq.storage.arrays import leaf_bytes, leaf_spec
from ray_checkfreq.storage.canonical_json import dumps_indented
from ray_checkfreq.storage.legacy import FORMAT_VERSION, FORMAT_VERSION_TRIMMED, Manifest, ShardEntry, TensorEntry
from ray_checkfreq.storage.manifest import CHECKSUM_ALGORITHM, FORMAT_NAME, MANIFEST_NAME, body_checksum
from ray_checkfreq.storage.tree import FlatState, flatten_state

SHARD = "shard-00000.bin"


def write_format_1(directory: str, step: int, state: Any, *, writer_generation: int = 0,
                   flat: FlatState | None = None) -> str:
    """Checkpoint directory ``directory`` (new) holding ``state`` as format 1."""
    flat = flat or flatten_state(state)
    os.makedirs(directory)
    entries, payload = [], bytearray()
    for key, leaf in zip(flat.key_paths, flat.leaves):
        data = bytes(leaf_bytes(leaf))
        crc = zlib.crc32(data)
        entries.append(TensorEntry(key=key, spec=leaf_spec(leaf), codec="raw", shard=SHARD, offset=len(payload),
                                   length=len(data), stored_crc32=crc, raw_crc32=crc))
        payload += data
    with open(os.path.join(directory, SHARD), "wb") as f:
        f.write(payload)
    manifest = Manifest(step=step, epoch_boundary=False, created_unix_ns=time.time_ns(),
                        shards=(ShardEntry(SHARD, len(payload)),), tensors=tuple(entries), state=flat.skeleton,
                        writer_generation=writer_generation)
    with open(os.path.join(directory, MANIFEST_NAME), "wb") as f:
        f.write(encode_manifest(manifest))
    return directory


# ------------------------------------------------------------------ the format 1-2 manifest, as it was written
def encode_manifest(manifest: Manifest) -> bytes:
    body = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION if manifest.history_trim is None else FORMAT_VERSION_TRIMMED,
        "step": manifest.step,
        "epoch_boundary": manifest.epoch_boundary,
        "created_unix_ns": manifest.created_unix_ns,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "meta": manifest.meta,
        "delta_base": manifest.delta_base,
        "writer_generation": manifest.writer_generation,
        "shards": [{"name": s.name, "size_bytes": s.size_bytes} for s in manifest.shards],
        "tensors": [_tensor_json(t) for t in manifest.tensors],
        "state": manifest.state,
    }
    if manifest.history_trim is not None:
        body["history_trim"] = manifest.history_trim
    body["manifest_crc32"] = body_checksum(body)
    return dumps_indented(body)


def _tensor_json(entry: TensorEntry) -> dict:
    return {
        "key": entry.key,
        "kind": entry.spec.kind,
        "dtype": entry.spec.dtype,
        "shape": list(entry.spec.shape),
        "codec": entry.codec,
        "shard": entry.shard,
        "offset": entry.offset,
        "length": entry.length,
        "stored_crc32": entry.stored_crc32,
        "raw_crc32": entry.raw_crc32,
        "delta": entry.delta,
    }
