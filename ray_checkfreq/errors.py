"""Exceptions shared by every layer.

Every exception keeps its constructor arguments in ``args`` so that it pickles and
can cross a Ray actor boundary unchanged.
"""

from __future__ import annotations


class CheckFreqError(Exception):
    """Base class of every error raised by ray_checkfreq."""


class UnsupportedStateError(CheckFreqError, TypeError):
    """A value in the state to checkpoint cannot be stored; names its key path."""

    def __init__(self, key_path: str, reason: str) -> None:
        super().__init__(key_path, reason)
        self.key_path = key_path
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot checkpoint state at {self.key_path!r}: {self.reason}"


class LocatedError(CheckFreqError):
    """An error about one file, object or bucket: ``"<location>: <reason>"``."""

    def __init__(self, location: str, reason: str) -> None:
        super().__init__(location, reason)
        self.location = location
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


class CorruptCheckpointError(LocatedError):
    """A stored checkpoint failed verification; names the file and the fault."""


class CheckpointNotFoundError(CheckFreqError, LookupError):
    """No committed checkpoint matches the request."""


class StorageError(LocatedError):
    """Storage refused an operation (missing bucket, bad credentials, full disk, ...)."""


class FencedWriterError(StorageError):
    """A save from a writer generation that a newer writer on the same URI has superseded.

    Nothing of that save is committed. ``args`` is ``(location, writer_generation,
    newer_generation)`` so that it pickles unchanged.
    """

    def __init__(self, location: str, writer_generation: int, newer_generation: int) -> None:
        super().__init__(
            location,
            f"writer generation {writer_generation} is fenced: generation {newer_generation} "
            "has taken over this URI (another process saves here now); nothing was committed",
        )
        self.args = (location, writer_generation, newer_generation)
        self.writer_generation = writer_generation
        self.newer_generation = newer_generation
