"""The overhead checkpoints really caused, measured from iteration times. Pure math.

For a stretch of iterations (a window or a block), each with its wall time, its stall
(waits for checkpoint work inside ``step()`` and at the fence) and whether checkpoint
work was in flight during it:

    pause  = an iteration whose time outside stalls is ``pause_factor`` x the median quiet
             one or more (evaluation, a data stall): its stall counts, its time does not
    ref    = the mean quiet iteration (no checkpoint work, no stall), pauses left out;
             a fallback (the profiled Ti) when too few were quiet
    lost   = sum of the stalls + busy iterations x max(0, mean(time - stall) - ref)
    total  = the stretch's time;  overhead = lost / (total - lost)

The median decides what a pause is; the cost compares means, busy against quiet, in the
same stretch: on a loaded machine iteration times are skewed (measured at 5 ms
iterations: median 5.8 ms, mean 6.5 ms), and a median-against-median shift missed what
the wall clock pays for that skew, by 10 points and more. Noise that hits busy and quiet
iterations alike cancels out on average; its spread is in the standard error. Stalls
count in full: they are checkpoint work by construction. ``overhead`` is the slowdown
against the same training without checkpoints, the unit of the budget p;
``share = lost / total`` is the fraction of wall time, in [0, 1].

The uncertainty is the standard error of the busy iterations' excess and of the
reference (times the busy iterations it is subtracted from).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Sample = tuple[float, float, bool]  # (iteration seconds, stall seconds, checkpoint work in flight)
# A pause is 10x the quiet iteration, not 5x: a persist's commit that held the interpreter
# stretched a busy 16 ms iteration to 93 ms (5.8x), checkpoint cost a 5x limit left out.
PAUSE_FACTOR = 10.0

@dataclass(frozen=True)
class Stretch:
    """What one stretch of iterations cost: seconds lost, seconds in all, the variance of lost."""

    lost_s: float = 0.0
    total_s: float = 0.0
    var_s2: float = 0.0
    iterations: int = 0
    reference_s: float | None = None
    largest_stall_s: float = 0.0  # the largest single stall in it (one event: a persist's heavy tail)

    def __add__(self, other: Stretch) -> Stretch:
        return Stretch(self.lost_s + other.lost_s, self.total_s + other.total_s, self.var_s2 + other.var_s2,
                       self.iterations + other.iterations, other.reference_s or self.reference_s,
                       max(self.largest_stall_s, other.largest_stall_s))

    @property
    def overhead(self) -> float:
        """Slowdown against no checkpoints (the unit of p); 0 when nothing was measured."""
        useful = self.total_s - self.lost_s
        return max(0.0, self.lost_s) / useful if useful > 0 else 0.0

    @property
    def overhead_without_largest_stall(self) -> float:
        """``overhead`` with the largest single stall left out: what no one event decided."""
        useful = self.total_s - self.lost_s
        return max(0.0, self.lost_s - self.largest_stall_s) / useful if useful > 0 else 0.0

    @property
    def error(self) -> float:
        """One standard error of ``overhead``."""
        useful = self.total_s - self.lost_s
        return math.sqrt(self.var_s2) / useful if useful > 0 else 0.0

    @property
    def share(self) -> float:
        """The fraction of wall time checkpoints took, in [0, 1]."""
        return min(1.0, max(0.0, self.lost_s) / self.total_s) if self.total_s > 0 else 0.0


def as_share(overhead: float) -> float:
    """A slowdown (the unit of p) as the fraction of wall time it is: o / (1 + o), in [0, 1)."""
    return max(0.0, overhead) / (1.0 + max(0.0, overhead))


def measure(samples: Sequence[Sample], *, fallback_ref_s: float | None = None, pause_factor: float = PAUSE_FACTOR,
            min_quiet: int = 5) -> Stretch:
    """What checkpoints cost over ``samples`` (see the module's doc)."""
    if not samples:
        return Stretch()
    quiet = [t for t, s, busy in samples if not busy and s == 0]
    typical = _typical(quiet, samples, fallback_ref_s, min_quiet)
    limit = pause_factor * typical
    kept = [(t, s, busy) for t, s, busy in samples if t - s < limit]
    ref, ref_se = _reference([t for t in quiet if t < limit], typical, min_quiet)
    busy_work = [t - s for t, s, busy in kept if busy or s > 0]
    # Checkpoint work never makes training faster: busy iterations faster on average than
    # the quiet ones are drift or noise (say, the slow first iterations after a start are
    # the only quiet ones while a persist is nearly always in flight), not a saving.
    excess = max(0.0, statistics.fmean(busy_work) - ref) if busy_work else 0.0
    lost = sum(s for _, s, _ in samples) + len(busy_work) * excess
    total = sum(t for t, _, _ in kept) + sum(s for t, s, _ in samples if t - s >= limit)
    var = len(busy_work) * _variance(busy_work) + (len(busy_work) * ref_se) ** 2
    return Stretch(lost, total, var, len(kept), ref, max((s for _, s, _ in samples), default=0.0))


def _typical(quiet: list[float], samples: Sequence[Sample], fallback_ref_s: float | None, min_quiet: int) -> float:
    """The median quiet iteration (what a pause is measured against): the window's own
    quiet iterations, else the fallback (a profiled Ti), else the median time outside stalls."""
    if len(quiet) >= min_quiet:
        return statistics.median(quiet)
    if fallback_ref_s is not None and fallback_ref_s > 0:
        return fallback_ref_s
    return statistics.median(t - s for t, s, _ in samples)


def _reference(quiet: list[float], typical: float, min_quiet: int) -> tuple[float, float]:
    """The mean quiet iteration, pauses left out, and its standard error (``typical``, taken
    as exact, when too few were quiet)."""
    if len(quiet) >= min_quiet:
        return statistics.fmean(quiet), math.sqrt(_variance(quiet) / len(quiet))
    return typical, 0.0


def _variance(values: list[float]) -> float:
    return statistics.variance(values) if len(values) >= 2 else 0.0


class RunOverhead:
    """The measured overhead of a whole run, block by block (each block's quiet iterations
    are its reference, so a drifting iteration time is followed)."""

    def __init__(self, *, block_iters: int = 100, pause_factor: float = PAUSE_FACTOR, min_quiet: int = 5) -> None:
        self.block_iters = block_iters
        self.pause_factor = pause_factor
        self.min_quiet = min_quiet
        self.fallback_ref_s: float | None = None
        self.total = Stretch()
        self._block: list[Sample] = []
        self._quiet_in_block = 0

    def record(self, iter_s: float, stall_s: float, busy: bool) -> None:
        self._block.append((iter_s, stall_s, busy))
        self._quiet_in_block += not busy and stall_s == 0
        full = len(self._block) >= self.block_iters
        if full and (self._quiet_in_block >= self.min_quiet or len(self._block) >= 4 * self.block_iters):
            self._close_block()

    def _close_block(self) -> None:
        stretch = measure(self._block, fallback_ref_s=self.fallback_ref_s, pause_factor=self.pause_factor,
                          min_quiet=self.min_quiet)
        self.total = self.total + stretch
        if self._quiet_in_block >= self.min_quiet:
            self.fallback_ref_s = stretch.reference_s
        self._block, self._quiet_in_block = [], 0

    def current(self) -> Stretch:
        """The closed blocks plus the open one."""
        if not self._block:
            return self.total
        return self.total + measure(self._block, fallback_ref_s=self.fallback_ref_s, pause_factor=self.pause_factor,
                                    min_quiet=self.min_quiet)
