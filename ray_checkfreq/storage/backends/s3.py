"""S3 through boto3: multipart uploads via TransferConfig, botocore retries.

There is no rename on S3, so the commit is the manifest's single PUT, issued only after
every shard upload has completed (a multipart upload is visible only once completed).
Endpoint, region and credentials come from the usual AWS environment and config files
(``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...) unless ``S3Options`` sets them.
"""

from __future__ import annotations

import bisect
import io
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlparse

from ray_checkfreq.errors import StorageError
from ray_checkfreq.storage.backends.base import Backend, uninitialized_buffer
from ray_checkfreq.storage.backends.listing import is_staged, store_dirs

logger = logging.getLogger("ray_checkfreq.storage")
MiB = 1024 * 1024
_CONFLICT_ATTEMPTS = 5
_RETRY_MODES = ("legacy", "standard", "adaptive")
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
    "InvalidToken", "AuthFailure", "UnrecognizedClientException", "403",
}


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """S3 settings; ``None`` means "from the AWS environment / config files".

    Retries default to botocore's ``standard`` mode with 8 attempts unless
    ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` are set in the environment.
    """

    endpoint_url: str | None = None
    """The S3 endpoint (None: AWS's)."""
    region: str | None = None
    """None: from the AWS environment and config files."""
    retry_mode: str | None = None
    """``"legacy"``, ``"standard"`` or ``"adaptive"`` (None: ``AWS_RETRY_MODE``, else standard)."""
    max_attempts: int | None = None
    """None: ``AWS_MAX_ATTEMPTS``, else 8."""
    multipart_threshold_bytes: int = 64 * MiB
    """Objects from this size up are uploaded in parts."""
    multipart_chunksize_bytes: int = 16 * MiB
    """Bytes per part (at least 5 MiB)."""
    max_concurrency: int = 8
    """Parallel part transfers."""

    def __post_init__(self) -> None:
        if self.retry_mode is not None and self.retry_mode not in _RETRY_MODES:
            raise ValueError(f"retry_mode={self.retry_mode!r}: expected one of {_RETRY_MODES}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts}: must be >= 1")
        if self.multipart_chunksize_bytes < 5 * MiB:
            raise ValueError(
                f"multipart_chunksize_bytes={self.multipart_chunksize_bytes}: S3 parts are at least 5 MiB"
            )
        if self.multipart_threshold_bytes < 1:
            raise ValueError(f"multipart_threshold_bytes={self.multipart_threshold_bytes}: must be >= 1")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency}: must be >= 1")

    def retries(self) -> dict | None:
        if self.retry_mode is None and self.max_attempts is None:
            if os.environ.get("AWS_RETRY_MODE") or os.environ.get("AWS_MAX_ATTEMPTS"):
                return None
            return {"mode": "standard", "max_attempts": 8}
        return {"mode": self.retry_mode or "standard", "max_attempts": self.max_attempts or 8}


def parse_s3_uri(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"{uri!r} is not an s3://bucket/prefix URI")
    return parsed.netloc, parsed.path.strip("/")


