"""The CheckFreq policy: snapshot mode and checkpoint interval from a profile. Pure math.

Symbols (DESIGN.md, point 4): Ti iteration time, Tw weight-update time, Tg in-GPU copy,
Tc GPU->CPU (or host) copy, Ts storage write, m checkpoint size, M peak GPU memory,
Mmax total GPU memory, p the allowed overhead fraction.

    mode = "gpu" if M + m <= Mmax (and a GPU copy was measured) else "cpu"
    To   = Tg                      (gpu: the copy runs before the next update can start)
         = max(0, Tc - (Ti - Tw))  (cpu: only the part the next forward/backward cannot hide)
    k    = ceil((Tc + Ts - To) / Ti), never below kmin = ceil(To / (p * Ti)), never below 1

The paper's To assumes persist runs beside training for free. Where persist shares cores,
memory bandwidth or the interpreter with training it does not, so the profile also
carries C, the training time one checkpoint cost as measured (``interference_s``: the
inflation of the iterations that ran beside a profiling persist, its stalls included),
and k is never below kcost = ceil(max(To, C) / (p * Ti)).

With a loss rate (losses per second: stated by the user as ``mtbf_s``, or observed by a
run that has seen losses, ray/shared_policy.py), k is the one that maximises expected
goodput (``goodput_k``): each interval of k iterations costs the checkpoint, and each loss
costs the restart R plus half an interval of recomputation on average, so

    G(k) = (1 - rate * (R + P(k) / 2)) / (1 + o(k))    P(k) = k * Ti * (1 + o(k))

with o(k) the overhead at k (``interval_overhead``). Half an interval per loss holds where
losses are memoryless; a spot fleet's come in waves, and a loss that comes before its
attempt trained one interval (``uptimes_s``: training seconds from each restart to the loss
that ended it, as a run observed them) cost what it trained whatever k was, not P(k) / 2.
So with uptimes, P(k) / 2 is the mean loss ``lost_per_loss_s``: each observed loss's
uptime where it was under P(k), else P(k) / 2, and P(k) / 2 for the loss to come (which
holds the estimate to the memoryless one until losses were seen). Where losses are rare that k is
above p's (fewer checkpoints); where they are frequent it may be below, and overhead then
exceeds p, up to the hard cap ``max_overhead``. With no loss rate, p's k stands.
``Decision.bound`` says which bound set k: "p", "goodput", "cap" (max_overhead) or
"lost_work" (k_cap).

A lost-work bound ``k_cap`` (by default a quarter of an epoch, but never under 10 s of
iterations) bounds k from above whatever p asks: the user chose to lose at most that much
work to a failure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
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
    interference_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.iter_s > 0:
            raise ValueError(f"iter_s={self.iter_s!r}: must be > 0")
        for name in ("update_s", "cpu_copy_s", "persist_s", "interference_s"):
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
    cost_s: float = 0.0  # max(To, measured interference): what one checkpoint costs training
    k_cost: int = 1
    k_cap: int | None = None  # the lost-work bound, if any
    k_uncapped: int | None = None  # the k p asked for, where the lost-work bound cut it
    bound: str = "p"  # what set k: "p", "goodput", "cap" (max_overhead) or "lost_work" (k_cap)
    expected_goodput: float | None = None  # G(k), with a loss rate

    @property
    def capped(self) -> bool:
        """Whether the lost-work bound holds k below what p asks for."""
        return self.k_uncapped is not None

    @property
    def k_floor(self) -> int:
        """The paper's k (persist done in time, To within p), without measured interference:
        the adaptive rate may come down to it when the interference goes away."""
        floor = max(self.k_persist, self.k_min)
        if self.bound in ("goodput", "cap"):  # the loss rate asked for this k, under p's
            floor = min(floor, self.k)
        return floor if self.k_cap is None else min(floor, self.k_cap)

    @property
    def target_overhead(self) -> float:
        """The overhead the adaptive rate holds k to: p, or what the goodput's k costs."""
        return self.expected_overhead if self.bound in ("goodput", "cap") else 0.0


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


def goodput_interval(cost_s: float, mtbf_s: float, iter_s: float) -> int:
    """Young/Daly's k at this checkpoint cost and mean time between preemptions (first
    order: no restart cost, no waits); ``goodput_k`` is the exact one of the model."""
    if not iter_s > 0:
        raise ValueError(f"iter_s={iter_s!r}: must be > 0")
    return max(1, math.floor(young_daly_interval_s(cost_s, mtbf_s) / iter_s))


