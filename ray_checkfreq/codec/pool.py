"""One shared thread pool; zstd, the C kernels, crc32 and numpy copies release the GIL."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

from ray_checkfreq.codec.errors import CodecError

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def cores() -> int:
    return os.cpu_count() or 1


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=cores(), thread_name_prefix="checkfreq-codec")
        return _pool


def resolve_threads(threads: int | None) -> int:
    if threads is None:
        return cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise CodecError(f"threads must be a positive int or None, got {threads!r}")
    return threads


def run_indexed(fn: Callable[[int], object], count: int, threads: int) -> list:
    """``[fn(i) for i in range(count)]`` on at most ``threads`` threads, in index order."""
    workers = min(threads, count, cores())
    if workers <= 1:
        return [fn(i) for i in range(count)]
    results: list = [None] * count
    next_index = itertools.count()  # next() on it is atomic under the GIL

    def lane() -> None:
        for i in iter(lambda: next(next_index), None):
            if i >= count:
                return
            results[i] = fn(i)

    # The caller runs one lane itself: for tensors of a few frames, handing every lane to
    # the pool and sleeping cost more than the second thread gained.
    futures = [_shared_pool().submit(lane) for _ in range(workers - 1)]
    try:
        lane()
    finally:
        wait(futures)  # every lane finishes before an error propagates
    for fut in futures:
        fut.result()
    return results
