"""A CPU hog beside a chaos run: processes that spin on a core each, so that the job's
iterations and persists run under load (a shared node, a noisy neighbour)."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

MAX_HOG_S = 3600.0  # a hog never outlives this, even if its parent dies without stopping it


def _spin(until_s: float, niceness: int) -> None:
    os.nice(niceness)
    while time.time() < until_s:
        for _ in range(100_000):
            pass


# Ray starts its worker processes at niceness 15: a hog at the shell's 0 would starve them
# instead of sharing the cores with them, as a neighbour's job of Ray's own would.
HOG_NICENESS = 15


@contextmanager
def cpu_hog(processes: int, *, max_s: float = MAX_HOG_S) -> Iterator[None]:
    """``processes`` busy processes (0: none) for the duration of the block, at most ``max_s``,
    at the niceness of Ray's workers."""
    if processes < 0:
        raise ValueError(f"processes={processes!r}: must be >= 0")
    context = multiprocessing.get_context("spawn")
    hogs = [context.Process(target=_spin, args=(time.time() + max_s, HOG_NICENESS), daemon=True,
                            name=f"rcf-hog-{n}")
            for n in range(processes)]
    for hog in hogs:
        hog.start()
    try:
        yield
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join(timeout=10)
