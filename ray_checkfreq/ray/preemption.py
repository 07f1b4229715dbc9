"""Preemption notices: a drain of any node of the run becomes a durable checkpoint in time.

Rank 0 watches the drain state of the run's nodes (``get_draining_nodes()``, the same
source Ray Train's own watcher polls; ``get_preemption_info()`` is a collective and is not
used). On a notice it plans two checkpoints:

- the notice checkpoint, at the next iteration it can plan: a two-phase snapshot costs
  milliseconds, and once it is durable a notice loses at most what is trained after it;
- the stop checkpoint, at the last safe iteration (``stop_iteration``: the deadline less
  twice the slowest recent persist, two iterations and the detection lag), carrying
  ``stop``: every rank snapshots that iteration and then blocks until Ray Train tears the
  group down. Each later iteration moves it earlier when the iterations or the persists
  slowed down (the notice checkpoint's own persist is measured under the load of the moment).

If the stop checkpoint is not durable by the deadline, the restart resumes from the notice
checkpoint. A snapshot is persisted by the agent of a node that is not draining (under DDP
each node's agent holds a replica), so it commits even if the drained node, rank 0's
included, is gone first.

``Preemption`` holds these steps for one rank: the iteration clock, planning the stop on
a notice (rank 0), the route of a persist away from a draining node, and the stop itself.
Rank 0 records the notice in ``NOTICES_NAME`` beside the checkpoints (``restart.py``
counts the iterations it cost, at every restart until an attempt after it commits).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.ray import agent as agents

logger = logging.getLogger("ray_checkfreq.ray")

NOTICES_NAME = "checkfreq-notices.json"


@dataclass(frozen=True)
class Notice:
    node_id: str
    deadline_s: float | None  # epoch seconds; None: no deadline (act at once)
    seen_s: float  # epoch seconds when rank 0 saw it


# The stop checkpoint leaves this many times the slowest recent persist before the deadline.
PERSIST_MARGIN = 2.0


def stop_iteration(*, now_s: float, notice: Notice, iteration: int, iter_s: float, persist_s: float,
                   detection_lag_s: float) -> int:
    """The iteration to checkpoint at and stop after: the last one whose snapshot still
    commits before the deadline, leaving ``PERSIST_MARGIN`` x ``persist_s`` (the slowest
    recent persist), 2 iterations and the detection lag as margin; the next iteration when
    that moment has passed (or no deadline).

    ``iteration`` is the one being planned now (the earliest possible).
    """
    if notice.deadline_s is None or iter_s <= 0:
        return iteration
    last_safe_s = notice.deadline_s - (PERSIST_MARGIN * persist_s + 2 * iter_s + detection_lag_s)
    spare = math.floor((last_safe_s - now_s) / iter_s)
    return iteration + max(0, spare)


def two_persists_before(stop_at: int, *, iter_s: float, persist_s: float) -> int:
    """The last iteration before ``stop_at`` whose checkpoint leaves the stop's snapshot no
    persist to wait for (``PERSIST_MARGIN`` persists, one iteration): a notice checkpoint
    later than that would delay the stop's, so the stop is taken at once instead."""
    if iter_s <= 0:
        return stop_at
    return stop_at - math.ceil(PERSIST_MARGIN * persist_s / iter_s) - 1


def notice_record(notices: list[dict], *, generation: int, stop_at: int, stopped_at: int | None) -> dict:
    """What rank 0 stores beside the checkpoints when it plans a stop (``stopped_at`` None)
    and again once the stop checkpoint is durable, so a restart can count the lost iterations
    even when the group was torn down before that checkpoint."""
    return {"generation": generation, "notices": notices, "stop_at": stop_at, "stopped_at": stopped_at}


def lost_after_notice(record: Mapping[str, Any] | None, *, restored: int, generation: int) -> int | None:
    """Iterations the previous attempt trained past ``restored`` after a notice: exact when its
    stop checkpoint was confirmed durable, else at most ``stop_at - restored`` (no rank trains
    past the planned stop). None without a notice record, or once an attempt after the notice
    has committed a checkpoint of its own (``settled_by``): the restarts before that (one that
    died or was resized before its first commit) each count the notice again."""
    if not record or record.get("settled_by") is not None:
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


def write_notice_record(store: Any, record: dict) -> None:
    """A failed write loses only the statistic, never training: logged, not raised."""
    try:
        store.write_metadata(NOTICES_NAME, record)
    except Exception as err:  # the store's errors vary by backend; the run goes on
        logger.warning("could not record the preemption notice in %s: %s", NOTICES_NAME, err)


