"""An in-memory storage backend in which every storage operation is a yield point.

It keeps the semantics the stores rely on, one step at a time, as a filesystem has them:
a listing is several operations (the directory read, then one stat per entry, through the
shared ``listing.sizes_of``), so files come and go between them; a write is a create and
then the bytes (a kill between leaves a short file); an exclusive create stages a
temporary file at the root and links it (fails if the name exists, or, with directories,
if the directory is gone); removing a directory unlinks what it listed, then removes the
directory only if it is empty. With ``directories=False`` it behaves as an object store:
no directories, a prefix exists while a key is under it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.chaos.commit_sim.scheduler import Scheduler
from ray_checkfreq.errors import StorageError
from ray_checkfreq.storage.backends import listing
from ray_checkfreq.storage.backends.base import Backend, uninitialized_buffer


@dataclass
class SimFile:
    data: bytes
    creator: str
    created_at: int


class SimBackend(Backend):
    max_parallel_writes = 1
    atomic_exclusive_create = True

    def __init__(self, scheduler: Scheduler, *, directories: bool = True,
                 on_delete: Callable[[str, SimFile, str], None] | None = None) -> None:
        self.scheduler = scheduler
        self.directories = directories
        self.root_uri = "sim://store"
        self.dirs: dict[str, dict[str, SimFile]] = {}
        self.root_files: dict[str, SimFile] = {}
        self._on_delete = on_delete

    # ------------------------------------------------------------ plumbing
    def _step(self, label: str) -> None:
        self.scheduler.yield_point(label)

    def _who(self) -> str:
        actor = self.scheduler.current
        return actor.name if actor is not None else "driver"

    @staticmethod
    def _split(rel_path: str) -> tuple[str, str]:
        parent, _, name = rel_path.rpartition("/")
        if "/" in parent:
            raise StorageError(rel_path, "the simulated store holds one level of directories")
        return parent, name

    def _folder(self, parent: str, *, create: bool = False) -> dict[str, SimFile] | None:
        if not parent:
            return self.root_files
        folder = self.dirs.get(parent)
        if folder is None and create:
            folder = self.dirs.setdefault(parent, {})
        return folder

    def _folder_to_write(self, parent: str) -> dict[str, SimFile] | None:
        """Where a new file goes: its directory if it exists; an object store's prefix always."""
        return self._folder(parent, create=not self.directories)

    def _new_file(self, folder: dict[str, SimFile], name: str, data: bytes, parent: str) -> None:
        folder[name] = SimFile(bytes(data), self._who(), self.scheduler.tick)
        actor = self.scheduler.current
        if actor is not None:
            actor.files.add(f"{parent}/{name}" if parent else name)

    def _drop(self, parent: str, name: str) -> None:
        folder = self._folder(parent)
        if folder is None or name not in folder:
            return
        gone = folder.pop(name)
        if not self.directories and parent and not folder:
            self.dirs.pop(parent, None)  # an object store's prefix exists only while a key is under it
        if self._on_delete is not None:
            self._on_delete(f"{parent}/{name}" if parent else name, gone, self._who())

    # ------------------------------------------------------------ listing
    def list_dirs(self) -> list[str]:
        self._step("readdir /")
        return listing.store_dirs(sorted(self.dirs))

    def list_files(self, rel_dir: str) -> dict[str, int]:
        self._step(f"readdir {rel_dir}")
        folder = self._folder(rel_dir)
        if folder is None:
            return {}
        names = sorted(folder)

        def size_of(name: str) -> int:
            self._step(f"stat {rel_dir}/{name}")
            current = self._folder(rel_dir)
            if current is None or name not in current:
                raise FileNotFoundError(f"{rel_dir}/{name}")
            return len(current[name].data)

        return listing.sizes_of(names, size_of)

    def stat_size(self, rel_path: str) -> int | None:
        self._step(f"stat {rel_path}")
        parent, name = self._split(rel_path)
        folder = self._folder(parent)
        return len(folder[name].data) if folder is not None and name in folder else None

    def exists(self, rel_path: str) -> bool:
        return self.stat_size(rel_path) is not None

    # ------------------------------------------------------------ writing
    def make_dir(self, rel_dir: str) -> None:
        self._step(f"mkdir {rel_dir}")
        if not self.directories:
            return
        if rel_dir in self.dirs:
            raise StorageError(rel_dir, "cannot create directory: File exists")
        self.dirs[rel_dir] = {}

    def write(self, rel_path: str, chunks: Sequence[Any]) -> None:
        parent, name = self._split(rel_path)
        self._step(f"create {rel_path}")
        folder = self._folder_to_write(parent)
        if folder is None:
            raise StorageError(rel_path, "write failed: No such file or directory")
        if name in folder:
            raise StorageError(rel_path, "write failed: File exists")
        self._new_file(folder, name, b"", parent)
        self._step(f"write {rel_path}")
        data = b"".join(bytes(memoryview(chunk).cast("B")) for chunk in chunks)
        current = self._folder(parent)
        if current is not None and name in current:
            current[name].data = data

    def write_atomic(self, rel_path: str, data: bytes) -> None:
        parent, name = self._split(rel_path)
        staged = self._stage(data)
        self._step(f"rename {staged} {rel_path}")
        folder = self._folder(parent, create=True)
        assert folder is not None
        self.root_files.pop(staged, None)
        self._new_file(folder, name, data, parent)

    def create_exclusive(self, rel_path: str, data: bytes, *, make_parents: bool = False) -> bool:
        parent, name = self._split(rel_path)
        staged = self._stage(data)
        self._step(f"link {staged} {rel_path}")
        folder = self._folder(parent, create=True) if make_parents else self._folder_to_write(parent)
        try:
            if folder is None:
                raise StorageError(rel_path, "commit failed: No such file or directory")
            if name in folder:
                return False
            self._new_file(folder, name, data, parent)
            return True
        finally:
            self._step(f"unlink {staged}")
            self.root_files.pop(staged, None)

    def _stage(self, data: bytes) -> str:
        staged = listing.staging_name()
        self._step(f"stage {staged}")
        self._new_file(self.root_files, staged, data, "")
        return staged

    # ------------------------------------------------------------ reading
    def read(self, rel_path: str) -> Any:
        self._step(f"read {rel_path}")
        parent, name = self._split(rel_path)
        folder = self._folder(parent)
        if folder is None or name not in folder:
            raise FileNotFoundError(rel_path)
        data = folder[name].data
        buffer = uninitialized_buffer(len(data))
        buffer[:] = memoryview(data)
        return buffer

    def read_range(self, rel_path: str, offset: int, length: int) -> Any:
        return self.read(rel_path)[offset:offset + length]

    def read_small(self, rel_path: str) -> bytes:
        return bytes(self.read(rel_path))

    # ------------------------------------------------------------ removing
    def delete_file(self, rel_path: str) -> None:
        self._step(f"unlink {rel_path}")
        self._drop(*self._split(rel_path))

    def delete_dir(self, rel_dir: str) -> None:
        self._step(f"readdir {rel_dir} (remove)")
        folder = self._folder(rel_dir)
        for name in sorted(folder or {}):
            self._step(f"unlink {rel_dir}/{name}")
            self._drop(rel_dir, name)
        if self.directories:
            self._step(f"rmdir {rel_dir}")
            if not self.dirs.get(rel_dir, {"": None}):
                self.dirs.pop(rel_dir, None)

    def clean_staging(self, older_than_s: float) -> None:
        # One scheduler tick stands for one second of the run.
        cutoff = self.scheduler.tick - older_than_s
        for name in sorted(self.root_files):
            if listing.is_staged(name) and self.root_files[name].created_at < cutoff:
                self._step(f"unlink {name}")
                self.root_files.pop(name, None)

    # ------------------------------------------------------------ for the checks
    def snapshot(self) -> dict[str, dict[str, bytes]]:
        """Every directory's files as they are now (no yield: the driver looks)."""
        return {d: {n: f.data for n, f in files.items()} for d, files in self.dirs.items()}
