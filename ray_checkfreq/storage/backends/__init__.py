"""Pick a storage backend from a URI."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlparse

from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.backends.s3 import S3Options


def open_backend(uri: str, *, filesystem: Any = None, s3: S3Options | None = None,
                 direct_io: bool = True) -> Backend:
    """A plain path or ``file://`` -> POSIX; ``s3://`` -> boto3; else ``pyarrow.fs``.

    With ``filesystem`` (a ``pyarrow.fs.FileSystem``), ``uri`` is a path on it; a
    ``Backend`` given as ``filesystem`` is used as it is (the simulation's, a test's).
    ``direct_io``: a POSIX backend writes large shards around the page cache.
    """
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"storage URI must be a non-empty string, got {uri!r}")
    if isinstance(filesystem, Backend):
        return filesystem
    parsed = urlparse(uri)
    if filesystem is not None:
        path = (parsed.netloc + parsed.path) if parsed.scheme else uri
        return _on_filesystem(filesystem, path, uri, direct_io)
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and uri[1:3] in (":\\", ":/")):
        from ray_checkfreq.storage.backends.posix import PosixBackend

        return PosixBackend(unquote(parsed.path) if parsed.scheme == "file" else uri, direct_io=direct_io)
    if parsed.scheme == "s3":
        from ray_checkfreq.storage.backends.s3 import S3Backend

        return S3Backend(uri, s3)
    return _arrow_from_uri(uri, direct_io)


def _on_filesystem(filesystem: Any, path: str, uri: str, direct_io: bool) -> Backend:
    import pyarrow.fs

    if isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        # pyarrow's local streams never fsync; the POSIX backend does (durable on return).
        from ray_checkfreq.storage.backends.posix import PosixBackend

        return PosixBackend(path, direct_io=direct_io)
    from ray_checkfreq.storage.backends.arrowfs import ArrowBackend

    return ArrowBackend(filesystem, path, root_uri=uri)


def _arrow_from_uri(uri: str, direct_io: bool) -> Backend:
    import pyarrow.fs

    try:
        filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as err:
        raise ValueError(f"storage URI {uri!r} is not understood by pyarrow.fs: {err}") from err
    return _on_filesystem(filesystem, path, uri, direct_io)


__all__ = ["Backend", "S3Options", "open_backend"]
