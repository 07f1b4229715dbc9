"""ray_checkfreq: fine-grained, crash-consistent checkpointing for PyTorch on Ray Train.

The public API is what this module lists in ``__all__``; everything else is internal.
"""

from ray_checkfreq.engine import CheckFreq, CheckFreqConfig, PersistError, RestoreMismatchError
from ray_checkfreq.errors import (
    CheckFreqError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedWriterError,
    StorageError,
    UnsupportedStateError,
)
from ray_checkfreq.storage import CheckpointRef, CheckpointStore, S3Options

__version__ = "0.1.0"

__all__ = [
    "CheckFreq",
    "CheckFreqConfig",
    "CheckFreqError",
    "CheckpointNotFoundError",
    "CheckpointRef",
    "CheckpointStore",
    "CorruptCheckpointError",
    "FencedWriterError",
    "PersistError",
    "RestoreMismatchError",
    "S3Options",
    "StorageError",
    "UnsupportedStateError",
]
