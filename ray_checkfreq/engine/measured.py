"""The overhead checkpoints really caused, measured from iteration times. Pure math.

For a stretch of iterations (a window or a block), each with its wall time, its stall
(waits for checkpoint work inside ``step()`` and at the fence) and whether checkpoint
work was in flight during it:

    ref    = median of the quiet iterations (no checkpoint work, no stall), or a fallback
    excess = median over the busy iterations of (time - stall - ref)
    lost   = sum of the stalls + busy iterations x excess
    total  = the stretch's time;  overhead = lost / (total - lost)

Medians, not means: a burst of noise (another process, a data stall) that lands on a
busy iteration is not counted as checkpoint cost, nor one on a quiet iteration as
saved time. Stalls count in full: they are checkpoint work by construction. Iterations
whose time outside stalls is ``pause_factor`` x ref or more (evaluation, a data stall)
are pauses: their stalls count, their time does not. ``overhead`` is the slowdown
against the same training without checkpoints, the unit of the budget p;
``share = lost / total`` is the fraction of wall time, in [0, 1].

The uncertainty is the standard error of the two medians (1.2533 x 1.4826 x MAD / sqrt(n)
each), scaled by the busy iterations they multiply.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Sample = tuple[float, float, bool]  # (iteration seconds, stall seconds, checkpoint work in flight)

_MEDIAN_SE = 1.2533 * 1.4826  # standard error of a median, in units of MAD / sqrt(n), for normal noise


@dataclass(frozen=True)
class Stretch:
    """What one stretch of iterations cost: seconds lost, seconds in all, the variance of lost."""

    lost_s: float = 0.0
    total_s: float = 0.0
    var_s2: float = 0.0
    iterations: int = 0
    reference_s: float | None = None

    def __add__(self, other: Stretch) -> Stretch:
        return Stretch(self.lost_s + other.lost_s, self.total_s + other.total_s, self.var_s2 + other.var_s2,
                       self.iterations + other.iterations, other.reference_s or self.reference_s)

    @property
    def overhead(self) -> float:
        """Slowdown against no checkpoints (the unit of p); 0 when nothing was measured."""
        useful = self.total_s - self.lost_s
        return max(0.0, self.lost_s) / useful if useful > 0 else 0.0

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


def measure(samples: Sequence[Sample], *, fallback_ref_s: float | None = None, pause_factor: float = 5.0,
            min_quiet: int = 5) -> Stretch:
    """What checkpoints cost over ``samples`` (see the module's doc)."""
    if not samples:
        return Stretch()
    quiet = [t for t, s, busy in samples if not busy and s == 0]
    ref, ref_se = _reference(quiet, samples, fallback_ref_s, min_quiet)
    kept = [(t, s, busy) for t, s, busy in samples if t - s < pause_factor * ref]
    stall = sum(s for t, s, _ in samples)
    excess = [t - s - ref for t, s, busy in kept if busy or s > 0]
    if excess:
        median_excess = statistics.median(excess)
        excess_se = _median_se(excess)
    else:
        median_excess = excess_se = 0.0
    lost = stall + len(excess) * median_excess
    total = sum(t for t, _, _ in kept) + sum(s for t, s, _ in samples if t - s >= pause_factor * ref)
    var = (len(excess) * excess_se) ** 2 + (len(excess) * ref_se) ** 2
    return Stretch(lost, total, var, len(kept), ref)


def _reference(quiet: list[float], samples: Sequence[Sample], fallback_ref_s: float | None,
               min_quiet: int) -> tuple[float, float]:
    """The quiet iteration time and its standard error: the window's own quiet iterations,
    else the fallback (a profiled Ti), else the median time outside stalls (no inflation)."""
    if len(quiet) >= min_quiet:
        return statistics.median(quiet), _median_se(quiet)
    if fallback_ref_s is not None and fallback_ref_s > 0:
        return fallback_ref_s, 0.0
    return statistics.median(t - s for t, s, _ in samples), 0.0


def _median_se(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    center = statistics.median(values)
    mad = statistics.median(abs(v - center) for v in values)
    return _MEDIAN_SE * mad / math.sqrt(len(values))


class RunOverhead:
    """The measured overhead of a whole run, block by block (each block's quiet iterations
    are its reference, so a drifting iteration time is followed)."""

    def __init__(self, *, block_iters: int = 100, pause_factor: float = 5.0, min_quiet: int = 5) -> None:
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
