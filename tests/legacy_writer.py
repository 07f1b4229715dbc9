"""Writes a format 1 checkpoint (raw leaves, one shard) the way stores did before the
one-format change: for tests of how today's reader takes such checkpoints in."""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

from ray_checkfreq.storage.arrays import leaf_bytes, leaf_spec
from ray_checkfreq.storage.manifest import MANIFEST_NAME, Manifest, ShardEntry, TensorEntry, encode_manifest
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