def mtbf_estimate(running_s: float, restarts: int) -> float | None:
    """The mean time between preemptions a run has seen: its time since it first started
    over its restarts plus the one to come (never rarer than what was observed); None
    before it has run at all."""
    if running_s <= 0 or restarts < 0:
        return None
    return running_s / (restarts + 1)


def checkpoint_cost_s(profile: Profile, stall_s: float) -> float:
    """C = max(To, measured interference): training seconds one checkpoint costs."""
    return max(stall_s, profile.interference_s)


MAX_OVERHEAD = 0.15  # the default hard cap on overhead when losses ask for more checkpoints than p allows


def lost_per_loss_s(period_s: float, uptimes_s: Sequence[float] = ()) -> float:
    """The mean training seconds a loss costs at this checkpoint period: an observed loss
    whose attempt trained less than one period lost its uptime, any other half a period
    (its phase unknown), and the loss to come half a period (module doc)."""
    if not period_s > 0:
        raise ValueError(f"period_s={period_s!r}: must be > 0")
    lost = sum(uptime if uptime < period_s else period_s / 2 for uptime in uptimes_s)
    return (lost + period_s / 2) / (len(uptimes_s) + 1)


def expected_goodput(profile: Profile, stall_s: float, k: int, *, loss_rate_per_s: float, restart_s: float,
                     uptimes_s: Sequence[float] = ()) -> float:
    """G(k): the share of wall time that becomes kept progress at interval k (module doc)."""
    overhead = interval_overhead(profile, stall_s, k)
    period_s = k * profile.iter_s * (1 + overhead)
    lost_s = lost_per_loss_s(period_s, uptimes_s)
    return max(0.0, 1.0 - loss_rate_per_s * (restart_s + lost_s)) / (1 + overhead)


def _check_uptimes(uptimes_s: Sequence[float]) -> None:
    bad = [uptime for uptime in uptimes_s if not uptime >= 0]
    if bad:
        raise ValueError(f"uptimes_s has {bad[:3]!r}: each must be seconds >= 0")


def goodput_k(profile: Profile, stall_s: float, *, loss_rate_per_s: float, restart_s: float, k_low: int,
              k_high: int | None = None, uptimes_s: Sequence[float] = ()) -> int:
    """The k in [k_low, k_high] that maximises ``expected_goodput`` (the smallest of equals).
    G is unimodal in k between the k whose period passes an observed uptime (there it
    drops: that loss no longer kept one interval): every k near the low end, a geometric
    grid and the last k below each uptime, then the neighbourhood of the best of those."""
    if loss_rate_per_s < 0 or restart_s < 0 or k_low < 1:
        raise ValueError(f"loss_rate_per_s={loss_rate_per_s!r}, restart_s={restart_s!r}, k_low={k_low!r}: "
                         "must be >= 0, >= 0 and >= 1")
    _check_uptimes(uptimes_s)
    if loss_rate_per_s == 0:
        return k_high if k_high is not None else max(k_low, persist_interval(profile, stall_s))
    # Far past Young/Daly's interval at the whole cost of a checkpoint G only falls.
    reach = 8 * goodput_interval(max(stall_s, checkpoint_cost_s(profile, stall_s), profile.iter_s),
                                 1 / loss_rate_per_s, profile.iter_s)
    top = max(k_low, min(k_high, reach) if k_high is not None else reach)

    def value(k: int) -> float:
        return expected_goodput(profile, stall_s, k, loss_rate_per_s=loss_rate_per_s, restart_s=restart_s,
                                uptimes_s=uptimes_s)

    grid = set(range(k_low, min(top, k_low + 64) + 1))
    k = k_low
    while k < top:
        k = min(top, max(k + 1, math.ceil(k * 1.05)))
        grid.add(k)
    grid |= {k for k in (_last_k_within(profile, stall_s, uptime, k_low, top) for uptime in set(uptimes_s))
             if k is not None}
    best = max(sorted(grid), key=value)
    near = range(max(k_low, math.floor(best / 1.05) - 1), min(top, math.ceil(best * 1.05) + 1) + 1)
    return max(sorted(set(near) | {best}), key=value)


