"""Run a function over items on a few threads, or inline where one thread would do."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def map_on_threads(function: Callable[[Item], Result], items: Sequence[Item], threads: int,
                   name: str) -> list[Result]:
    """``[function(item) for item in items]``, on up to ``threads`` threads named ``name``;
    inline (on the caller's thread, no pool) where that is one thread or one item."""
    if threads <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix=name) as pool:
        return list(pool.map(function, items))
