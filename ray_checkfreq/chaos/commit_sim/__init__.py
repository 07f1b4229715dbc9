"""Deterministic simulation of the commit protocol (docs/guarantees.md, "The commit
protocol, simulated"): real store code, an in-memory backend whose every operation is a
yield point, a seeded scheduler that interleaves writers of several generations, readers
and stray files, with kills and pauses, and the invariants checked after every schedule."""

from ray_checkfreq.chaos.commit_sim.runner import Outcome, SimConfig, Summary, report, run_many, run_schedule, shrink
from ray_checkfreq.chaos.commit_sim.scheduler import Faults
from ray_checkfreq.chaos.commit_sim.workload import Workload

__all__ = ["Faults", "Outcome", "SimConfig", "Summary", "Workload", "report", "run_many", "run_schedule", "shrink"]