def _last_k_within(profile: Profile, stall_s: float, period_s: float, k_low: int, k_high: int) -> int | None:
    """The largest k in [k_low, k_high] whose period (``interval_overhead`` included) is
    under ``period_s``; None if none is. The period grows with k."""
    def period(k: int) -> float:
        return k * profile.iter_s * (1 + interval_overhead(profile, stall_s, k))

    if period(k_low) >= period_s:
        return None
    low, high = k_low, k_high
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if period(middle) < period_s else (low, middle - 1)
    return low


def choose_interval(profile: Profile, *, overhead: float = 0.035, mtbf_s: float | None = None,
                    k_cap: int | None = None, loss_rate_per_s: float | None = None, restart_s: float = 60.0,
                    max_overhead: float = MAX_OVERHEAD, uptimes_s: Sequence[float] = ()) -> Decision:
    """CheckFreq's k, never below what the measured cost allows at p; with a loss rate
    (``loss_rate_per_s``, or 1 / ``mtbf_s``) the k of the best expected goodput, whose
    overhead may exceed p up to ``max_overhead`` (each loss costing what ``uptimes_s``, the
    observed training seconds before each loss, say it did: ``lost_per_loss_s``); never
    above ``k_cap`` (the lost-work bound)."""
    if k_cap is not None and k_cap < 1:
        raise ValueError(f"k_cap={k_cap!r}: must be >= 1")
    if not 0 < max_overhead < 1:
        raise ValueError(f"max_overhead={max_overhead!r}: must be a fraction in (0, 1)")
    max_overhead = max(max_overhead, overhead)  # a cap under p caps nothing
    mode = choose_mode(profile)
    stall = critical_overhead_s(profile, mode)
    cost = checkpoint_cost_s(profile, stall)
    k_min = min_interval(stall, profile.iter_s, overhead)
    k_cost = min_interval(cost, profile.iter_s, overhead)
    k_persist = persist_interval(profile, stall)
    k, bound = max(k_persist, k_min, k_cost), "p"
    rate = loss_rate_per_s if loss_rate_per_s is not None else (1 / mtbf_s if mtbf_s is not None else None)
    young_daly_k = goodput = None
    # No loss seen and none stated: p holds. Losses seen, none of which needed a checkpoint
    # (rate 0: notices that kept everything): as few checkpoints as the lost-work bound allows.
    if rate is not None and (rate > 0 or k_cap is not None):
        young_daly_k = goodput_interval(cost, 1 / rate, profile.iter_s) if rate > 0 else None
        k_low = smallest_interval_within(profile, stall, max_overhead)
        k = goodput_k(profile, stall, loss_rate_per_s=rate, restart_s=restart_s, k_low=k_low, k_high=k_cap,
                      uptimes_s=uptimes_s)
        best_unbounded = goodput_k(profile, stall, loss_rate_per_s=rate, restart_s=restart_s, k_low=1, k_high=k_cap,
                                   uptimes_s=uptimes_s)
        bound = "cap" if k == k_low and best_unbounded < k_low else "goodput"
        goodput = expected_goodput(profile, stall, k, loss_rate_per_s=rate, restart_s=restart_s, uptimes_s=uptimes_s)
    k_uncapped = None
    if k_cap is not None and k > k_cap:
        k, k_uncapped, bound = k_cap, k, "lost_work"
    return Decision(
        mode=mode,
        k=k,
        k_min=k_min,
        k_persist=k_persist,
        overhead_s=stall,
        young_daly_k=young_daly_k,
        expected_overhead=interval_overhead(profile, stall, k),
        expected_lost_s=k * profile.iter_s,
        cost_s=cost,
        k_cost=k_cost,
        k_cap=k_cap,
        k_uncapped=k_uncapped,
        bound=bound,
        expected_goodput=goodput,
    )


def lost_work_cap(epoch_len: int | None, max_lost_fraction: float | None, *, iter_s: float = 0.0,
                  floor_s: float = 0.0) -> int | None:
    """The largest k that loses at most ``max_lost_fraction`` of an epoch, but never below
    ``floor_s`` seconds of iterations: losing less work than that costs less than
    checkpointing more often would (None: no bound)."""
    if epoch_len is None or max_lost_fraction is None:
        return None
    cap = max(1, math.floor(_round(max_lost_fraction * epoch_len)))
    if iter_s > 0 and floor_s > 0:
        cap = max(cap, math.ceil(_round(floor_s / iter_s)))
    return cap


