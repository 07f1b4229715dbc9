"""Step shares under a changing quorum: every sample of a step once, whoever takes part.

For in-place recovery (torchft replica groups), the replicas that take part in a step
change from step to step. The data is therefore addressed by step, not by rank:

- Step ``s``'s global batch is a pure function of ``s`` (with the seed, the dataset size,
  the fixed global batch size ``G`` and ``drop_last``): epoch ``s // S`` and epoch
  positions ``[k*G, min((k+1)*G, N))`` with ``k = s % S``, ``S`` the steps per epoch. These
  are the positions the lockstep iterator (``core``) gives global batch ``k`` of that
  epoch, so the two modes read the same global batches.
- The ``size`` participants of the step split those ``n`` positions by their rank in the
  quorum into contiguous pieces of near-equal size (the first ``n % size`` take one
  more): the union is the global batch and no sample is taken twice, whatever ``size``.
- The position moves only on ``commit(s)``: a step that does not commit is fetched again,
  with the same samples (split over whoever takes part then).
- The state is the committed step, written as the usual iterator state (epoch, consumed)
  plus ``step``: a healed replica loads it from a live peer with the weights.

A share's ``weight`` is its size over the step's: sum_i weight_i * mean_loss_i is the
mean loss over the global batch. An allreduce that averages over ``size`` participants
(torchft's ``Manager.allreduce``, DDP) therefore needs each loss scaled by
``loss_scale = weight * size``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_checkfreq.data.core import DataState, DataStateError
from ray_checkfreq.data.iterator import ResumableIterator
from ray_checkfreq.data.order import Order


@dataclass(frozen=True, kw_only=True)
class QuorumShare:
    """One participant's part of step ``step``'s global batch."""

    step: int
    epoch: int
    rank: int
    """This participant's rank in the step's quorum."""
    size: int
    """How many participants the step has."""
    lo: int
    hi: int
    """This share is epoch positions [lo, hi)."""
    step_samples: int
    """Samples in the step's whole global batch (G, or fewer in an epoch's last step)."""
    indices: np.ndarray
    """Global sample indices of this share (int64; empty when size > step_samples)."""

    @property
    def weight(self) -> float:
        """This share's part of the global batch: the weights of a step's shares sum to 1."""
        return (self.hi - self.lo) / self.step_samples

    @property
    def loss_scale(self) -> float:
        """Multiply the share's mean loss by this before an allreduce that averages over ``size``."""
        return self.weight * self.size


class QuorumSteps:
    """Step shares of a resumable iterator built with a fixed ``global_batch_size``.

    The iterator gives the dataset, the seed, the order and ``G``; its position is where
    the steps start. Its own rank and world size play no part: each ``fetch`` names the
    quorum. Save this object's ``state_dict()`` (not the iterator's) after each commit.
    """

    def __init__(self, iterator: ResumableIterator) -> None:
        global_batch = iterator.sharding.fixed_global_batch
        if global_batch is None:
            raise ValueError(
                f"QuorumSteps needs a fixed global batch, got an iterator with per-rank batch_size="
                f"{iterator.sharding.batch_size}: build it with resumable(..., global_batch_size=G)")
        self._iterator = iterator
        self.global_batch_size = global_batch
        self.num_samples = iterator.num_samples
        n, g = self.num_samples, global_batch
        self.steps_per_epoch = n // g if iterator.sharding.drop_last else -(-n // g)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"an epoch of {n} samples holds no step of global_batch_size={g} (drop_last="
                f"{iterator.sharding.drop_last}): use a smaller global batch or more samples")
        self._orders: dict[int, Order] = {}
        self._step = self._step_at(iterator.epoch, iterator.consumed)

    @property
    def step(self) -> int:
        """Committed steps: the step that ``fetch`` returns next."""
        return self._step

    def positions(self, step: int) -> tuple[int, int, int]:
        """(epoch, lo, hi): step ``step``'s global batch is epoch positions [lo, hi)."""
        step = _integer("step", step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, k = divmod(step, self.steps_per_epoch)
        lo = k * self.global_batch_size
        return epoch, lo, min(lo + self.global_batch_size, self.num_samples)

    def share(self, step: int, *, rank: int, size: int) -> QuorumShare:
        """Participant ``rank`` of ``size``'s share of step ``step``: a pure function of its arguments."""
        rank, size = _quorum(rank, size)
        epoch, lo, hi = self.positions(step)
        start, end = _piece(lo, hi, rank, size)
        return QuorumShare(step=int(step), epoch=epoch, rank=rank, size=size, lo=start, hi=end, step_samples=hi - lo,
                           indices=self._order(epoch).take(start, end))

    def fetch(self, *, rank: int, size: int) -> QuorumShare:
        """The share of the next uncommitted step; the same samples until ``commit``."""
        return self.share(self._step, rank=rank, size=size)

    def commit(self, step: int) -> None:
        """Step ``step`` committed (e.g. torchft's ``should_commit()`` returned True): move on."""
        if _integer("step", step) != self._step:
            raise ValueError(
                f"commit({step!r}): the next uncommitted step is {self._step}; commit each step once, in order")
        self._step += 1

    def state_dict(self) -> dict[str, Any]:
        epoch, lo, _ = self.positions(self._step)
        return {**self._iterator._state(epoch, lo).to_dict(), "step": self._step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved committed step (a healed replica: the state of a live peer)."""
        parsed = DataState.from_dict(state, expect=self._iterator._state(0, 0))
        step = self._step_at(parsed.epoch, parsed.consumed)
        if "step" in state and state["step"] != step:
            expected = f"{step} (epoch {parsed.epoch}, consumed {parsed.consumed})"
            raise DataStateError("step", state["step"], expected)
        if parsed.version != self._iterator.order_version:
            self._iterator.order_version = parsed.version
            self._orders.clear()
        self._step = step

    def _step_at(self, epoch: int, consumed: int) -> int:
        if consumed % self.global_batch_size:
            raise DataStateError("consumed", consumed, f"a multiple of global_batch_size={self.global_batch_size}")
        return epoch * self.steps_per_epoch + consumed // self.global_batch_size

    def _order(self, epoch: int) -> Order:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # steps move forward: keep this epoch's order and the next
                del self._orders[min(self._orders)]
            self._orders[epoch] = self._iterator._order(epoch)
        return self._orders[epoch]


def _integer(name: str, value: Any) -> int:
    """``value`` as an int (a numpy integer too); bools and floats are refused."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _quorum(rank: Any, size: Any) -> tuple[int, int]:
    rank, size = _integer("quorum rank", rank), _integer("quorum size", size)
    if size < 1:
        raise ValueError(f"quorum size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"quorum rank must be in [0, {size}), got {rank}")
    return rank, size


def _piece(lo: int, hi: int, rank: int, size: int) -> tuple[int, int]:
    """Participant ``rank``'s piece of [lo, hi) split ``size`` ways (the first (hi - lo) % size one
    longer): the pieces tile [lo, hi) in rank order."""
    q, extra = divmod(hi - lo, size)
    start = lo + rank * q + min(rank, extra)
    return start, start + q + (1 if rank < extra else 0)
