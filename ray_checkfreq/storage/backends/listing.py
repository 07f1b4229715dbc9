"""The listing contract every backend keeps, in one place.

A listing is complete as of some moment while it runs: every file that exists from its
start to its end is in it, at its size. A file that vanishes while it is listed (a writer
unlinking its temporary file, a deleter at work) is skipped, and the rest still come back.
``{}`` means only that the directory does not exist (or holds no file). Temporary files
are never staged inside a listed directory: they are files at the store's root named
``STAGING_PREFIX...``, beside the directories, where no listing of a store looks.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable

# Temporary files of exclusive creates and atomic writes, on the store's filesystem (a link
# or rename from there is atomic), outside every directory a listing judges.
STAGING_PREFIX = ".staging-"


def staging_name() -> str:
    """A new temporary file name, at the store's root."""
    return f"{STAGING_PREFIX}{uuid.uuid4().hex}.tmp"


def is_staged(name: str) -> bool:
    return name.startswith(STAGING_PREFIX)


def sizes_of(names: Iterable[str], size_of: Callable[[str], int | None]) -> dict[str, int]:
    """``{name: size}`` of the files among ``names``; ``size_of`` answers None for a name
    that is not a regular file, and raises FileNotFoundError for one that vanished since
    the names were read: that one is skipped, never the whole listing."""
    sizes = {}
    for name in names:
        try:
            size = size_of(name)
        except FileNotFoundError:
            continue
        if size is not None:
            sizes[name] = size
    return sizes


def store_dirs(names: Iterable[str]) -> list[str]:
    """Directory names a store may judge: never a staged name."""
    return [name for name in names if not is_staged(name)]
