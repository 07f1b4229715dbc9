"""Small JSON documents beside the checkpoints (a cached profile, say): at the root of the
store's URI, with name rules and a bounded parser of their own."""

from __future__ import annotations

import json
import logging
import re

from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.stored_json import StoredJsonError, parse_stored_json

logger = logging.getLogger("ray_checkfreq.storage")

MAX_METADATA_BYTES = 16 * 1024 * 1024


def write_metadata(backend: Backend, name: str, data: dict) -> None:
    """Store ``data`` as ``name`` at the backend's root, atomically."""
    check_metadata_name(name)
    backend.write_atomic(name, json.dumps(data, indent=1, allow_nan=False).encode("utf-8"))


def read_metadata(backend: Backend, name: str) -> dict | None:
    """A document written by ``write_metadata``; None if absent or unreadable (a warning
    names the file). The caller checks the document's schema."""
    check_metadata_name(name)
    try:
        data = parse_stored_json(backend.read_small(name), max_bytes=MAX_METADATA_BYTES)
    except FileNotFoundError:
        return None
    except StoredJsonError as err:
        logger.warning("ignoring unreadable %s: %s", backend.uri(name), err)
        return None
    if not isinstance(data, dict):
        logger.warning("ignoring %s: not a JSON object", backend.uri(name))
        return None
    return data


def check_metadata_name(name: str) -> None:
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,100}\.json", name) or ".." in name:
        raise ValueError(f"metadata name {name!r}: expected a plain lower-case file name ending in .json")
