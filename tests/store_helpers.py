"""The one CheckpointStore as the part-level tests use it: a writer of sharded parts."""

from __future__ import annotations

from typing import Any

from ray_checkfreq.storage.store import CheckpointStore


def part_store(uri: str, **kwargs: Any) -> CheckpointStore:
    """A store with the defaults these tests were written for: raw parts, no deltas
    (``codec`` and ``full_every`` given override them)."""
    kwargs.setdefault("codec", "raw")
    kwargs.setdefault("full_every", 1)
    return CheckpointStore(uri, **kwargs)


def newest_sharded(store: CheckpointStore) -> Any:
    """The newest complete sharded checkpoint (None when there is none)."""
    refs = store.list(placement="sharded")
    return refs[-1] if refs else None
