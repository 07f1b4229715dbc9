"""The CheckFreq policy: snapshot mode and checkpoint interval from a profile. Pure math.

Symbols (DESIGN.md, point 4): Ti iteration time, Tw weight-update time, Tg in-GPU copy,
Tc GPU->CPU (or host) copy, Ts storage write, m checkpoint size, M peak GPU memory,
Mmax total GPU memory, p the allowed overhead fraction.

    mode = "gpu" if M + m <= Mmax (and a GPU copy was measured) else "cpu"
    To   = Tg                      (gpu: the copy runs before the next update can start)
         = max(0, Tc - (Ti - Tw))  (cpu: only the part the next forward/backward cannot hide)
    k    = ceil((Tc + Ts - To) / Ti), never below kmin = ceil(To / (p * Ti)), never below 1

With a mean time between failures, Young/Daly's interval sqrt(2 * C * MTBF) (C = the
stall a checkpoint costs) also bounds k from above, unless p forbids it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MODES = ("gpu", "cpu")


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What the profiling window measured; seconds and bytes."""

    iter_s: float
    update_s: float
    cpu_copy_s: float
    persist_s: float
    size_bytes: int
    gpu_copy_s: float | None = None
    peak_memory_bytes: int = 0
    total_memory_bytes: int = 0
    compress: bool = True

    def __post_init__(self) -> None:
        if not self.iter_s > 0:
            raise ValueError(f"iter_s={self.iter_s!r}: must be > 0")
        for name in ("update_s", "cpu_copy_s", "persist_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 0")
        if self.gpu_copy_s is not None and self.gpu_copy_s < 0:
            raise ValueError(f"gpu_copy_s={self.gpu_copy_s!r}: must be >= 0")
        if self.size_bytes < 0:
            raise ValueError(f"size_bytes={self.size_bytes!r}: must be >= 0")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        fields = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"profile has unknown fields {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class Decision:
    """What the policy chose, and why."""

    mode: str
    k: int
    k_min: int
    k_persist: int
    overhead_s: float
    young_daly_k: int | None
    expected_overhead: float
    expected_lost_s: float


def choose_mode(profile: Profile) -> str:
    if profile.gpu_copy_s is None or profile.total_memory_bytes <= 0:
        return "cpu"
    fits = profile.peak_memory_bytes + profile.size_bytes <= profile.total_memory_bytes
    return "gpu" if fits else "cpu"


def critical_overhead_s(profile: Profile, mode: str) -> float:
    """To: the stall one checkpoint puts on the training loop."""
    if mode == "gpu":
        assert profile.gpu_copy_s is not None
        return profile.gpu_copy_s
    if mode == "cpu":
        return max(0.0, profile.cpu_copy_s - (profile.iter_s - profile.update_s))
    raise ValueError(f"mode={mode!r}: expected one of {MODES}")


def min_interval(overhead_s: float, iter_s: float, overhead: float) -> int:
    """kmin = ceil(To / (p * Ti)): the smallest k whose overhead stays within p."""
    _check_fraction(overhead)
    return max(1, math.ceil(_round(overhead_s / (overhead * iter_s))))


def persist_interval(profile: Profile, overhead_s: float) -> int:
    """ceil((Tc + Ts - To) / Ti): the smallest k at which the last checkpoint is done."""
    return max(1, math.ceil(_round((profile.cpu_copy_s + profile.persist_s - overhead_s) / profile.iter_s)))


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """sqrt(2 * C * MTBF): the interval that minimises checkpoint cost plus lost work."""
    if mtbf_s <= 0:
        raise ValueError(f"mtbf_s={mtbf_s!r}: must be > 0")
    return math.sqrt(2.0 * max(checkpoint_cost_s, 0.0) * mtbf_s)


def choose_interval(profile: Profile, *, overhead: float = 0.035, mtbf_s: float | None = None) -> Decision:
    """CheckFreq's k, optionally tightened towards Young/Daly's interval."""
    mode = choose_mode(profile)
    stall = critical_overhead_s(profile, mode)
    k_min = min_interval(stall, profile.iter_s, overhead)
    k_persist = persist_interval(profile, stall)
    k = max(k_persist, k_min)
    young_daly_k = None
    if mtbf_s is not None:
        young_daly_k = max(1, math.floor(young_daly_interval_s(stall, mtbf_s) / profile.iter_s))
        allowed = smallest_interval_within(profile, stall, overhead)
        k = max(allowed, min(k, young_daly_k))
    return Decision(
        mode=mode,
        k=k,
        k_min=k_min,
        k_persist=k_persist,
        overhead_s=stall,
        young_daly_k=young_daly_k,
        expected_overhead=interval_overhead(profile, stall, k),
        expected_lost_s=k * profile.iter_s,
    )


def interval_overhead(profile: Profile, stall_s: float, k: int) -> float:
    """Overhead fraction at interval k: the stall, plus the wait for a persist not yet done."""
    wait = max(0.0, profile.cpu_copy_s + profile.persist_s - stall_s - k * profile.iter_s)
    return (stall_s + wait) / (k * profile.iter_s)


def smallest_interval_within(profile: Profile, stall_s: float, overhead: float) -> int:
    """The smallest k whose overhead, waits included, stays within p."""
    _check_fraction(overhead)
    k = 1
    upper = max(min_interval(stall_s, profile.iter_s, overhead), persist_interval(profile, stall_s))
    while k < upper and interval_overhead(profile, stall_s, k) > overhead:
        k += 1
    return k


def _check_fraction(overhead: float) -> None:
    if not 0 < overhead < 1:
        raise ValueError(f"overhead={overhead!r}: must be a fraction in (0, 1)")


def _round(value: float) -> float:
    # 20.000000000000004 must give 20, not 21: the inputs are measurements, not exact
    return round(value, 9)