class S3Backend(Backend):
    # A conditional PutObject (If-None-Match: *); a server without one is detected (501) and
    # warned about once (``_warn_unconditional``).
    atomic_exclusive_create = True

    def __init__(self, uri: str, options: S3Options | None = None) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.options = options or S3Options()
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.root_uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        config = Config(retries=self.options.retries(), max_pool_connections=self.options.max_concurrency + 4)
        session = boto3.session.Session()
        self.client = session.client(
            "s3", endpoint_url=self.options.endpoint_url, region_name=self.options.region, config=config
        )
        self.transfer = TransferConfig(
            multipart_threshold=self.options.multipart_threshold_bytes,
            multipart_chunksize=self.options.multipart_chunksize_bytes,
            max_concurrency=self.options.max_concurrency,
        )

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _dir_prefix(self, rel_dir: str) -> str:
        base = self._key(rel_dir) if rel_dir else self.prefix
        return f"{base}/" if base else ""

    def list_dirs(self) -> list[str]:
        prefix = self._dir_prefix("")
        names = []
        with _translated(self.root_uri, "list"):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            ):
                names += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return store_dirs(names)

    def list_files(self, rel_dir: str) -> dict[str, int]:
        prefix = self._dir_prefix(rel_dir)
        files: dict[str, int] = {}
        with _translated(self.uri(rel_dir), "list"):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            ):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix):]
                    if name:  # not the directory marker pyarrow's create_dir leaves ("<dir>/")
                        files[name] = obj["Size"]
        return files

    def list_tree(self) -> dict[str, dict[str, int]]:
        """One listing of the whole prefix instead of one per directory."""
        prefix = self._dir_prefix("")
        tree: dict[str, dict[str, int]] = {}
        with _translated(self.root_uri, "list"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    parts = obj["Key"][len(prefix):].split("/")
                    if len(parts) < 2 or not parts[0] or is_staged(parts[0]):
                        continue
                    files = tree.setdefault(parts[0], {})  # a directory holding only deeper keys: {}
                    if len(parts) == 2 and parts[1]:
                        files[parts[1]] = obj["Size"]
        return tree

    def make_dir(self, rel_dir: str) -> None:
        """S3 has no directories; check the bucket is reachable before any upload."""
        with _translated(f"s3://{self.bucket}", "access bucket"):
            self.client.head_bucket(Bucket=self.bucket)

    def write(self, rel_path: str, chunks: Sequence[Any]) -> None:
        with _translated(self.uri(rel_path), "upload"):
            self.client.upload_fileobj(
                ChunkReader(chunks), self.bucket, self._key(rel_path), Config=self.transfer
            )

    def write_atomic(self, rel_path: str, data: bytes) -> None:
        with _translated(self.uri(rel_path), "commit"):
            self.client.put_object(Bucket=self.bucket, Key=self._key(rel_path), Body=bytes(data))

    def create_exclusive(self, rel_path: str, data: bytes, *, make_parents: bool = False) -> bool:
        """A PutObject with ``If-None-Match: *``: S3 refuses it (412) when the key exists."""
        key = self._key(rel_path)
        body = bytes(data)
        with _translated(self.uri(rel_path), "commit"):
            for _ in range(_CONFLICT_ATTEMPTS):
                outcome = self._put_if_absent(key, body)
                if outcome is not None:
                    return outcome
        raise StorageError(self.uri(rel_path), "commit: conditional writes kept conflicting (409)")

    def _put_if_absent(self, key: str, body: bytes) -> bool | None:
        """True: created; False: the key exists; None: a concurrent conditional write, retry."""
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*")
            return True
        except ClientError as exc:
            code = _error_code(exc)
            if code == "PreconditionFailed":
                # A retried PUT whose first attempt landed finds its own bytes there.
                return self._object_bytes(key) == body
            if code == "ConditionalRequestConflict":
                return None
            if code != "NotImplemented":
                raise
        _warn_unconditional(self.root_uri)
        if self._object_bytes(key) is not None:
            return False
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body)
        return True

    def _object_bytes(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if _error_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def read_small(self, rel_path: str) -> bytes:
        """One GetObject (``read`` spends a HEAD and a ranged transfer on it)."""
        with _translated(self.uri(rel_path), "read"):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(rel_path))["Body"].read()

    def stat_size(self, rel_path: str) -> int | None:
        """One HeadObject: the object's size as S3 has it now, not as a listing saw it."""
        try:
            with _translated(self.uri(rel_path), "stat"):
                return int(self.client.head_object(Bucket=self.bucket, Key=self._key(rel_path))["ContentLength"])
        except FileNotFoundError:
            return None

    def exists(self, rel_path: str) -> bool:
        try:
            with _translated(self.uri(rel_path), "read"):
                self.client.head_object(Bucket=self.bucket, Key=self._key(rel_path))
        except FileNotFoundError:
            return False
        return True

    def read(self, rel_path: str) -> Any:
        key = self._key(rel_path)
        with _translated(self.uri(rel_path), "read"):
            size = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
            sink = BufferWriter(size)
            self.client.download_fileobj(self.bucket, key, sink, Config=self.transfer)
        return sink.buffer

    def read_range(self, rel_path: str, offset: int, length: int) -> Any:
        """One ranged GetObject (``Range: bytes=offset-end``)."""
        if length <= 0:
            return uninitialized_buffer(0)
        key = self._key(rel_path)
        with _translated(self.uri(rel_path), "read"):
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=key,
                                              Range=f"bytes={offset}-{offset + length - 1}")["Body"]
            except Exception as exc:  # past the end: S3 answers 416, which is "nothing there"
                if _is_unsatisfiable(exc):
                    return uninitialized_buffer(0)
                raise
            sink = BufferWriter(length)
            while chunk := body.read(min(length, 8 * MiB)):
                sink.write(chunk)
        return sink.buffer[:sink.tell()]

    def delete_dir(self, rel_dir: str) -> None:
        prefix = self._dir_prefix(rel_dir)
        with _translated(self.uri(rel_dir), "delete"):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            ):
                keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
                if keys:
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

    def delete_file(self, rel_path: str) -> None:
        with _translated(self.uri(rel_path), "delete"):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(rel_path))

    def close(self) -> None:
        self.client.close()


