"""Adaptive checkpoint rate: raise k under pressure, lower it again when pressure goes.

Overhead is measured per window (at least ``window_iters`` iterations and three
checkpoints) as stall seconds over the seconds training would have taken without them.
It is also measured as the window's iteration-time inflation against its quiet
iterations (those with no checkpoint work in flight), or against ``reference_iter_s``
(profiled without checkpoints) when too few were quiet; the larger figure counts. That
catches the cores a background persist takes from training on a CPU-only machine, and
a quiet reference from the same window follows drifts in the iteration time.
Above p, k grows to the value predicted to bring overhead to ``raise_to * p`` (at most
doubling per window); below ``lower_below * p`` for ``patience`` windows in a row, k
shrinks to the value predicted to bring it to ``lower_to * p`` (at most halving), never
below ``k_floor``. Pauses (an iteration whose time outside checkpoint stalls is
``pause_factor`` times the window's median: evaluation, a data stall) are left out. The dead band between
``lower_below * p`` and p is the hysteresis that keeps k from oscillating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    window_iters: int = 50
    min_checkpoints_per_window: int = 2
    raise_to: float = 0.8
    lower_below: float = 0.5
    lower_to: float = 0.7
    patience: int = 2
    max_raise_factor: float = 2.0
    max_lower_factor: float = 2.0
    pause_factor: float = 5.0
    min_quiet_iters: int = 5
    k_max: int = 1_000_000

    def __post_init__(self) -> None:
        if self.window_iters < 1 or self.min_checkpoints_per_window < 1 or self.patience < 1:
            raise ValueError("window_iters, min_checkpoints_per_window and patience must be >= 1")
        if not 0 < self.lower_below < self.lower_to < 1 or not 0 < self.raise_to <= 1:
            raise ValueError(
                f"need 0 < lower_below ({self.lower_below}) < lower_to ({self.lower_to}) < 1 "
                f"and 0 < raise_to ({self.raise_to}) <= 1"
            )


class AdaptiveRate:
    """Feed it every iteration's time and stall; it returns a new k when k should change."""

    def __init__(self, *, k: int, k_floor: int, overhead: float, config: AdaptiveConfig | None = None,
                 reference_iter_s: float | None = None) -> None:
        if k < 1 or k_floor < 1:
            raise ValueError(f"k={k} and k_floor={k_floor} must be >= 1")
        self.k = max(k, k_floor)
        self.k_floor = k_floor
        self.overhead = overhead
        self.config = config or AdaptiveConfig()
        self.reference_iter_s = reference_iter_s
        self.last_overhead: float | None = None
        self.history: list[tuple[float, int]] = []  # (window overhead, k after the window)
        self._quiet_windows = 0
        self._reset_window()

    def restart_at(self, k: int, *, k_floor: int | None = None) -> None:
        """k (and its floor) set from outside; the window so far measured the old k."""
        if k_floor is not None:
            if k_floor < 1:
                raise ValueError(f"k_floor={k_floor}: must be >= 1")
            self.k_floor = k_floor
        if k < 1:
            raise ValueError(f"k={k}: must be >= 1")
        self.k = max(k, self.k_floor)
        self._quiet_windows = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self._samples: list[tuple[float, float, bool]] = []

    def record(self, iter_s: float, stall_s: float, busy: bool = True) -> int | None:
        """One iteration: its wall time, its stall, and whether checkpoint work was in flight."""
        self._samples.append((iter_s, stall_s, busy))
        needed = max(self.config.window_iters, self.config.min_checkpoints_per_window * self.k)
        if len(self._samples) < needed:
            return None
        self._summarise_window()
        useful_s = max(self._iter_s - self._stall_s, 1e-12)
        measured = self._stall_s / useful_s
        reference = self._reference_iter_s()
        if reference:
            expected_s = self._iters * reference
            measured = max(measured, (self._iter_s - expected_s) / expected_s)
        self._reset_window()
        self.last_overhead = measured
        new_k = self._next_k(measured)
        self.history.append((measured, new_k))
        if new_k == self.k:
            return None
        self.k = new_k
        return new_k

    def _summarise_window(self) -> None:
        """Totals over the window, leaving out pauses: iterations whose time outside
        checkpoint stalls is ``pause_factor`` times the median (evaluation, a data stall)."""
        work = sorted(i - s for i, s, _ in self._samples)
        limit = self.config.pause_factor * work[len(work) // 2]
        kept = [(i, s, b) for i, s, b in self._samples if i - s <= limit]
        self._iters = len(kept)
        self._iter_s = sum(i for i, _, _ in kept)
        self._stall_s = sum(s for _, s, _ in kept)
        self._quiet = [i for i, _, b in kept if not b]

    def _reference_iter_s(self) -> float | None:
        if len(self._quiet) >= self.config.min_quiet_iters:
            return sum(self._quiet) / len(self._quiet)
        return self.reference_iter_s

    def _next_k(self, measured: float) -> int:
        p = self.overhead
        if measured > p:
            self._quiet_windows = 0
            factor = min(measured / (self.config.raise_to * p), self.config.max_raise_factor)
            return min(self.config.k_max, max(self.k + 1, math.ceil(self.k * factor)))
        if measured < self.config.lower_below * p and self.k > self.k_floor:
            self._quiet_windows += 1
            if self._quiet_windows >= self.config.patience:
                self._quiet_windows = 0
                factor = max(measured / (self.config.lower_to * p), 1 / self.config.max_lower_factor)
                return max(self.k_floor, min(self.k - 1, math.ceil(self.k * factor)))
            return self.k
        self._quiet_windows = 0
        return self.k
