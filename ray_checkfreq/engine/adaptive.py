"""Adaptive checkpoint rate: raise k under pressure, lower it again when pressure goes.

Overhead is measured per window (at least ``window_iters`` iterations and three
checkpoints) as stall seconds over the seconds training would have taken without them.
Above p, k grows to the value predicted to bring overhead to ``raise_to * p``; below
``lower_below * p`` for ``patience`` windows in a row, k shrinks to the value predicted
to bring it to ``lower_to * p``, never below ``k_floor``. The dead band between
``lower_below * p`` and p is the hysteresis that keeps k from oscillating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    window_iters: int = 50
    min_checkpoints_per_window: int = 3
    raise_to: float = 0.8
    lower_below: float = 0.5
    lower_to: float = 0.7
    patience: int = 2
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

    def __init__(self, *, k: int, k_floor: int, overhead: float, config: AdaptiveConfig | None = None) -> None:
        if k < 1 or k_floor < 1:
            raise ValueError(f"k={k} and k_floor={k_floor} must be >= 1")
        self.k = max(k, k_floor)
        self.k_floor = k_floor
        self.overhead = overhead
        self.config = config or AdaptiveConfig()
        self.last_overhead: float | None = None
        self.history: list[tuple[float, int]] = []  # (window overhead, k after the window)
        self._quiet_windows = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self._iters = 0
        self._iter_s = 0.0
        self._stall_s = 0.0

    def record(self, iter_s: float, stall_s: float) -> int | None:
        self._iters += 1
        self._iter_s += iter_s
        self._stall_s += stall_s
        needed = max(self.config.window_iters, self.config.min_checkpoints_per_window * self.k)
        if self._iters < needed:
            return None
        useful_s = max(self._iter_s - self._stall_s, 1e-12)
        measured = self._stall_s / useful_s
        self._reset_window()
        self.last_overhead = measured
        new_k = self._next_k(measured)
        self.history.append((measured, new_k))
        if new_k == self.k:
            return None
        self.k = new_k
        return new_k

    def _next_k(self, measured: float) -> int:
        p = self.overhead
        if measured > p:
            self._quiet_windows = 0
            target = math.ceil(self.k * measured / (self.config.raise_to * p))
            return min(self.config.k_max, max(self.k + 1, target))
        if measured < self.config.lower_below * p and self.k > self.k_floor:
            self._quiet_windows += 1
            if self._quiet_windows >= self.config.patience:
                self._quiet_windows = 0
                target = math.ceil(self.k * measured / (self.config.lower_to * p))
                return max(self.k_floor, min(self.k - 1, target))
            return self.k
        self._quiet_windows = 0
        return self.k
