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
import re
import socket
import time
import uuid

from ray_checkfreq.errors import StorageError
from ray_checkfreq.storage.backends.base import Backend

WRITERS_DIR = "writers"
_MARKER = re.compile(r"^gen-(\d{12})\.json$")
_ACQUIRE_ATTEMPTS = 50


def marker_path(generation: int) -> str:
    return f"{WRITERS_DIR}/gen-{generation:012d}.json"


def newest_marker(backend: Backend) -> int:
    """The newest generation taken on this URI (0 when none)."""
    found = (_MARKER.match(name) for name in backend.list_files(WRITERS_DIR))
    return max((int(match.group(1)) for match in found if match), default=0)


def has_marker(backend: Backend, generation: int) -> bool:
    return backend.exists(marker_path(generation))


def acquire_generation(backend: Backend, newest_in_use: int) -> int:
    """Take a generation newer than every one taken before on this URI."""
    floor = newest_in_use
    for _ in range(_ACQUIRE_ATTEMPTS):
        generation = max(floor, newest_marker(backend)) + 1
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
