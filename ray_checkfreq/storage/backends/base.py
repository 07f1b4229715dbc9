"""The storage plugin interface: a handful of file operations under one root.

Paths are relative to the root and use "/". A backend translates its own failures
into ``StorageError`` naming the file, and promises durability where it says so:
``write`` returns only once the bytes are durable (fsync / completed upload), and
``write_atomic`` makes a whole small file appear at once or not at all.

Listings keep the contract of ``listing.py``: complete as of some moment, a file that
vanishes while listed is skipped (never the whole listing), ``{}`` only for a directory
that is not there, and no temporary file inside a listed directory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class Backend(ABC):
    root_uri: str
    # At most this many shard files written at once (None: the store's io_threads).
    max_parallel_writes: int | None = None
    # Whether ``create_exclusive`` is one atomic conditional create (a link, a conditional
    # PUT); False where it is a check followed by a write, a race between writers.
    atomic_exclusive_create: bool = False

    def uri(self, rel: str) -> str:
        return f"{self.root_uri.rstrip('/')}/{rel}" if rel else self.root_uri

    @abstractmethod
    def list_dirs(self) -> list[str]:
        """Names of the directories (prefixes) directly under the root, the staging area
        excepted."""

    @abstractmethod
    def list_files(self, rel_dir: str) -> dict[str, int]:
        """``{name: size_bytes}`` of the files directly in ``rel_dir``: complete as of some
        moment; a file that vanishes meanwhile is skipped; {} only if ``rel_dir`` holds no
        file or does not exist (``listing.py``)."""

    def list_tree(self) -> dict[str, dict[str, int]]:
        """``{dir: {name: size_bytes}}`` for every directory directly under the root, each
        listed under the contract of ``list_files`` (a directory removed meanwhile: {})."""
        return {name: self.list_files(name) for name in self.list_dirs()}

    def stat_size(self, rel_path: str) -> int | None:
        """The size of the file ``rel_path`` asked of the storage directly (a stat, a HEAD),
        not through a listing; None if it is not there."""
        parent, _, name = rel_path.rpartition("/")
        return self.list_files(parent).get(name)

    def clean_staging(self, older_than_s: float) -> None:
        """Remove staged temporary files older than ``older_than_s`` (a writer killed
        between staging and linking left them); backends that stage nothing do nothing."""
        return None

    @abstractmethod
    def make_dir(self, rel_dir: str) -> None:
        """Create ``rel_dir`` (durably where directories exist)."""

    @abstractmethod
    def write(self, rel_path: str, chunks: Sequence[Any]) -> None:
        """Create a new file holding the concatenated chunks; durable on return."""

    @abstractmethod
    def write_atomic(self, rel_path: str, data: bytes) -> None:
        """Make ``data`` appear at ``rel_path`` in one step; durable on return."""

    def create_exclusive(self, rel_path: str, data: bytes, *, make_parents: bool = False) -> bool:
        """Make ``data`` appear at ``rel_path`` in one step unless something is there already.

        Durable on return. False, and nothing written, when ``rel_path`` exists. The parent
        directory must exist unless ``make_parents``. This default checks, then writes: a
        race between writers; backends with a conditional create override it.
        """
        if self.exists(rel_path):
            return False
        self.write_atomic(rel_path, data)
        return True

    def exists(self, rel_path: str) -> bool:
        """Whether the file ``rel_path`` exists."""
        try:
            self.read(rel_path)
        except FileNotFoundError:
            return False
        return True

    def root_exists(self) -> bool:
        """Whether the root is there to read (an empty S3 prefix counts as there)."""
        return True

    @abstractmethod
    def read(self, rel_path: str) -> Any:
        """The whole file, in a writable buffer (see ``uninitialized_buffer``)."""

    def read_range(self, rel_path: str, offset: int, length: int) -> Any:
        """``length`` bytes of a file from ``offset``, in a writable buffer; fewer where the
        file ends first (the caller checks). This default reads the whole file; backends
        override it with a ranged read."""
        return self.read(rel_path)[offset:offset + length]

    def read_small(self, rel_path: str) -> bytes:
        """A small file (a manifest) whole; backends may save round trips here."""
        return bytes(self.read(rel_path))

    @abstractmethod
    def delete_dir(self, rel_dir: str) -> None:
        """Remove a directory and everything in it; no error if it is gone."""

    @abstractmethod
    def delete_file(self, rel_path: str) -> None:
        """Remove one file; no error if it is gone."""

    def close(self) -> None:
        """Release connections; the default has none."""
        return None


def uninitialized_buffer(size: int) -> Any:
    """A writable byte buffer without the zero-fill pass a bytearray costs."""
    import numpy as np

    return np.empty(size, dtype=np.uint8)
