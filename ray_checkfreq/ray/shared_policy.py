"""The policy of a whole run, fed by every rank and every node agent. Pure: no Ray.

Rank 0's engine profiles the job and proposes k (``start``). From then on:

- every rank reports its iterations (wall time, stall, whether checkpoint work was in
  flight); an iteration counts once all ranks reported it, as the slowest rank saw it
  (the step time of data-parallel training is the slowest rank's), busy if any rank was;
- node agents report each persist (seconds, CPU seconds, bytes);
- the engine's adaptive rate runs on those aggregated iterations: it raises k when the
  measured overhead (stalls, or inflation against quiet iterations) exceeds p, and lowers
  it again when overhead stays well below p;
- a persist slower than the interval raises k at once to the persist's need
  (``persist_margin`` x persist seconds / Ti): otherwise the next checkpoint would wait for
  it, which is how another writer on the same store (or a slower network) shows first.
  The need is the slowest of the last ``persist_memory`` (2) persists, so it falls again once
  persists are quick, and the adaptive rate then brings k down step by step.
- k never exceeds the engine's lost-work bound (``k_cap``), whatever the persists need.
- the restarts it sees (a ``start`` of a newer generation) give the run's rate of losses
  that need a checkpoint (``policy.mtbf_estimate``; a restart after a notice whose
  checkpoint kept everything, ``lost_work=False``, is not one of them) and the restart cost
  (the time from the last report of the previous generation to the new start: at most one
  checkpoint interval over), and how long each generation that ended in such a loss
  trained (its start to its last report: ``uptimes_s``, so that a loss that came before one
  interval counts what it cost, not half an interval). Once a loss was seen, k is the one
  of the best expected goodput (``policy.choose_interval`` with that rate and those
  uptimes, the engine's measured checkpoint cost and the slowest recent persist): fewer
  checkpoints than p allows where losses are rare, more where they are frequent, overhead
  then up to ``max_overhead``; the adaptive rate then holds k to that overhead instead of p.
  It is evaluated at each start and persist;
  ``history`` names what set each k ("profile", "overhead", "persist", "goodput", "cap").

Reports carry the run's writer generation: a report of an older generation (a rank or
agent of a group that was replaced) is ignored. ``start`` with the same world size keeps
the k learned so far (a restart in place); another world size starts over from the
engine's new proposal (the engine re-profiles then: the world size is in its profile's
fingerprint).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ray_checkfreq.engine.adaptive import AdaptiveConfig, AdaptiveRate
from ray_checkfreq.engine.policy import MAX_OVERHEAD, Decision, Profile, choose_interval, mtbf_estimate

PENDING_LIMIT = 4096  # iterations waiting for the other ranks' reports, at most


@dataclass(frozen=True, kw_only=True)
class IterationReport:
    """One rank's view of one iteration."""

    iteration: int
    iter_s: float
    stall_s: float
    busy: bool


@dataclass(frozen=True, kw_only=True)
class PersistReport:
    """One persist, as the node agent that ran it measured it."""

    step: int
    seconds: float
    cpu_s: float = 0.0
    stored_bytes: int = 0
    node_id: str = ""


@dataclass(frozen=True, kw_only=True)
class SharedPolicyConfig:
    overhead: float = 0.035
    persist_margin: float = 1.25
    persist_memory: int = 2
    adaptive: AdaptiveConfig = AdaptiveConfig()
    max_overhead: float = MAX_OVERHEAD
    restart_s: float = 60.0  # a restart's cost until one is measured

    def __post_init__(self) -> None:
        if not 0 < self.overhead < 1:
            raise ValueError(f"overhead={self.overhead!r}: must be a fraction in (0, 1)")
        if not self.persist_margin >= 1:
            raise ValueError(f"persist_margin={self.persist_margin!r}: must be >= 1")
        if self.persist_memory < 1:
            raise ValueError(f"persist_memory={self.persist_memory!r}: must be >= 1")
        if not 0 < self.max_overhead < 1:
            raise ValueError(f"max_overhead={self.max_overhead!r}: must be a fraction in (0, 1)")
        if not self.restart_s >= 0:
            raise ValueError(f"restart_s={self.restart_s!r}: must be seconds >= 0")


