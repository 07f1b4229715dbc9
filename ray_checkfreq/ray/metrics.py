"""Checkpointing metrics through ``ray.util.metrics`` (on the dashboard / Prometheus where
``ray[default]`` is installed; recorded and kept in ``values()`` either way).

Rank 0 records the engine's figures every ``every_s`` seconds of training and each persist
result as it arrives. Tags: run, rank, node. Names start with ``checkfreq_``.

The overhead gauges are shares of wall time, in [0, 1]: the fraction of this attempt's
training time (since warm-up) checkpoints took, as measured from iteration times
(``overhead_ratio``, with one standard error ``overhead_ratio_error``) and as the policy's
model predicts it at the k in force (``overhead_model_ratio``). A budget p (a slowdown)
is the share p / (1 + p): 0.035 -> 0.0338.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ray_checkfreq.engine.measured import as_share

TAG_KEYS = ("run", "rank", "node")
PERSIST_BOUNDARIES_S = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]

_GAUGES = {
    "k": "checkpoint interval in iterations (k) in force",
    "stall_seconds": "training time spent waiting for checkpoints (total, this attempt)",
    "overhead_ratio": "share of training wall time checkpoints took, measured from iteration times, in [0, 1]",
    "overhead_ratio_error": "one standard error of overhead_ratio",
    "overhead_model_ratio": "share of training wall time the policy's model predicts at the k in force, in [0, 1]",
    "compression_ratio": "stored bytes over raw bytes of the checkpoints written",
    "lost_iterations": "iterations lost at the last restart (restored step vs the last iteration reached)",
    "registered_step": "the newest step registered with Ray Train as a pointer checkpoint",
}
_COUNTERS = {
    "bytes_written": "bytes written to checkpoint storage",
    "checkpoints_committed": "checkpoints committed",
    "restores": "restores (from a node agent's memory or from storage)",
    "notices_handled": "preemption notices handled",
}


class CheckFreqMetrics:
    """The run's metrics as one rank records them; ``values()`` has the latest of each."""

    def __init__(self, *, run: str, rank: int, node_id: str, every_s: float = 5.0) -> None:
        from ray.util import metrics

        self.tags = {"run": run, "rank": str(rank), "node": node_id[:12]}
        self.every_s = every_s
        self._last_emit = time.monotonic()
        self._values: dict[str, Any] = {name: 0 for name in _COUNTERS}
        self._gauges = {name: metrics.Gauge(f"checkfreq_{name}", description=text, tag_keys=TAG_KEYS)
                        for name, text in _GAUGES.items()}
        self._counters = {name: metrics.Counter(f"checkfreq_{name}", description=text, tag_keys=TAG_KEYS)
                          for name, text in _COUNTERS.items()}
        self._persist_s = metrics.Histogram("checkfreq_persist_seconds", description="seconds of one persist "
                                            "(encode, write, commit)", boundaries=PERSIST_BOUNDARIES_S,
                                            tag_keys=TAG_KEYS)

    def values(self) -> dict:
        return dict(self._values)

    def maybe_record_stats(self, stats: Callable[[], dict]) -> None:
        """Cheap unless ``every_s`` has passed: only then are the stats computed and recorded."""
        now = time.monotonic()
        if now - self._last_emit >= self.every_s:
            self._last_emit = now
            self.record_stats(stats())

    def record_stats(self, stats: dict) -> None:
        figures = {"k": stats.get("k"), "stall_seconds": stats.get("stall_s_total"),
                   "overhead_ratio": stats.get("overhead_estimate"),
                   "overhead_ratio_error": _share_error(stats.get("overhead_measured"),
                                                        stats.get("overhead_measured_error")),
                   "overhead_model_ratio": None if stats.get("overhead_model") is None
                   else as_share(stats["overhead_model"]),
                   "compression_ratio": stats.get("compression_ratio")}
        for name, value in figures.items():
            self._set(name, value)

    def record_persist(self, seconds: float, stored_bytes: int) -> None:
        self._persist_s.observe(max(float(seconds), 1e-9), tags=self.tags)
        self._values["persist_seconds"] = float(seconds)
        self._count("checkpoints_committed", 1)
        self._count("bytes_written", stored_bytes)

    def record_restore(self, kind: str, lost_iterations: int | None = None) -> None:
        if kind != "none":
            self._count("restores", 1)
        if lost_iterations is not None:
            self._set("lost_iterations", lost_iterations)

    def record_notices(self, total: int) -> None:
        """The number of preemption notices handled so far in this attempt."""
        self._count("notices_handled", total - self._values["notices_handled"])

    def record_registration(self, step: int) -> None:
        self._set("registered_step", step)

    def _set(self, name: str, value: Any) -> None:
        if value is None:
            return
        self._values[name] = value
        self._gauges[name].set(float(value), tags=self.tags)

    def _count(self, name: str, amount: float) -> None:
        self._values[name] += amount
        if amount > 0:
            self._counters[name].inc(float(amount), tags=self.tags)


def _share_error(overhead: float | None, error: float | None) -> float | None:
    """One standard error of a slowdown, carried to its share of wall time (d share / d o = 1 / (1 + o)^2)."""
    if overhead is None or error is None:
        return None
    return error / (1.0 + max(0.0, overhead)) ** 2
