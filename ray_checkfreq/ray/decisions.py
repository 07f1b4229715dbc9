"""One decision per iteration for every rank: rank 0 plans, all ranks apply it one step later.

At step i every rank starts an asynchronous broadcast (from rank 0, on a dedicated gloo
group) of the action rank 0 planned for iteration i+1, and waits for the broadcast started
at step i-1, which carries the action for iteration i. No rank waits for rank 0's planning,
and every rank applies the same (k, checkpoint now, stop) at the same iteration, so no rank
enters a collective that another skips.

Invariant: every rank calls ``exchange`` exactly once per iteration and ``close`` once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ray_checkfreq.engine.seams import ACTION_INTS, NO_ACTION_INTS, Action


class BroadcastDecisions:
    lookahead = 1

    def __init__(self, group: Any, rank: int) -> None:
        self.group = group
        self.is_planner = rank == 0
        self._pending: tuple[Any, torch.Tensor] | None = None

    def exchange(self, planned: Action | None) -> Action | None:
        received = self._finish_pending()
        values = planned.to_ints() if (self.is_planner and planned is not None) else list(NO_ACTION_INTS)
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
        return Action.from_ints(tensor.tolist())

    def close(self) -> None:
        """Complete the last broadcast (every rank started it; none may leave it pending)."""
        self._finish_pending()


__all__ = ["ACTION_INTS", "BroadcastDecisions"]