class Preemption:
    """One rank's preemption handling; ``watcher`` only on rank 0 (None: notices are not watched).

    ``generation``: the run's writer generation (known once the restart has run).
    ``on_notices``: called with the number of notices seen (rank 0's metrics).
    ``every_rank_flushes``: every rank persists its own part (a sharded state).
    """

    def __init__(self, *, rank: int, store: Any, watcher: DrainWatcher | None, detection_lag_s: float,
                 generation: Callable[[], int], on_notices: Callable[[int], None] | None = None,
                 every_rank_flushes: bool = False) -> None:
        self.rank = rank
        self.every_rank_flushes = every_rank_flushes
        self.store = store
        self.watcher = watcher
        self.detection_lag_s = detection_lag_s
        self.generation = generation
        self.on_notices = on_notices
        self.notices: list[dict] = []
        self.notice_checkpoint: int | None = None  # rank 0: the iteration of the notice's own checkpoint
        self._notice_checkpoint_s = 0.0  # when it was planned (epoch seconds)
        self._last_step_s: float | None = None
        self._iter_s = 0.0  # moving average of the iteration time
        self._last_iter_s = 0.0  # the last iteration's time

    def time_iteration(self) -> None:
        now = time.monotonic()
        if self._last_step_s is not None:
            spent = self._last_iter_s = now - self._last_step_s
            self._iter_s = spent if self._iter_s == 0 else 0.9 * self._iter_s + 0.1 * spent
        self._last_step_s = now

    def plan_for_notice(self, engine: Any, lookahead: int) -> None:
        """Rank 0: on a new notice, set the engine's ``stop_at`` and record the notice; on every
        later iteration, move the stop earlier when the iterations slowed down so much that it
        would no longer commit before the deadline (a replacement node starting beside the
        training, say: seen here at 3x the iteration time)."""
        notice = self.watcher.notice if self.watcher is not None else None
        if notice is None:
            return
        persist_s = self._persist_estimate_s(engine.stats())
        earliest = engine.iteration + 1 + lookahead  # what the next step() plans
        if engine.stop_at is not None:
            self._replan(engine, notice, earliest=earliest, persist_s=persist_s)
            return
        engine.stop_at = stop_iteration(now_s=time.time(), notice=notice, iteration=earliest, iter_s=self._iter_s,
                                        persist_s=persist_s, detection_lag_s=self.detection_lag_s)
        if earliest < two_persists_before(engine.stop_at, iter_s=self._iter_s, persist_s=persist_s):
            # Time to train on: keep what was trained so far at once.
            engine.request_checkpoint(earliest)
            self.notice_checkpoint, self._notice_checkpoint_s = earliest, time.time()
        else:  # no room for two persists before the deadline: one checkpoint, now
            engine.stop_at = earliest
        self.notices.append({"node_id": notice.node_id, "deadline_s": notice.deadline_s, "seen_s": notice.seen_s,
                             "iteration": engine.stop_at, "notice_checkpoint": self.notice_checkpoint})
        if self.on_notices is not None:
            self.on_notices(len(self.notices))
        if self.notice_checkpoint is not None:
            logger.warning("preemption notice: checkpoint at iteration %d, and at %d before the deadline, then stop",
                           self.notice_checkpoint, engine.stop_at)
        else:
            logger.warning("preemption notice: checkpoint at iteration %d, then stop", engine.stop_at)
        # Recorded now, not only at the commit: the group may be torn down before it.
        write_notice_record(self.store, notice_record(self.notices, generation=self.generation(),
                                                      stop_at=engine.stop_at, stopped_at=None))

    def _persist_estimate_s(self, stats: Mapping[str, Any]) -> float:
        """The slowest recent persist, or the notice checkpoint's while it is still in flight
        and already slower (it runs under the load of the moment)."""
        slowest = stats.get("slowest_recent_persist_s") or 0.0
        if self.notice_checkpoint is None or (stats.get("last_persisted_step") or 0) >= self.notice_checkpoint:
            return slowest
        return max(slowest, time.time() - self._notice_checkpoint_s)

    def _replan(self, engine: Any, notice: Notice, *, earliest: int, persist_s: float) -> None:
        if earliest > engine.stop_at:
            return  # the stop is planned already
        # The slower of the average and the last iteration: a slowdown shows in the last one first.
        now_at = stop_iteration(now_s=time.time(), notice=notice, iteration=earliest,
                                iter_s=max(self._iter_s, self._last_iter_s), persist_s=persist_s,
                                detection_lag_s=self.detection_lag_s)
        if now_at >= engine.stop_at:
            return
        logger.warning("preemption notice: the iterations or persists slowed down; checkpoint at iteration %d "
                       "instead of %d", now_at, engine.stop_at)
        engine.stop_at = now_at
        self.notices[-1]["iteration"] = now_at
        write_notice_record(self.store, notice_record(self.notices, generation=self.generation(),
                                                      stop_at=now_at, stopped_at=None))

    def persist_route(self, *, run: str, node_id: str, nodes: list[str]) -> Any:
        """Another node's agent to persist from when ``node_id`` is draining, else None (own)."""
        if self.watcher is None or node_id not in self.watcher.draining():
            return None
        draining = self.watcher.draining()
        live = agents.live_agents(run)
        for node in dict.fromkeys(nodes):
            if node not in draining and node in live:
                return live[node]
        return None

    def stop_and_wait(self, engine: Any) -> None:
        """Make the stop checkpoint durable (rank 0), then block until the group is torn down:
        returning would end the run as finished, raising would count as a failure.
        ``every_rank_flushes`` (a sharded state): every rank writes its part of the stop
        checkpoint first; rank 0's flush waits for the global commit."""
        if self.every_rank_flushes and self.rank != 0:
            engine.flush()
        if self.rank == 0:
            engine.flush()
            record = self.notices[-1] if self.notices else {}
            record["committed_s"] = time.time()
            if record.get("deadline_s"):
                record["committed_before_deadline_s"] = record["deadline_s"] - record["committed_s"]
            write_notice_record(self.store, notice_record(self.notices, generation=self.generation(),
                                                          stop_at=engine.iteration, stopped_at=engine.iteration))
            logger.warning("preemption: iteration %d is durable; waiting for the restart", engine.iteration)
        while True:
            time.sleep(1.0)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
