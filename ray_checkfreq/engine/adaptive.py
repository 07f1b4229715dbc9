"""Adaptive checkpoint rate: raise k under pressure, lower it again when pressure goes.

Overhead is measured per window (at least ``window_iters`` iterations and
``min_checkpoints_per_window`` checkpoints) by ``measured.measure``: the window's stalls
plus the inflation of its busy iterations against its quiet ones (or against
``reference_iter_s``, profiled without checkpoints, when too few were quiet), over the
time training would have taken without them. That catches the cores a background
persist takes from training on a CPU-only machine; a quiet reference from the same
window follows drifts.

k rises on the last ``patience`` to ``smooth_windows`` windows since it last changed, and
falls only on ``smooth_windows`` of them, pooled (their lost seconds over their useful
seconds): a rare slow persist counts for what it cost, spread over several windows,
instead of moving k on its own. Above p by more than ``confidence`` standard errors, k
grows to the value predicted to bring overhead to ``raise_to * p`` (at most
``max_raise_factor`` at once); below ``lower_below * p`` (by as much), k shrinks to the
value predicted to bring it to ``lower_to * p`` (at most by ``max_lower_factor``), never
below ``k_floor``, never above ``k_cap`` (the lost-work bound). The dead band between
``lower_below * p`` and p, the confidence margin and the pooling are the hysteresis that
keeps noise alone from swinging k (on the simulated noisy machine of
tests/test_engine_measured.py: within 2x).

Far above p, k moves in proportion instead: where even the lower end of the overhead
(``confidence`` standard errors below, the largest single stall left out) is above
``fast_raise_above * p``, k rises after one window, by that lower end over ``raise_to *
p`` (at most ``max_fast_raise_factor`` at once). A profile taken in one load state of a
noisy machine can be several times too small (bench overhead --noisy: measured 8-13 % at
p = 3.5 %), and 1.5x steps every two windows left most of a 900-iteration run above p.
The lower end keeps noise out: a merely noisy window has a wide error, and one persist's
heavy tail (one stall) is spread over windows as above. Only above the highest k held so
far: where k came down from higher, the cost is not proportional (a persist that outlasts
k makes every checkpoint wait: 20 % at k = 25 where k = 30 costs nothing), and k climbs
back in the damped steps.

Never below the persist: fed the persists' wall times (``record_persist``), k is never
lowered below ``persist_margin`` x the slowest of the last ``persist_memory`` persists, in
quiet iterations (the last window's reference). Below that point the next checkpoint
waits for the persist in flight, the wait shows as overhead far above p and k jumps back:
on a machine whose persists slowed after profiling k went 12 -> 10 -> 8 -> 12 -> ... with
the profile's persist bound as the only floor. Raising stays with the overhead: one
heavy-tailed persist does not move k up on its own.

Pauses (an iteration whose time outside stalls is ``pause_factor`` x the quiet one:
evaluation, a data stall) are left out.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ray_checkfreq.engine.measured import PAUSE_FACTOR, Sample, Stretch, measure


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    window_iters: int = 50
    """Iterations per adaptation window (at least ``min_checkpoints_per_window`` x k)."""
    min_checkpoints_per_window: int = 3
    """Checkpoints a window spans at least."""
    raise_to: float = 0.8
    """After an overhead above p, k is raised to aim at this fraction of p."""
    lower_below: float = 0.5
    """An overhead below this fraction of p lowers k ..."""
    lower_to: float = 0.7
    """... to aim at this fraction of p."""
    patience: int = 2
    """k rises on the pooled overhead of the last ``patience`` to ``smooth_windows`` windows since it last changed."""
    max_raise_factor: float = 1.5
    """k's largest step up (a factor)."""
    max_lower_factor: float = 1.25
    """k's largest step down (a factor)."""
    pause_factor: float = PAUSE_FACTOR
    """Iterations this many times the quiet one are pauses, left out of the figures."""
    min_quiet_iters: int = 5
    """Quiet iterations a window needs for its own reference."""
    k_max: int = 1_000_000
    """The largest k, in iterations."""
    confidence: float = 1.0
    """k changes only when the overhead is beyond the threshold by this many standard errors."""
    smooth_windows: int = 3
    """k falls only on this many windows (and rises on at most this many)."""
    fast_raise_above: float = 2.0
    """Overhead whose lower end (``confidence`` errors below) is above this many p raises k after one window ..."""
    max_fast_raise_factor: float = 3.0
    """... in proportion (lower end over ``raise_to * p``), at most by this factor."""
    persist_margin: float = 1.25
    """k is never lowered below this many times the slowest recent persist, in iterations ..."""
    persist_memory: int = 3
    """... of the last this many persists."""

    def __post_init__(self) -> None:
        if self.window_iters < 1 or self.min_checkpoints_per_window < 1 or self.patience < 1:
            raise ValueError("window_iters, min_checkpoints_per_window and patience must be >= 1")
        if self.smooth_windows < self.patience:
            raise ValueError(f"smooth_windows={self.smooth_windows}: must be >= patience ({self.patience})")
        if not 0 < self.lower_below < self.lower_to < 1 or not 0 < self.raise_to <= 1:
            raise ValueError(
                f"need 0 < lower_below ({self.lower_below}) < lower_to ({self.lower_to}) < 1 "
                f"and 0 < raise_to ({self.raise_to}) <= 1"
            )
        if not self.max_raise_factor > 1 or not self.max_lower_factor > 1:
            raise ValueError(f"max_raise_factor={self.max_raise_factor} and max_lower_factor="
                             f"{self.max_lower_factor} must be > 1")
        if not self.fast_raise_above >= 1 or not self.max_fast_raise_factor >= self.max_raise_factor:
            raise ValueError(f"need fast_raise_above ({self.fast_raise_above}) >= 1 and max_fast_raise_factor "
                             f"({self.max_fast_raise_factor}) >= max_raise_factor ({self.max_raise_factor})")
        if not self.persist_margin >= 1 or self.persist_memory < 1:
            raise ValueError(f"need persist_margin ({self.persist_margin}) >= 1 and persist_memory "
                             f"({self.persist_memory}) >= 1")
        if self.confidence < 0 or self.k_max < 1 or not self.pause_factor > 1:
            raise ValueError(f"need confidence ({self.confidence}) >= 0, k_max ({self.k_max}) >= 1, "
                             f"pause_factor ({self.pause_factor}) > 1")


