"""Checkpoint format and storage (layer 2): manifest, shards, commit, retention."""

from ray_checkfreq.storage.backends import S3Options
from ray_checkfreq.storage.store import CheckpointRef, CheckpointStore, StoreConfig

__all__ = ["CheckpointRef", "CheckpointStore", "S3Options", "StoreConfig"]
