"""One outcome for every rank of a sharded restore.

A sharded step is read rank by rank: each rank reads and checks only its own boxes, so a
damaged byte may fail one rank's read and not another's. A rank that raised while the
others went on into the load's collectives (or the training's) would leave them waiting
forever, and a rank that fell back alone would train from another step. So every rank
first does its local part (read, check, fill its targets: ``RankAgreement.run``), then
all of them exchange one small code (an all-gather on a gloo group) and act on the worst:

- every rank ready: all go on into the collective load;
- some rank's part damaged (``CorruptCheckpointError``): every rank raises one, so a
  restore that falls back past damage moves to the same older step on every rank;
- some rank failed otherwise: every rank raises (its own error, or ``PeerRestoreError``
  naming the ranks that failed), and nothing falls back.

The step and the writer generation come from rank 0 the same way (``from_rank0``): a
rank 0 that fails to choose makes every rank raise rather than wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ray_checkfreq.errors import CheckFreqError, CorruptCheckpointError

T = TypeVar("T")

READY, DAMAGED, FAILED = 0, 1, 2  # ordered: the worst code of any rank decides


class PeerRestoreError(CheckFreqError, RuntimeError):
    """Another rank failed (not with damage) in the restore step every rank was taking;
    this rank stops with it. That rank's own error names the cause."""

    def __init__(self, where: str, ranks: Sequence[int], world_size: int) -> None:
        super().__init__(where, list(ranks), world_size)
        self.where, self.ranks, self.world_size = where, list(ranks), world_size

    def __str__(self) -> str:
        return (f"{self.where}: rank(s) {self.ranks} of {self.world_size} failed there (see their errors); "
                "every rank stops with them")


def outcome_code(error: BaseException | None) -> int:
    """READY, DAMAGED (a CorruptCheckpointError: the restore may fall back past it) or FAILED."""
    if error is None:
        return READY
    return DAMAGED if isinstance(error, CorruptCheckpointError) else FAILED


def settle(error: Exception | None, codes: Sequence[int], *, where: str) -> None:
    """What this rank does given its own ``error`` and every rank's code (``codes``, in
    rank order): return when every rank is READY, else raise as the module says."""
    worst = max(codes)
    if worst == READY:
        return
    own = outcome_code(error)
    if error is not None and own == worst:
        raise error
    failed = [rank for rank, code in enumerate(codes) if code == worst]
    if worst == DAMAGED:
        raise CorruptCheckpointError(where, f"rank(s) {failed} of {len(codes)} found their part damaged; "
                                            "every rank falls back with them") from error
    raise PeerRestoreError(where, failed, len(codes)) from error


@dataclass(frozen=True)
class RankAgreement:
    """The restore's agreement among ``world_size`` ranks over ``group`` (a gloo group of
    every rank; unused with one rank). Every rank calls the same methods in the same order."""

    rank: int
    world_size: int
    group: Any = None

    def run(self, local: Callable[[], T], *, where: str) -> T:
        """``local()`` on this rank (no collective in it), then one exchange: its value on
        every rank when every rank's ``local`` returned, else every rank raises."""
        try:
            value = local()
        except Exception as err:
            self._settle(err, where)
            raise  # not reached: settle raises for a failed rank
        self._settle(None, where)
        return value

    def from_rank0(self, produce: Callable[[], Sequence[int]], *, where: str) -> list[int]:
        """``produce()`` of rank 0 (ints), on every rank; when it raises there, rank 0
        raises its error and every other rank a PeerRestoreError."""
        if self.world_size == 1:
            return [int(v) for v in produce()]
        mine: list[int] = []
        failure: Exception | None = None
        if self.rank == 0:
            try:
                mine = [READY, *(int(v) for v in produce())]
            except Exception as err:
                failure, mine = err, [FAILED]
        got = _broadcast_ints(mine, rank=self.rank, group=self.group)
        if failure is not None:
            raise failure
        if got[0] != READY:
            raise PeerRestoreError(where, [0], self.world_size)
        return got[1:]

    def _settle(self, error: Exception | None, where: str) -> None:
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        settle(error, _all_gather_int(outcome_code(error), world_size=self.world_size, group=self.group),
               where=where)


def _all_gather_int(value: int, *, world_size: int, group: Any) -> list[int]:
    import torch.distributed as dist

    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([value], dtype=torch.int64), group=group)
    return [int(t.item()) for t in gathered]


def _broadcast_ints(values: Sequence[int], *, rank: int, group: Any) -> list[int]:
    """Rank 0's ints on every rank (a broadcast of their count, then of them)."""
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0) if group is not None else 0
    count = torch.tensor([len(values) if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(count, src=src, group=group)
    data = torch.tensor(list(values), dtype=torch.int64) if rank == 0 else torch.zeros(int(count.item()),
                                                                                         dtype=torch.int64)
    dist.broadcast(data, src=src, group=group)
    return [int(v) for v in data.tolist()]