class SharedPolicy:
    def __init__(self, config: SharedPolicyConfig | None = None) -> None:
        self.config = config or SharedPolicyConfig()
        self.generation = -1
        self.world_size = 0
        self.version = 0  # +1 whenever k changes
        self.history: list[dict] = []  # every change of k: iteration, k, reason
        self._rate: AdaptiveRate | None = None
        self._base_floor = 1
        self._iter_ref_s = 0.0
        self._pending: dict[int, dict[int, IterationReport]] = {}
        self._persists: deque[PersistReport] = deque(maxlen=self.config.persist_memory)
        self._last_iteration = 0
        self._aggregated = 0
        self._restarts = 0
        self._k_cap: int | None = None  # the engine's lost-work bound (None: none)
        self._lossy_restarts = 0  # restarts that lost work (not a notice's that kept everything)
        self._restart_s: float | None = None  # the last restart's measured cost
        self._last_seen_s = 0.0  # the newest report's clock
        self._first_start_s: float | None = None
        self._generation_start_s = 0.0
        self._last_report_s = 0.0  # the newest report of this generation (iterations included)
        self._uptimes: list[float] = []  # seconds each generation that ended in a loss trained
        self._cost_s = 0.0  # what one checkpoint costs training, as the engine measured it
        self._now_s = 0.0

    # ------------------------------------------------------------------ start
    def start(self, *, generation: int, world_size: int, k: int, k_floor: int, iter_s: float,
              k_cap: int | None = None, cost_s: float = 0.0, now_s: float = 0.0, lost_work: bool = True) -> int:
        """Rank 0's engine has its policy (profiled or cached): the k every rank uses now.
        ``cost_s``: what one checkpoint costs training; ``now_s``: a monotonic clock;
        ``lost_work``: False after a notice whose checkpoint kept everything."""
        if generation < self.generation:
            raise ValueError(f"generation {generation} is older than this run's {self.generation}")
        if k < 1 or k_floor < 1 or not iter_s > 0 or world_size < 1 or cost_s < 0:
            raise ValueError(f"start(k={k}, k_floor={k_floor}, iter_s={iter_s}, world_size={world_size}, "
                             f"cost_s={cost_s}): k, k_floor and world_size must be >= 1, iter_s > 0, cost_s >= 0")
        if self._first_start_s is None:
            self._first_start_s = now_s
        elif generation > self.generation:
            self._restarts += 1
            self._lossy_restarts += bool(lost_work)
            self._restart_s = max(0.0, now_s - self._last_seen_s)
            if lost_work:
                self._uptimes.append(max(0.0, self._last_report_s - self._generation_start_s))
        if generation > self.generation:
            self._generation_start_s = self._last_report_s = now_s
        self._now_s, self._cost_s = max(self._now_s, now_s), cost_s
        self._last_seen_s = max(self._last_seen_s, now_s)
        self._k_cap = k_cap
        previous = self._rate if world_size == self.world_size else None
        self.generation, self.world_size = generation, world_size
        self._pending.clear()
        if previous is not None:
            self._apply_floor()
            return previous.k
        self._base_floor = k_floor
        self._iter_ref_s = iter_s
        self._persists.clear()
        self._rate = AdaptiveRate(k=k, k_floor=k_floor, overhead=self.config.overhead,
                                  config=self.config.adaptive, reference_iter_s=iter_s, k_cap=k_cap)
        self._changed(self._rate.k, "profile")
        self._apply_floor()
        return self._rate.k

    @property
    def k(self) -> int | None:
        return self._rate.k if self._rate is not None else None

    # ---------------------------------------------------------------- reports
    def record_iterations(self, *, generation: int, rank: int, reports: list[IterationReport],
                          now_s: float | None = None) -> None:
        if generation != self.generation or self._rate is None or not 0 <= rank < self.world_size:
            return  # an old group's rank, or before start: nothing to aggregate yet
        if now_s is not None and reports:
            self._last_report_s = max(self._last_report_s, now_s)
        for report in reports:
            self._pending.setdefault(report.iteration, {})[rank] = report
            if len(self._pending[report.iteration]) == self.world_size:
                self._aggregate(report.iteration, self._pending.pop(report.iteration))
        if len(self._pending) > PENDING_LIMIT:  # a rank stopped reporting: keep the newest only
            for iteration in sorted(self._pending)[:-PENDING_LIMIT]:
                del self._pending[iteration]

    def record_persist(self, *, generation: int, report: PersistReport, now_s: float | None = None) -> None:
        if generation != self.generation or self._rate is None:
            return
        self._persists.append(report)
        if now_s is not None:
            self._now_s = max(self._now_s, now_s)
            self._last_seen_s = max(self._last_seen_s, now_s)
            self._last_report_s = max(self._last_report_s, now_s)
        self._apply_floor()

    def _aggregate(self, iteration: int, by_rank: dict[int, IterationReport]) -> None:
        assert self._rate is not None
        slowest = max(by_rank.values(), key=lambda r: r.iter_s)
        stall = max(r.stall_s for r in by_rank.values())
        busy = any(r.busy for r in by_rank.values())
        self._last_iteration = max(self._last_iteration, iteration)
        self._aggregated += 1
        new_k = self._rate.record(slowest.iter_s, stall, busy)
        if new_k is not None:
            self._changed(new_k, "overhead")

    # ------------------------------------------------------------------- floor
    def persist_need(self) -> int:
        """The k at which the slowest recent persist ends before the next checkpoint."""
        if not self._persists:
            return 1
        slowest = max(p.seconds for p in self._persists)
        return max(1, math.ceil(round(self.config.persist_margin * slowest / self._iter_ref_s, 9)))

    def mtbf_s(self) -> float | None:
        """The run's mean time between losses that need a checkpoint, as observed
        (``policy.mtbf_estimate``); None before it started."""
        if self._first_start_s is None:
            return None
        return mtbf_estimate(self._now_s - self._first_start_s, self._lossy_restarts)

    def goodput_decision(self) -> Decision | None:
        """The policy's choice at the observed loss rate; None before a loss was seen."""
        mtbf, rate = self.mtbf_s(), self._rate
        if mtbf is None or self._restarts == 0 or rate is None:
            return None
        slowest = max((p.seconds for p in self._persists), default=0.0)
        profile = Profile(iter_s=self._iter_ref_s, update_s=self._iter_ref_s, cpu_copy_s=0.0, persist_s=slowest,
                          size_bytes=0, interference_s=self._cost_s)
        restart_s = self._restart_s if self._restart_s is not None else self.config.restart_s
        return choose_interval(profile, overhead=self.config.overhead, k_cap=self._k_cap,
                               loss_rate_per_s=self._lossy_restarts and 1 / mtbf, restart_s=restart_s,
                               max_overhead=self.config.max_overhead, uptimes_s=self._uptimes)

    def _apply_floor(self) -> None:
        rate = self._rate
        assert rate is not None
        decision = self.goodput_decision()
        if decision is not None and decision.bound != "p":
            k = max(decision.k, min(rate.k_cap, self.persist_need()))
            rate.overhead = max(self.config.overhead, decision.expected_overhead)
            if rate.k != k:
                rate.restart_at(k, k_floor=k)
                self._changed(rate.k, decision.bound)
            return
        need = self.persist_need()
        floor = min(rate.k_cap, max(self._base_floor, need))
        if rate.k < floor:
            rate.restart_at(floor, k_floor=floor)
            self._changed(rate.k, "persist")
        else:
            rate.k_floor = floor  # k may come down to it again, no lower

    def _changed(self, k: int, reason: str) -> None:
        self.version += 1
        self.history.append({"iteration": self._last_iteration, "k": k, "reason": reason,
                             "generation": self.generation})

    # ---------------------------------------------------------------- answers
    def decision(self) -> dict:
        """What rank 0 applies: the k, its version (new when k changed) and the figures behind it."""
        rate = self._rate
        return {
            "generation": self.generation,
            "k": self.k,
            "version": self.version,
            "k_floor": rate.k_floor if rate else None,
            "overhead": rate.last_overhead if rate else None,
            "overhead_error": rate.last_error if rate else None,
            "k_cap": rate.k_cap if rate else None,
            "persist_s": [p.seconds for p in self._persists],
            "persist_cpu_s": [p.cpu_s for p in self._persists],
            "iterations_aggregated": self._aggregated,
            "iter_ref_s": self._iter_ref_s,
            "restarts": self._restarts,
            "mtbf_s": self.mtbf_s(),
            "goodput_k": decision.k if (decision := self.goodput_decision()) is not None else None,
        }

