"""Checkpoint format and storage (layer 2): manifest, shards, commit, retention."""

from ray_checkfreq.storage.backends import S3Options
from ray_checkfreq.storage.history import HistoryTrim
from ray_checkfreq.storage.store import CheckpointRef, CheckpointStore, StoreConfig

__all__ = ["CheckpointRef", "CheckpointStore", "HistoryTrim", "S3Options", "StoreConfig"]
