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
import os
import socket
import time
import uuid
from collections.abc import Callable

from ray_checkfreq.errors import FencedWriterError, StorageError
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.names import MAX_GENERATION, marker_name, parse_marker

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
