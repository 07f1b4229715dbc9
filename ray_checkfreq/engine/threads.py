"""The engine's background threads run below training's CPU priority (Linux ``nice``, per
thread): where they and training want the same cores, training gets them first."""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("ray_checkfreq.engine")

BACKGROUND_NICE = 10


def lower_thread_priority(nice: int) -> None:
    """Raise this thread's nice value by ``nice`` (Linux: per thread); best effort."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as err:
        logger.debug("a background thread keeps its priority: %s", err)
