"""One decision per iteration for every rank: rank 0 plans, all ranks apply it one step later.

At step i every rank starts an asynchronous broadcast (from rank 0, on a dedicated gloo
group) of the action rank 0 planned for iteration i+1, and waits for the broadcast started
at step i-1, which carries the action for iteration i. No rank waits for rank 0's planning,
and every rank applies the same (k, checkpoint now, stop) at the same iteration, so no rank
enters a collective that another skips.

Invariant: every rank calls ``exchange`` exactly once per iteration and ``close`` once.

The wire format is here too: an ``Action`` (the engine's value type) travels as
``ACTION_INTS`` int64 values (``to_ints`` / ``from_ints``); docs/ray.md quotes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ray_checkfreq.engine.seams import CODECS, Action

ACTION_INTS = 5  # present, iteration, flags, codec, k
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
        self._pending: tuple[Any, torch.Tensor] | None = None

    def exchange(self, planned: Action | None) -> Action | None:
        received = self._finish_pending()
        values = to_ints(planned) if (self.is_planner and planned is not None) else list(NO_ACTION_INTS)
        tensor = torch.tensor(values, dtype=torch.int64)
        handle = dist.broadcast(tensor, src=0, group=self.group, async_op=True)
        self._pending = (handle, tensor)
        return received

    def _finish_pending(self) -> Action | None:
        if self._pending is None:
            return None
        handle, tensor = self._pending
        self._pending = None
        handle.wait()
        return from_ints(tensor.tolist())

    def close(self) -> None:
        """Complete the last broadcast (every rank started it; none may leave it pending)."""
        self._finish_pending()


__all__ = ["ACTION_INTS", "NO_ACTION_INTS", "BroadcastDecisions", "from_ints", "to_ints"]