def interval_overhead(profile: Profile, stall_s: float, k: int) -> float:
    """Overhead fraction at interval k: the checkpoint's cost, plus the wait for a persist
    not yet done."""
    wait = max(0.0, profile.cpu_copy_s + profile.persist_s - stall_s - k * profile.iter_s)
    return (checkpoint_cost_s(profile, stall_s) + wait) / (k * profile.iter_s)


def smallest_interval_within(profile: Profile, stall_s: float, overhead: float) -> int:
    """The smallest k whose overhead, waits included, stays within p."""
    _check_fraction(overhead)
    k = 1
    cost = checkpoint_cost_s(profile, stall_s)
    upper = max(min_interval(cost, profile.iter_s, overhead), persist_interval(profile, stall_s))
    while k < upper and interval_overhead(profile, stall_s, k) > overhead:
        k += 1
    return k


# ------------------------------------------------------------ measurements
def iteration_time_s(samples: Sequence[float], *, warmup: int) -> float:
    """Ti: the median of the samples after the first ``warmup`` (allocations, caches)."""
    kept = list(samples[warmup:])
    if not kept:
        raise ValueError(f"no iteration samples after a warm-up of {warmup}")
    return statistics.median(kept)


def quiet_reference_s(quiet: Sequence[float], pause_factor: float = 3.0) -> float:
    """The mean quiet iteration, leaving out pauses (``pause_factor`` x the median or more).

    The mean, not the median: busy iterations are summed, and a sum of skewed times is
    compared fairly only with the mean of the same distribution.
    """
    if not quiet:
        raise ValueError("no quiet iterations to compare with")
    limit = pause_factor * statistics.median(quiet)
    kept = [t for t in quiet if t < limit]
    return sum(kept) / len(kept)


def interference_s(quiet: Sequence[float], busy: Sequence[float], pause_factor: float = 3.0) -> float:
    """Training seconds lost to one checkpoint: how much longer the iterations that ran
    beside it (stalls included) took than as many quiet ones; never below 0. Every busy
    iteration counts, however slow: a persist that holds the interpreter can stretch one
    by more than any pause factor."""
    reference = quiet_reference_s(quiet, pause_factor)
    return max(0.0, sum(busy) - len(busy) * reference)


MIN_COMPRESSIBLE_BYTES = 1 << 20
BEST_STORED_FRACTION = 0.66  # the codec's best case (dense BF16 is ~1.5x at its entropy limit)
COMPRESSION_MARGIN = 0.8


def compression_could_pay(decision: Decision, size_bytes: int) -> bool:
    """Compression only shortens the persist and costs CPU: worth a measured trial only
    where, even at the codec's best ratio, the persist-bound k would drop by the margin
    ``choose_codec`` asks for, and where bytes, not per-file latency, make the persist's
    duration (states of a MiB or more)."""
    best_k = max(decision.k_min, decision.k_cost, math.ceil(BEST_STORED_FRACTION * decision.k_persist))
    return size_bytes >= MIN_COMPRESSIBLE_BYTES and best_k <= COMPRESSION_MARGIN * decision.k


def choose_codec(decisions: Mapping[str, Decision]) -> str:
    """"rcfz" where its measured checkpoint allows a k at most ``COMPRESSION_MARGIN`` times
    raw's (a clear gain, not timing noise); else "raw", which costs no CPU."""
    if "raw" not in decisions:
        raise ValueError(f"no raw measurement among {sorted(decisions)}")
    rcfz = decisions.get("rcfz")
    if rcfz is not None and rcfz.k <= COMPRESSION_MARGIN * decisions["raw"].k:
        return "rcfz"
    return "raw"


def fixed_interval_codec(persist_s: Mapping[str, float], interval_s: float) -> str:
    """With k fixed: compress only where the raw persist outlasts the interval (the next
    checkpoint would wait for it) and the compressed one was measured to be faster."""
    raw = persist_s["raw"]
    if raw <= interval_s or "rcfz" not in persist_s:
        return "raw"
    return "rcfz" if persist_s["rcfz"] < raw else "raw"


def _check_fraction(overhead: float) -> None:
    if not 0 < overhead < 1:
        raise ValueError(f"overhead={overhead!r}: must be a fraction in (0, 1)")


def _round(value: float) -> float:
    # 20.000000000000004 must give 20, not 21: the inputs are measurements, not exact
    return round(value, 9)