class AdaptiveRate:
    """Feed it every iteration's time and stall; it returns a new k when k should change.

    ``k_cap``: the largest k allowed (the lost-work bound; None: ``config.k_max``). It wins
    over the floor and over p.
    """

    def __init__(self, *, k: int, k_floor: int, overhead: float, config: AdaptiveConfig | None = None,
                 reference_iter_s: float | None = None, k_cap: int | None = None) -> None:
        if k < 1 or k_floor < 1:
            raise ValueError(f"k={k} and k_floor={k_floor} must be >= 1")
        if k_cap is not None and k_cap < 1:
            raise ValueError(f"k_cap={k_cap}: must be >= 1")
        self.config = config or AdaptiveConfig()
        self.k_cap = min(k_cap, self.config.k_max) if k_cap is not None else self.config.k_max
        self.k_floor = min(k_floor, self.k_cap)
        self.k = self._bounded(k)
        self.overhead = overhead
        self.reference_iter_s = reference_iter_s
        self.last_overhead: float | None = None
        self.last_error: float | None = None
        self.pooled_overhead: float | None = None  # what the last decision went by, and its error
        self.pooled_error: float | None = None
        self.history: list[tuple[float, int]] = []  # (window overhead, k after the window)
        self.highest_k = self.k  # k rises in proportion only above it
        self._persists: deque[float] = deque(maxlen=self.config.persist_memory)
        self._window_reference_s: float | None = None  # the last window's quiet iteration
        self._recent: list[Stretch] = []  # the windows since k last changed
        self._reset_window()

    def _bounded(self, k: int) -> int:
        return min(self.k_cap, max(k, self.k_floor))

    def restart_at(self, k: int, *, k_floor: int | None = None) -> None:
        """k (and its floor) set from outside; the window so far measured the old k."""
        if k_floor is not None:
            if k_floor < 1:
                raise ValueError(f"k_floor={k_floor}: must be >= 1")
            self.k_floor = min(k_floor, self.k_cap)
        if k < 1:
            raise ValueError(f"k={k}: must be >= 1")
        self.k = self._bounded(k)
        self.highest_k = max(self.highest_k, self.k)
        self._recent = []
        self._reset_window()

    def record_persist(self, seconds: float) -> None:
        """A persist's wall time: k is not lowered below what the slowest recent ones need."""
        if seconds < 0:
            raise ValueError(f"seconds={seconds!r}: a persist's wall time must be >= 0")
        self._persists.append(seconds)

    @property
    def persist_floor(self) -> int:
        """The smallest k at which the slowest recent persist, with the margin, ends before
        the next checkpoint (1 without persists or an iteration time); at most ``k_cap``."""
        iter_s = self._window_reference_s or self.reference_iter_s
        if not self._persists or not iter_s:
            return 1
        need = math.ceil(round(self.config.persist_margin * max(self._persists) / iter_s, 9))
        return min(self.k_cap, max(1, need))

    def _reset_window(self) -> None:
        self._samples: list[Sample] = []

    def record(self, iter_s: float, stall_s: float, busy: bool = True) -> int | None:
        """One iteration: its wall time, its stall, and whether checkpoint work was in flight."""
        self._samples.append((iter_s, stall_s, busy))
        needed = max(self.config.window_iters, self.config.min_checkpoints_per_window * self.k)
        if len(self._samples) < needed:
            return None
        window = measure(self._samples, fallback_ref_s=self.reference_iter_s,
                         pause_factor=self.config.pause_factor, min_quiet=self.config.min_quiet_iters)
        self._reset_window()
        self.last_overhead, self.last_error = window.overhead, window.error
        self._window_reference_s = window.reference_s or self._window_reference_s
        self._recent = (self._recent + [window])[-self.config.smooth_windows:]
        new_k = self._next_k()
        self.history.append((window.overhead, new_k))
        if new_k == self.k:
            return None
        self.k = new_k
        self.highest_k = max(self.highest_k, new_k)
        self._recent = []
        return new_k

    def _next_k(self) -> int:
        p, config = self.overhead, self.config
        fast = self._fast_raise()
        if fast is not None:
            return fast
        if len(self._recent) < config.patience:
            return self.k
        pooled = sum(self._recent, Stretch())
        self.pooled_overhead, self.pooled_error = pooled.overhead, pooled.error
        margin = config.confidence * pooled.error
        if pooled.overhead - margin > p and self.k < self.k_cap:
            factor = min(pooled.overhead / (config.raise_to * p), config.max_raise_factor)
            return self._bounded(max(self.k + 1, math.ceil(self.k * factor)))
        lowering_seen = len(self._recent) >= config.smooth_windows  # falling waits longer than rising
        if lowering_seen and pooled.overhead + margin < config.lower_below * p and self.k > self.k_floor:
            factor = max(pooled.overhead / (config.lower_to * p), 1 / config.max_lower_factor)
            lowered = max(self._bounded(min(self.k - 1, math.ceil(self.k * factor))), self.persist_floor)
            return min(self.k, lowered)  # the persist floor only stops k falling, never lifts it
        return self.k

    def _fast_raise(self) -> int | None:
        """k after the windows since it last changed, where the overhead's lower end is far above p."""
        p, config = self.overhead, self.config
        pooled = sum(self._recent, Stretch())
        lower = pooled.overhead_without_largest_stall - config.confidence * pooled.error
        if lower <= config.fast_raise_above * p or self.k >= self.k_cap or self.k < self.highest_k:
            return None
        self.pooled_overhead, self.pooled_error = pooled.overhead, pooled.error
        factor = min(lower / (config.raise_to * p), config.max_fast_raise_factor)
        return self._bounded(max(self.k + 1, math.ceil(self.k * factor)))
