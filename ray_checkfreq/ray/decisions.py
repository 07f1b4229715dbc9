"""One decision per iteration for every rank: rank 0 plans, all ranks apply it one step later.

At step i every rank hands the action rank 0 planned for iteration i+1 to its decision
thread, which broadcasts it (from rank 0, on a dedicated gloo group), and picks up the
broadcast handed over at step i-1, which carries the action for iteration i. No rank waits
for rank 0's planning, and every rank applies the same (k, checkpoint now, stop) at the same
iteration, so no rank enters a collective that another skips.

The broadcasts run on that thread, not posted asynchronously from the training thread:
posting a gloo operation costs the caller ~0.1 ms of CPU (measured on 2 ranks), every
iteration; a hand-over through a queue costs microseconds. The thread issues the group's
collectives in the order they were handed over, and nothing else uses the group.

At an iteration that applies a checkpoint, the next broadcast is handed over after the
snapshot (the engine calls ``hand_over``): woken at once, the thread's Python work held
the GIL for ~0.3 ms of the snapshot's critical path (2 ranks on 2 cores); handed over a
millisecond later it still has a whole iteration to complete.

Invariant: every rank calls ``exchange`` exactly once per iteration and ``close`` once.

The wire format is here too: an ``Action`` (the engine's value type) travels as
``ACTION_INTS`` int64 values (``to_ints`` / ``from_ints``); docs/ray.md quotes it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ray_checkfreq.engine.seams import CODECS, Action

ACTION_INTS = 5  # present, iteration, flags, codec, k
CLOSE_TIMEOUT_S = 30.0  # the thread's last broadcast is complete by then; a stuck one is a daemon
NO_ACTION_INTS: tuple[int, ...] = (0,) * ACTION_INTS
_CHECKPOINT, _EPOCH_BOUNDARY, _STOP = 1, 2, 4
_ALL_FLAGS = _CHECKPOINT | _EPOCH_BOUNDARY | _STOP


def to_ints(action: Action) -> list[int]:
    """``ACTION_INTS`` int64 values (-1 for None; the codec by its index in ``CODECS``);
    ``from_ints`` inverts it."""
    flags = (_CHECKPOINT * action.checkpoint) | (_EPOCH_BOUNDARY * action.epoch_boundary) | (_STOP * action.stop)
    codec = -1 if action.codec is None else CODECS.index(action.codec)
    return [1, action.iteration, flags, codec, -1 if action.k is None else action.k]


def from_ints(values: Sequence[int]) -> Action | None:
    """The action ``to_ints`` encoded, or None for ``NO_ACTION_INTS``."""
    ints = [int(v) for v in values]
    if len(ints) != ACTION_INTS:
        raise ValueError(f"an encoded action has {ACTION_INTS} ints, got {len(ints)}: {ints}")
    present, iteration, flags, codec, k = ints
    if present == 0:
        return None
    if present != 1 or not 0 <= flags <= _ALL_FLAGS or not -1 <= codec < len(CODECS) or k == 0 or k < -1:
        raise ValueError(f"not an encoded action: {ints}")
    return Action(iteration=iteration, checkpoint=bool(flags & _CHECKPOINT),
                  epoch_boundary=bool(flags & _EPOCH_BOUNDARY), stop=bool(flags & _STOP),
                  codec=None if codec == -1 else CODECS[codec], k=None if k == -1 else k)


class BroadcastDecisions:
    lookahead = 1

    def __init__(self, group: Any, rank: int) -> None:
        self.group = group
        self.is_planner = rank == 0
        self._outbox: queue.SimpleQueue[list[int] | None] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[list[int] | BaseException] = queue.SimpleQueue()
        self._pending = 0  # broadcasts handed over and not yet picked up (0 or 1)
        self._staged: list[int] | None = None  # the next broadcast, held back until hand_over()
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None  # started by the first exchange

    def exchange(self, planned: Action | None) -> Action | None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._broadcast_in_order, name="rcf-decisions", daemon=True)
            self._thread.start()
        self.hand_over()  # one still held (an engine that did not call hand_over) goes first
        received = self._finish_pending()
        self._staged = to_ints(planned) if (self.is_planner and planned is not None) else list(NO_ACTION_INTS)
        if received is None or not received.checkpoint:
            self.hand_over()
        return received

    def hand_over(self) -> None:
        """Start the broadcast the last ``exchange`` held back (nothing when none is)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            self._outbox.put(staged)
            self._pending += 1

    def _finish_pending(self) -> Action | None:
        if self._failed is not None:
            raise RuntimeError("the decision broadcast failed") from self._failed
        if not self._pending:
            return None
        received = self._inbox.get()
        self._pending -= 1
        if isinstance(received, BaseException):
            self._failed = received
            raise RuntimeError("the decision broadcast failed") from received
        return from_ints(received)

    def _broadcast_in_order(self) -> None:
        while (values := self._outbox.get()) is not None:
            try:
                tensor = torch.tensor(values, dtype=torch.int64)
                dist.broadcast(tensor, src=0, group=self.group)
                self._inbox.put(tensor.tolist())
            except BaseException as err:  # a peer died: the training thread raises it at its next exchange
                self._inbox.put(err)
                return

    def close(self) -> None:
        """Complete the last broadcast (every rank started it; none may leave it pending),
        then end the thread."""
        if self._thread is None:
            return
        try:
            if self._failed is None:
                self.hand_over()
                self._finish_pending()
        finally:
            self._outbox.put(None)
            self._thread.join(timeout=CLOSE_TIMEOUT_S)


__all__ = ["ACTION_INTS", "NO_ACTION_INTS", "BroadcastDecisions", "from_ints", "to_ints"]
