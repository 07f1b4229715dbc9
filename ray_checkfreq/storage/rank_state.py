"""A rank's state in a sharded checkpoint: the skeleton document its part holds, and the
whole state gathered in one process.

The skeleton of rank ``r`` (written by the engine's sharded mode) is
``{"format": 1, "tree": <the flatten_state skeleton of its whole snapshot>, "leaves":
[{"key": ..., "rank": <a per-rank leaf>}, ...]}``: leaf ``i`` of the tree is stored under
``leaves[i].key``, a model or optimizer tensor under its own name (its chunks in every
part), a per-rank leaf (RNG, extra and data state) under ``rank/<r>/<name>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray_checkfreq.errors import CorruptCheckpointError
from ray_checkfreq.storage.chunks import Box, whole
from ray_checkfreq.storage.reader import BoxReader
from ray_checkfreq.storage.tree import SkeletonError, skeleton_leaf_refs, unflatten_state

SKELETON_FORMAT = 1


def parse_rank_skeleton(document: Any, where: str) -> tuple[Any, list[str], set[str]]:
    """(tree, key of each leaf, the per-rank keys) of a rank's skeleton document;
    CorruptCheckpointError naming ``where`` when it is not one."""
    if not isinstance(document, Mapping) or document.get("format") != SKELETON_FORMAT \
            or not isinstance(document.get("leaves"), list):
        raise CorruptCheckpointError(where, f"not a skeleton of format {SKELETON_FORMAT} (the engine's sharded mode)")
    leaves = document["leaves"]
    if not all(isinstance(e, Mapping) and isinstance(e.get("key"), str) and isinstance(e.get("rank"), bool)
               for e in leaves):
        raise CorruptCheckpointError(where, "skeleton leaves: expected {'key': str, 'rank': bool} entries")
    try:
        refs = skeleton_leaf_refs(document.get("tree"))
    except SkeletonError as err:
        raise CorruptCheckpointError(where, f"skeleton: {err}") from None
    if sorted(index for _, index in refs) != list(range(len(leaves))):
        raise CorruptCheckpointError(where, f"skeleton: {len(refs)} leaf references for {len(leaves)} leaves")
    return document["tree"], [e["key"] for e in leaves], {e["key"] for e in leaves if e["rank"]}


def gathered_state(reader: BoxReader, where: str) -> dict[str, Any]:
    """The whole state of a sharded checkpoint in this process, as ``CheckpointStore.load``
    gives a replica's: every model and optimizer tensor gathered whole (ranged reads of its
    chunks), RNG, extra and data state as rank 0 saved them. It holds the whole state in
    memory. A checkpoint that ``save_part`` wrote with skeletons of the caller's own (not
    the engine's) comes as saved: ``{"tensors": {key: whole tensor}, "skeletons": {rank: ...}}``."""
    document = reader.skeletons([0])[0]
    if not isinstance(document, Mapping) or "format" not in document:
        return _as_saved(reader)
    tree, keys, _ = parse_rank_skeleton(document, where)
    wanted: dict[str, list[Box]] = {}
    for key in dict.fromkeys(keys):
        tensor = reader.manifest.tensor(key)
        if tensor is None:
            raise CorruptCheckpointError(where, f"the skeleton names tensor {key!r}, which no part holds")
        wanted[key] = [whole(tensor.global_shape)]
    loaded = reader.load_boxes(wanted)
    try:
        return unflatten_state(tree, [loaded[key][0] for key in keys])
    except SkeletonError as err:
        raise CorruptCheckpointError(where, f"skeleton: {err}") from None


def _as_saved(reader: BoxReader) -> dict[str, Any]:
    """Every tensor whole under its key, and each rank's skeleton as its part holds it."""
    loaded = reader.load_boxes({t.key: [whole(t.global_shape)] for t in reader.manifest.tensors})
    return {"tensors": {key: boxes[0] for key, boxes in loaded.items()}, "skeletons": reader.skeletons()}
