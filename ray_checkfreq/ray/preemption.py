"""Preemption notices: a drain of any node of the run becomes a durable checkpoint in time.

Rank 0 watches the drain state of the run's nodes (``get_draining_nodes()``, the same
source Ray Train's own watcher polls; ``get_preemption_info()`` is a collective and is not
used). On a notice it plans one checkpoint at the last safe iteration, carrying ``stop``:
every rank snapshots that iteration and then blocks until Ray Train tears the group down,
so no iteration runs that the restart would lose. The snapshot is persisted by the agent
of a node that is not draining (under DDP each node's agent holds a replica), so it
commits even if the drained node, rank 0's included, is gone first.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray_checkfreq.ray")


@dataclass(frozen=True)
class Notice:
    node_id: str
    deadline_s: float | None  # epoch seconds; None: no deadline (act at once)
    seen_s: float  # epoch seconds when rank 0 saw it


def stop_iteration(*, now_s: float, notice: Notice, iteration: int, iter_s: float, persist_s: float,
                   detection_lag_s: float) -> int:
    """The iteration to checkpoint at and stop after: the last one whose snapshot still
    commits before the deadline, leaving 1.5x the persist time, 2 iterations and the
    detection lag as margin; the next iteration when that moment has passed (or no deadline).

    ``iteration`` is the one being planned now (the earliest possible).
    """
    if notice.deadline_s is None or iter_s <= 0:
        return iteration
    last_safe_s = notice.deadline_s - (1.5 * persist_s + 2 * iter_s + detection_lag_s)
    spare = math.floor((last_safe_s - now_s) / iter_s)
    return iteration + max(0, spare)


def notice_record(notices: list[dict], *, generation: int, stop_at: int, stopped_at: int | None) -> dict:
    """What rank 0 stores beside the checkpoints when it plans a stop (``stopped_at`` None)
    and again once the stop checkpoint is durable, so a restart can count the lost iterations
    even when the group was torn down before that checkpoint."""
    return {"generation": generation, "notices": notices, "stop_at": stop_at, "stopped_at": stopped_at}


def lost_after_notice(record: Mapping[str, Any] | None, *, restored: int, generation: int) -> int | None:
    """Iterations the previous attempt trained past ``restored`` after a notice: exact when its
    stop checkpoint was confirmed durable, else at most ``stop_at - restored`` (no rank trains
    past the planned stop). None without a notice record that this restart has not counted."""
    if not record or record.get("restored_by") is not None:
        return None
    writer = record.get("generation")
    if isinstance(writer, int) and writer >= generation:  # a record of this attempt or a newer one
        return None
    for key in ("stopped_at", "stop_at"):
        if isinstance(record.get(key), int):
            return max(0, record[key] - restored)
    return None


def draining_nodes() -> dict[str, float | None]:
    """{node id: deadline in epoch seconds, or None} of every draining node of the cluster."""
    import ray._private.state

    found = ray._private.state.state.get_draining_nodes()
    return {node: (deadline_ms / 1000.0 if deadline_ms else None) for node, deadline_ms in found.items()}


class DrainWatcher:
    """Polls the drain state of ``nodes`` in a background thread; never blocks training."""

    def __init__(self, nodes: Collection[str], *, poll_s: float = 0.5,
                 source: Callable[[], dict[str, float | None]] = draining_nodes) -> None:
        self.nodes = set(nodes)
        self.poll_s = poll_s
        self._source = source
        self._notice: Notice | None = None
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rcf-drain-watch", daemon=True)
        self._thread.start()

    @property
    def notice(self) -> Notice | None:
        return self._notice

    def draining(self) -> set[str]:
        """The run's nodes seen draining so far (the notice's node first)."""
        return set(self._seen)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                drains = {node: deadline for node, deadline in self._source().items() if node in self.nodes}
            except Exception as err:  # a GCS hiccup must not stop training: poll again
                logger.debug("drain watch: %s", err)
                continue
            self._seen |= set(drains)
            if drains and self._notice is None:
                node = min(drains, key=lambda n: drains[n] or 0.0)
                self._notice = Notice(node_id=node, deadline_s=drains[node], seen_s=time.time())
                deadline = drains[node]
                logger.warning("preemption notice for node %s (deadline in %s s)", node[:8],
                               "none" if deadline is None else f"{deadline - time.time():.1f}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