class _SeekableBuffer(io.RawIOBase):
    """Position bookkeeping shared by the upload source and the download sink."""

    _size = 0
    _pos = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos


class ChunkReader(_SeekableBuffer):
    """A seekable read-only file over a list of buffers, without joining them."""

    def __init__(self, chunks: Sequence[Any]) -> None:
        self._views = [memoryview(c).cast("B") for c in chunks]
        self._starts = list(itertools.accumulate((v.nbytes for v in self._views), initial=0))[:-1]
        self._size = sum(v.nbytes for v in self._views)

    def readable(self) -> bool:
        return True

    def readinto(self, out: Any) -> int:
        target = memoryview(out).cast("B")
        written = 0
        while written < target.nbytes and self._pos < self._size:
            # the last chunk starting at or before the position (skips empty chunks)
            index = bisect.bisect_right(self._starts, self._pos) - 1
            view = self._views[index][self._pos - self._starts[index]:]
            n = min(view.nbytes, target.nbytes - written)
            target[written:written + n] = view[:n]
            written += n
            self._pos += n
        return written


class BufferWriter(_SeekableBuffer):
    """A seekable sink into one preallocated buffer (parts may arrive out of order)."""

    def __init__(self, size: int) -> None:
        self.buffer = uninitialized_buffer(size)
        self._view = memoryview(self.buffer)
        self._size = size

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        end = self._pos + view.nbytes
        if end > self._size:
            raise OSError(f"object grew during download ({end} > {self._size} bytes)")
        self._view[self._pos:end] = view
        self._pos = end
        return view.nbytes


class _translated:
    """Turn botocore's errors into StorageError naming the object or bucket."""

    def __init__(self, location: str, action: str) -> None:
        self.location = location
        self.action = action

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc is None or isinstance(exc, StorageError):
            return False
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        if isinstance(exc, ClientError):
            raise _client_error(self.location, self.action, exc) from exc
        if isinstance(exc, NoCredentialsError):
            raise StorageError(self.location, f"{self.action}: no AWS credentials found") from exc
        if isinstance(exc, BotoCoreError):
            raise StorageError(self.location, f"{self.action} failed after retries: {exc}") from exc
        return False


def _is_unsatisfiable(exc: Any) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError) and (
        exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416
        or exc.response.get("Error", {}).get("Code") == "InvalidRange")


def _error_code(exc: Any) -> str:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return {412: "PreconditionFailed", 409: "ConditionalRequestConflict", 501: "NotImplemented"}.get(status, code)


_warned_unconditional: set[str] = set()


def _warn_unconditional(root_uri: str) -> None:
    if root_uri not in _warned_unconditional:
        _warned_unconditional.add(root_uri)
        logger.warning("%s: the server has no conditional PutObject (If-None-Match); commits and writer "
                       "generations fall back to check-then-write, a race between concurrent writers", root_uri)


def _client_error(location: str, action: str, exc: Any) -> Exception:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("NoSuchBucket",):
        return StorageError(location, f"{action}: the bucket does not exist")
    if code in ("NoSuchKey", "404", "NotFound"):
        if action == "access bucket":
            return StorageError(location, f"{action}: the bucket does not exist")
        return FileNotFoundError(location)
    if code in _CREDENTIAL_CODES or status == 403:
        return StorageError(location, f"{action}: credentials rejected ({code}: {error.get('Message', '')})")
    return StorageError(location, f"{action}: {code or status}: {error.get('Message', exc)}")

