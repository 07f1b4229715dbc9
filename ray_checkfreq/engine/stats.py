"""The engine's statistics: what ran (iterations, stalls, checkpoints, persists) and why.

``EngineStats`` is plain numbers that the planner and the executor add to; ``report``
turns it, with the planner's policy and the k applied, into ``CheckFreq.stats()``.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from ray_checkfreq.engine.measured import RunOverhead
from ray_checkfreq.engine.persist import PersistResult
from ray_checkfreq.engine.policy import Decision, Profile, interval_overhead

# Why the planner asked for a checkpoint: its k, an epoch end, profiling's measurements, a stop.
# How many of the newest persists "recent" means: a preemption notice plans its stop from the
# slowest of them (one late persist must not lose the iterations trained after the notice).
RECENT_PERSISTS = 8
CHECKPOINT_CAUSES = ("interval", "epoch_end", "profiling", "notice", "stop")


@dataclass
class EngineStats:
    checkpoints_started: int = 0
    checkpoints_committed: int = 0
    fence_wait_s: float = 0.0
    persist_wait_s: float = 0.0
    profiling_s: float = 0.0  # training time the profiling checkpoints cost (measured)
    profiling: dict | None = None  # what the profiling window measured (ProfilingWindow.summary)
    stall_s: float = 0.0  # checkpoint work on the critical path: in step() and at the fence
    first_iteration: int | None = None
    iterations: int = 0  # after warm-up
    iter_time_s: float = 0.0
    iter_stall_s: float = 0.0
    quiet_iterations: int = 0
    quiet_time_s: float = 0.0
    raw_bytes: int = 0
    stored_bytes: int = 0
    last_persist_s: float | None = None
    last_persisted_step: int | None = None
    recent_persists_s: deque = field(default_factory=lambda: deque(maxlen=RECENT_PERSISTS))
    k_changes: list = field(default_factory=list)
    checkpoint_stalls: deque = field(default_factory=lambda: deque(maxlen=1024))
    run_overhead: RunOverhead = field(default_factory=RunOverhead)  # the measured overhead, since warm-up
    k_history: list = field(default_factory=list)  # the planner's k: {"iteration", "k", "reason"} per change
    checkpoints_by_cause: dict = field(default_factory=lambda: dict.fromkeys(CHECKPOINT_CAUSES, 0))
    restore_phases_s: dict | None = None  # the last sharded restore from storage: seconds per phase

    def note_k(self, iteration: int, k: int, reason: str) -> None:
        self.k_history.append({"iteration": iteration, "k": k, "reason": reason})

    def count_checkpoint(self, cause: str) -> None:
        self.checkpoints_by_cause[cause] += 1

    def since_start(self, iteration: int) -> int:
        """Iterations counted since this run began (0 before it began)."""
        return iteration - self.first_iteration if self.first_iteration is not None else 0

    def record_iteration(self, iter_s: float, stall_s: float, busy: bool, *, warm: bool) -> None:
        if not warm:
            return
        self.run_overhead.record(iter_s, stall_s, busy)
        self.iterations += 1
        self.iter_time_s += iter_s
        self.iter_stall_s += stall_s
        if not busy and stall_s == 0:
            self.quiet_iterations += 1
            self.quiet_time_s += iter_s

    def add_checkpoint_stall(self, seconds: float, same_checkpoint: bool = False) -> None:
        self.stall_s += seconds
        if same_checkpoint and self.checkpoint_stalls:
            self.checkpoint_stalls[-1] += seconds
        else:
            self.checkpoint_stalls.append(seconds)

    def iteration_s(self) -> float:
        """The mean quiet iteration (all iterations while fewer than 5 were quiet)."""
        if self.quiet_iterations >= 5:
            return self.quiet_time_s / self.quiet_iterations
        return self.iter_time_s / self.iterations if self.iterations else 0.0

    def record_persist(self, result: PersistResult) -> None:
        self.checkpoints_committed += 1
        self.raw_bytes += result.raw_bytes
        self.stored_bytes += result.stored_bytes
        self.last_persist_s = result.seconds
        self.recent_persists_s.append(result.seconds)
        self.last_persisted_step = max(self.last_persisted_step or 0, result.step)


@dataclass(frozen=True, kw_only=True)
class PolicyNow:
    """The planner's policy as ``stats()`` reports it."""

    decision: Decision | None
    profile: Profile | None
    k: int | None  # the planner's k
    codec_decided: str | None  # the compression trial's outcome (None: still measuring)

    def modelled_overhead(self) -> float | None:
        """The policy's model of the overhead at the k in force (None before it decided)."""
        if self.profile is None or self.decision is None or self.k is None:
            return None
        return interval_overhead(self.profile, self.decision.overhead_s, self.k)

    def compresses(self) -> bool | None:
        """Whether checkpoints are compressed; None while that is still being measured."""
        if self.profile is not None:
            return self.profile.compress
        return None if self.codec_decided is None else self.codec_decided == "rcfz"


def report(s: EngineStats, policy: PolicyNow, *, iteration: int, k_applied: int | None, mode: str) -> dict:
    """``CheckFreq.stats()``: ``mode`` is the snapshotter's while the policy has not decided."""
    decision = policy.decision
    measured = s.run_overhead.current()
    return {
        "mode": decision.mode if decision else mode,
        "k": k_applied,
        "iteration": iteration,
        "checkpoints_committed": s.checkpoints_committed,
        "stall_s_total": s.stall_s,
        "stall_s_per_checkpoint": s.stall_s / max(s.checkpoints_started, 1),
        "stall_s_median": statistics.median(s.checkpoint_stalls) if s.checkpoint_stalls else 0.0,
        "fence_wait_s": s.fence_wait_s,
        "persist_wait_s": s.persist_wait_s,
        "profiling_s": s.profiling_s,
        "profiling": s.profiling,
        "overhead_estimate": measured.share,
        "overhead_measured": measured.overhead,
        "overhead_measured_error": measured.error,
        "overhead_lost_s": max(0.0, measured.lost_s),
        "overhead_model": policy.modelled_overhead(),
        "k_history": [dict(entry) for entry in s.k_history],
        "restore_phases_s": dict(s.restore_phases_s) if s.restore_phases_s is not None else None,
        "checkpoints_by_cause": dict(s.checkpoints_by_cause),
        "profiling_checkpoints": list(s.profiling["checkpoints"]) if s.profiling else None,
        "k_cap": decision.k_cap if decision else None,
        "bytes_written": s.stored_bytes,
        "compression_ratio": (s.stored_bytes / s.raw_bytes) if s.raw_bytes else None,
        "compress": policy.compresses(),
        "last_persist_s": s.last_persist_s,
        "last_persisted_step": s.last_persisted_step,
        "slowest_recent_persist_s": max(s.recent_persists_s) if s.recent_persists_s else None,
        "k_changes": list(s.k_changes),
        "expected_lost_s": decision.expected_lost_s if decision else None,
        "young_daly_k": decision.young_daly_k if decision else None,
        "k_bound": decision.bound if decision else None,  # what set the policy's k: p, goodput, cap, lost_work
    }
