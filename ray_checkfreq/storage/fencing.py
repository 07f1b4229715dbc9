"""Writer generations: which of several processes saving to one URI may still commit.

A writer generation is a positive integer, unique on its URI. Taking one creates
``writers/gen-<12 digits>.json`` with an exclusive create (a hard link on POSIX,
``If-None-Match: *`` on S3), numbered one above the newest generation in use: the
newest marker and the newest generation in a checkpoint directory's name, so deleting
``writers/`` never hands out an old number again. Two writers racing for a number
cannot both create its marker; the loser takes the next one. Generation 0 stands for
every checkpoint written before fencing existed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from ray_checkfreq.errors import FencedWriterError, StorageError
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.names import MAX_GENERATION, marker_name, parse_marker

logger = logging.getLogger("ray_checkfreq.storage")

WRITERS_DIR = "writers"
_ACQUIRE_ATTEMPTS = 50


def marker_path(generation: int) -> str:
    return f"{WRITERS_DIR}/{marker_name(generation)}"


def newest_marker(backend: Backend) -> int:
    """The newest generation taken on this URI (0 when none); other names are ignored."""
    found = (parse_marker(name) for name in backend.list_files(WRITERS_DIR))
    return max((generation for generation in found if generation is not None), default=0)


def has_marker(backend: Backend, generation: int) -> bool:
    return backend.exists(marker_path(generation))


def acquire_generation(backend: Backend, newest_in_use: int) -> int:
    """Take a generation newer than every one taken before on this URI."""
    floor = newest_in_use
    for _ in range(_ACQUIRE_ATTEMPTS):
        generation = max(floor, newest_marker(backend)) + 1
        if generation > MAX_GENERATION:
            raise StorageError(backend.uri(WRITERS_DIR), f"writer generation {generation} is past the "
                               f"largest one names can hold ({MAX_GENERATION}): a directory or marker "
                               "with a forged generation? remove it")
        if backend.create_exclusive(marker_path(generation), _marker_body(generation), make_parents=True):
            return generation
        floor = generation
    raise StorageError(backend.uri(WRITERS_DIR), f"no writer generation after {_ACQUIRE_ATTEMPTS} attempts")


def _marker_body(generation: int) -> bytes:
    # Who took it, for a person reading the bucket; the nonce makes every body unique.
    return json.dumps({
        "generation": generation,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "created_unix_ns": time.time_ns(),
        "nonce": uuid.uuid4().hex,
    }).encode("utf-8")


def raise_if_fenced(err: BaseException, check_fence: Callable[[], None]) -> None:
    """Raise the ``FencedWriterError`` a failed save or commit really was: a newer generation
    took over (its housekeeping removed this writer's files while it wrote, say). Returns
    when the writer is not fenced, or the fence cannot be read: the original error is the
    one to report then."""
    if isinstance(err, FencedWriterError) or not isinstance(err, Exception):
        return
    try:
        check_fence()
    except FencedWriterError as fenced:
        raise fenced from err
    except Exception:
        return


def check_fence(backend: Backend, generation: int, newest: int | None = None) -> None:
    """Raise FencedWriterError if a generation newer than ``generation`` was taken.
    ``newest``: the newest generation a listing made anyway showed (a cheap early check;
    the check right before a commit reads the markers)."""
    newest = newest_marker(backend) if newest is None else newest
    if newest > generation:
        raise FencedWriterError(backend.root_uri, generation, newest)


class WriterSlot:
    """One store's writer generation: none until taken (``take``), handed over at
    construction, or adopted from the writer of the same run that took it."""

    def __init__(self, backend: Backend, generation: int | None) -> None:
        self._backend = backend
        self.generation = checked_generation(generation, "writer_generation")
        self._confirmed = False  # its marker was seen (a handed-over number may be forged)

    def take(self, newest_in_use: int) -> int:
        """This writer's generation, taking one newer than ``newest_in_use`` and every
        marker when it has none; a handed-over one must have its marker."""
        if self.generation is None:
            self.generation = acquire_generation(self._backend, newest_in_use)
            logger.info("%s: writer generation %d taken", self._backend.root_uri, self.generation)
        elif not self._confirmed and not has_marker(self._backend, self.generation):
            raise StorageError(self._backend.uri(marker_path(self.generation)),
                               f"writer generation {self.generation} was never taken on this URI (see acquire_writer)")
        self._confirmed = True
        return self.generation

    def adopt(self, generation: int) -> None:
        """Write as ``generation`` (idempotent); ValueError for another one than held."""
        generation = checked_generation(generation, "generation")
        if self.generation is not None and self.generation != generation:
            raise ValueError(f"{self._backend.root_uri}: this store writes as generation {self.generation}, "
                             f"cannot adopt generation {generation}")
        self.generation = generation

    def require(self) -> int:
        if self.generation is None:
            raise StorageError(self._backend.root_uri, "this store has no writer generation (acquire_writer, or "
                               "writer_generation=g handed over from the one that took it)")
        return self.generation


def checked_generation(generation: Any, what: str) -> Any:
    if generation is not None and (isinstance(generation, bool) or not isinstance(generation, int)
                                   or not 1 <= generation <= MAX_GENERATION):
        raise ValueError(f"{what}={generation!r}: must be an int from 1 to {MAX_GENERATION} "
                         "(from acquire_writer) or None")
    return generation
