"""Any pyarrow.fs filesystem (``gs://``, ``hdfs://``, an ``S3FileSystem`` you built).

Object stores (S3, GCS) make an object visible only when its upload completes, so the
manifest is written in place; other filesystems get a temporary name and a move.
Durability is what the filesystem promises once an output stream is closed: a completed
upload on S3 and GCS, the block pipeline's acknowledgement on HDFS. A local
``pyarrow.fs.LocalFileSystem`` never gets here: ``open_backend`` hands it to the POSIX
backend, which fsyncs. pyarrow has no conditional create, so ``create_exclusive`` is the
base class's check-then-write (``atomic_exclusive_create`` is False): the sharded store
then lets only the writer of rank 0 create a step's global manifest. Temporary names (for
the move of filesystems that are not object stores) are staged at the root
(``listing.staging_name``), outside every step directory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ray_checkfreq.errors import StorageError
from ray_checkfreq.storage.backends.base import Backend, uninitialized_buffer
from ray_checkfreq.storage.backends.listing import is_staged, staging_name, store_dirs

# A listing that fails because an entry vanished under it is taken again, at most this often.
_LISTING_ATTEMPTS = 5

_OBJECT_STORES = frozenset({"s3", "gcs"})


class ArrowBackend(Backend):
    def __init__(self, filesystem: Any, root: str, root_uri: str | None = None) -> None:
        self.fs = filesystem
        self.root = root.rstrip("/")
        self.root_uri = root_uri or f"{filesystem.type_name}://{self.root}"

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _infos(self, rel_dir: str) -> list:
        from pyarrow import fs as pafs

        selector = pafs.FileSelector(self._path(rel_dir), allow_not_found=True, recursive=False)
        for attempt in range(_LISTING_ATTEMPTS):
            try:
                return self.fs.get_file_info(selector)
            except FileNotFoundError:
                # pyarrow stats every entry it reads: one that vanished fails the whole call.
                if attempt + 1 == _LISTING_ATTEMPTS:
                    raise StorageError(self.uri(rel_dir), "cannot list: entries kept vanishing") from None
            except OSError as err:
                raise StorageError(self.uri(rel_dir), f"cannot list: {err}") from err
        return []

    def list_dirs(self) -> list[str]:
        from pyarrow import fs as pafs

        return store_dirs(i.base_name for i in self._infos("") if i.type == pafs.FileType.Directory)

    def stat_size(self, rel_path: str) -> int | None:
        from pyarrow import fs as pafs

        try:
            info = self.fs.get_file_info(self._path(rel_path))
        except OSError as err:
            raise StorageError(self.uri(rel_path), f"cannot stat: {err}") from err
        return info.size if info.type == pafs.FileType.File else None

    def list_files(self, rel_dir: str) -> dict[str, int]:
        from pyarrow import fs as pafs

        return {i.base_name: i.size for i in self._infos(rel_dir) if i.type == pafs.FileType.File}

    def clean_staging(self, older_than_s: float) -> None:
        from pyarrow import fs as pafs

        cutoff = time.time() - older_than_s
        for info in self._infos(""):
            if is_staged(info.base_name) and info.type == pafs.FileType.File and info.mtime is not None \
                    and info.mtime.timestamp() < cutoff:
                self._delete_quietly(info.base_name)

    def _type(self, rel: str) -> Any:
        try:
            return self.fs.get_file_info(self._path(rel)).type
        except OSError as err:
            raise StorageError(self.uri(rel), f"cannot stat: {err}") from err

    def exists(self, rel_path: str) -> bool:
        from pyarrow import fs as pafs

        return self._type(rel_path) == pafs.FileType.File

    def root_exists(self) -> bool:
        from pyarrow import fs as pafs

        return self._type("") != pafs.FileType.NotFound or self.fs.type_name in _OBJECT_STORES

    def create_exclusive(self, rel_path: str, data: bytes, *, make_parents: bool = False) -> bool:
        if make_parents and "/" in rel_path:
            self.make_dir(rel_path.rsplit("/", 1)[0])
        return super().create_exclusive(rel_path, data)

    def make_dir(self, rel_dir: str) -> None:
        try:
            self.fs.create_dir(self._path(rel_dir), recursive=True)
        except OSError as err:
            raise StorageError(self.uri(rel_dir), f"cannot create directory: {err}") from err

    def write(self, rel_path: str, chunks: Sequence[Any]) -> None:
        try:
            with self.fs.open_output_stream(self._path(rel_path)) as out:
                for chunk in chunks:
                    out.write(memoryview(chunk).cast("B"))
        except OSError as err:
            raise StorageError(self.uri(rel_path), f"write failed: {err}") from err

    def write_atomic(self, rel_path: str, data: bytes) -> None:
        if self.fs.type_name in _OBJECT_STORES:
            self.write(rel_path, [data])
            return
        # A name of its own: writers racing for one name (ranks committing one step where the
        # create is not conditional) must not move each other's temporary files.
        tmp = staging_name()
        self.write(tmp, [data])
        try:
            self.fs.move(self._path(tmp), self._path(rel_path))
        except OSError as err:
            self._delete_quietly(tmp)
            raise StorageError(self.uri(rel_path), f"commit failed: {err}") from err

    def _delete_quietly(self, rel_path: str) -> None:
        try:
            self.fs.delete_file(self._path(rel_path))
        except OSError:
            pass  # the move's error is the one to report

    def read(self, rel_path: str) -> Any:
        try:
            with self.fs.open_input_file(self._path(rel_path)) as f:
                buffer = uninitialized_buffer(f.size())
                f.readinto(buffer)
                return buffer
        except FileNotFoundError:
            raise
        except OSError as err:
            if "not found" in str(err).lower() or "does not exist" in str(err).lower():
                raise FileNotFoundError(self.uri(rel_path)) from err
            raise StorageError(self.uri(rel_path), f"read failed: {err}") from err

    def read_range(self, rel_path: str, offset: int, length: int) -> Any:
        try:
            with self.fs.open_input_file(self._path(rel_path)) as f:
                length = max(0, min(length, f.size() - offset))
                buffer = uninitialized_buffer(length)
                if length:
                    f.seek(offset)
                    buffer = buffer[:f.readinto(buffer)]
                return buffer
        except FileNotFoundError:
            raise
        except OSError as err:
            if "not found" in str(err).lower() or "does not exist" in str(err).lower():
                raise FileNotFoundError(self.uri(rel_path)) from err
            raise StorageError(self.uri(rel_path), f"read failed: {err}") from err

    def delete_dir(self, rel_dir: str) -> None:
        try:
            self.fs.delete_dir(self._path(rel_dir))
        except FileNotFoundError:
            pass
        except OSError as err:
            raise StorageError(self.uri(rel_dir), f"delete failed: {err}") from err

    def delete_file(self, rel_path: str) -> None:
        try:
            self.fs.delete_file(self._path(rel_path))
        except FileNotFoundError:
            pass
        except OSError as err:
            raise StorageError(self.uri(rel_path), f"delete failed: {err}") from err
