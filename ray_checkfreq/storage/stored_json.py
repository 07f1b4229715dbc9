"""The one parser for every JSON file ray_checkfreq reads back from storage.

Manifests, pointer files, writer markers and metadata documents (a cached profile) are
parsed here and nowhere else, with limits checked before and while parsing, so a
damaged or hostile file costs bounded time and memory and fails as ``StoredJsonError``
(a ``ValueError``), which each reader turns into "this named file is corrupt":

- at most ``max_bytes`` bytes (each reader names its own bound);
- arrays and objects nested at most ``MAX_NESTING`` deep;
- no number of more than ``MAX_DIGITS`` digits (counted before it is converted);
- no NaN, Infinity, or number that overflows a float (writers use ``allow_nan=False``).

A reader then checks the document's schema (types and ranges) before using it.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

MAX_NESTING = 256
MAX_DIGITS = 100  # a numpy PCG64 state is a 39-digit int


class StoredJsonError(ValueError):
    """A stored JSON document is malformed or breaks a limit; the message says which."""


def parse_stored_json(data: bytes, *, max_bytes: int) -> Any:
    """The document in ``data``; raises StoredJsonError past any limit or on bad JSON."""
    if len(data) > max_bytes:
        raise StoredJsonError(f"{len(data)} bytes, more than the {max_bytes} allowed for this file")
    data = bytes(data)
    try:
        document = json.loads(data.decode("utf-8"), parse_int=_bounded_int, parse_float=_finite_float,
                              parse_constant=_refuse_constant)
    except RecursionError:  # the parser's own bound on nesting, far past MAX_NESTING
        raise StoredJsonError(f"arrays and objects nested more than {MAX_NESTING} deep") from None
    except StoredJsonError:
        raise
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError among them
        raise StoredJsonError(f"not valid JSON ({err})") from None
    _check_nesting(document)
    return document


def _check_nesting(document: Any) -> None:
    """Containers at most MAX_NESTING deep. The parser itself stops far deeper (its
    recursion limit, ~1000), so this walks an already bounded tree, without recursion."""
    pending = [(document, 1)] if isinstance(document, (dict, list)) else []
    while pending:
        node, depth = pending.pop()
        if depth > MAX_NESTING:
            raise StoredJsonError(f"arrays and objects nested more than {MAX_NESTING} deep")
        children = node.values() if isinstance(node, dict) else node
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _check_digits(text: str) -> None:
    if sum(c.isdigit() for c in text) > MAX_DIGITS:
        raise StoredJsonError(f"a number of more than {MAX_DIGITS} digits ({text[:20]}...)")


def _bounded_int(text: str) -> int:
    if len(text) > MAX_DIGITS:  # "-" and digits only: count before converting
        _check_digits(text)
    return int(text)


def _refuse_constant(name: str) -> Any:
    raise StoredJsonError(f"non-finite number {name}")


def _finite_float(text: str) -> float:
    if len(text) > MAX_DIGITS:
        _check_digits(text)
    value = float(text)
    if not math.isfinite(value):
        raise StoredJsonError(f"number {text} overflows a float")
    return value


def is_int(value: Any) -> TypeGuard[int]:
    """A JSON integer (bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number (bool is not one)."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)
