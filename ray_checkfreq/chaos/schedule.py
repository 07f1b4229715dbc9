"""When to preempt, and how: pure, seeded schedules (no Ray, no clock).

A schedule is a list of ``Preemption`` values in the order they are injected. Each one
fires once the job reaches an iteration (``at_iteration``), once the job has run for some
seconds since it last resumed (``after_s``: the Poisson schedule measures time between
preemptions in running time, as a spot fleet's "one preemption every 5 hours" counts hours
of work, scaled down), or at a time since the job's first step (``at_s``: a spot trace's
clock, ``trace.trace_plan``). The kinds cycle in the order given, so
``kinds=("commit", "node")`` with 4 preemptions gives commit, node, commit, node.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ray_checkfreq.chaos.trace import LocalSchedule

KINDS = {
    "worker": "SIGKILL of a training worker",
    "agent": "SIGKILL of a node agent (its RAM snapshots go with it)",
    "node": "loss of a whole node (Cluster.remove_node, allow_graceful=False; on a real cluster: stop its raylet)",
    "notice": "drain notice with a deadline (GcsClient.drain_node, reason PREEMPTION), the node removed after it",
    "snapshot": "SIGKILL of the training worker while it copies a snapshot into its slot",
    "persist": "SIGKILL of the persisting node agent (and the workers on its node) while it writes shards",
    "commit": "SIGKILL of the persisting node agent (and the workers on its node) between writing "
              "and renaming the manifest",
}
SCHEDULES = {
    "iterations": "at the iterations given (--at), else spread evenly over the run",
    "random": "seeded uniform iterations, at least --min-gap apart",
    "poisson": "seeded exponential gaps of running time with mean --mtbp-s seconds",
    "trace": "a spot trace's node losses and additions (--trace), sliced, time-compressed and scaled to --nodes",
}


@dataclass(frozen=True, kw_only=True)
class Preemption:
    index: int
    kind: str
    at_iteration: int | None = None
    after_s: float | None = None  # running seconds since the job last resumed
    at_s: float | None = None  # seconds since the job's first step (a trace's clock)
    target: int = 0  # picks the rank (modulo the world size) whose process or node is hit

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if sum(when is not None for when in (self.at_iteration, self.after_s, self.at_s)) != 1:
            raise ValueError("a preemption fires at an iteration, after running seconds or at a time: "
                             "exactly one of them")


def parse_kinds(text: str) -> tuple[str, ...]:
    """``"node,commit"`` -> ("node", "commit"); an unknown kind is named in the error."""
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    if not kinds:
        raise ValueError(f"--kinds {text!r}: name at least one of {', '.join(KINDS)}")
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"--kinds: unknown kind {kind!r}; expected some of {', '.join(KINDS)}")
    return kinds


def _kind(kinds: tuple[str, ...], index: int) -> str:
    if not kinds:
        raise ValueError("kinds: name at least one kind")
    return kinds[index % len(kinds)]


def _targets(count: int, seed: int) -> list[int]:
    rng = random.Random(f"targets-{seed}")
    return [rng.randrange(1 << 16) for _ in range(count)]


def at_iterations(iterations: list[int], kinds: tuple[str, ...], *, seed: int = 0) -> list[Preemption]:
    """One preemption at each iteration given (sorted; each must be >= 1 and distinct)."""
    if any(i < 1 for i in iterations) or len(set(iterations)) != len(iterations):
        raise ValueError(f"iterations {iterations}: each must be >= 1, and distinct")
    targets = _targets(len(iterations), seed)
    return [Preemption(index=n, kind=_kind(kinds, n), at_iteration=i, target=targets[n])
            for n, i in enumerate(sorted(iterations))]


def evenly(count: int, kinds: tuple[str, ...], *, first: int, last: int, seed: int = 0) -> list[Preemption]:
    """``count`` preemptions spread evenly over iterations [first, last]."""
    _check_window(count, first, last, min_gap=1)
    step = (last - first) / max(count - 1, 1)
    return at_iterations([first + round(n * step) for n in range(count)], kinds, seed=seed)


def seeded_random(count: int, kinds: tuple[str, ...], *, first: int, last: int, min_gap: int,
                  seed: int) -> list[Preemption]:
    """``count`` iterations drawn uniformly from [first, last], at least ``min_gap`` apart.

    Drawn as ``count`` sorted uniform points in the window shrunk by the gaps, then spread
    out again: every valid placement is possible, and the same seed gives the same list.
    """
    _check_window(count, first, last, min_gap)
    rng = random.Random(f"iterations-{seed}")
    slack = (last - first) - (count - 1) * min_gap
    points = sorted(rng.randint(0, slack) for _ in range(count))
    return at_iterations([first + p + n * min_gap for n, p in enumerate(points)], kinds, seed=seed)


def poisson(count: int, kinds: tuple[str, ...], *, mtbp_s: float, seed: int) -> list[Preemption]:
    """Gaps of running time drawn from an exponential law with mean ``mtbp_s`` (a Poisson process)."""
    if count < 0:
        raise ValueError(f"preemptions={count}: must be >= 0")
    if not mtbp_s > 0:
        raise ValueError(f"mtbp_s={mtbp_s}: the mean time between preemptions must be > 0 seconds")
    rng = random.Random(f"poisson-{seed}")
    targets = _targets(count, seed)
    return [Preemption(index=n, kind=_kind(kinds, n), after_s=rng.expovariate(1.0 / mtbp_s), target=targets[n])
            for n in range(count)]


TRACE_KINDS = ("node", "notice")  # what a spot trace's ``remove`` can be


@dataclass(frozen=True)
class TracePlan:
    """A trace slice as the injector runs it: its node losses as preemptions and the times
    (seconds since the job's first step) at which nodes are added."""

    initial_nodes: int
    preemptions: list[Preemption]
    additions_s: list[float]
    duration_s: float


def from_trace(local: LocalSchedule, kinds: tuple[str, ...], *, notice_s: float = 0.0, seed: int = 0) -> TracePlan:
    """Every ``remove`` of ``local`` as a node loss (kinds cycling, ``node`` or ``notice``),
    every ``add`` as a node added. A ``notice`` fires ``notice_s`` before the trace's time, so
    that its node goes when the trace says (its deadline is ``notice_s``)."""
    unsupported = [kind for kind in kinds if kind not in TRACE_KINDS]
    if unsupported:
        raise ValueError(f"kinds {', '.join(unsupported)}: a trace loses nodes; use {' or '.join(TRACE_KINDS)}")
    if notice_s < 0:
        raise ValueError(f"notice_s={notice_s!r}: must be >= 0")
    removals = [event for event in local.events if event.action == "remove"]
    targets = _targets(len(removals), seed)
    fired = sorted((max(0.0, event.at_s - notice_s) if _kind(kinds, n) == "notice" else event.at_s, n)
                   for n, event in enumerate(removals))
    preemptions = [Preemption(index=i, kind=_kind(kinds, n), at_s=at, target=targets[n])
                   for i, (at, n) in enumerate(fired)]
    return TracePlan(initial_nodes=local.initial_nodes, preemptions=preemptions,
                     additions_s=[event.at_s for event in local.events if event.action == "add"],
                     duration_s=local.duration_s)


def _check_window(count: int, first: int, last: int, min_gap: int) -> None:
    if count < 0:
        raise ValueError(f"preemptions={count}: must be >= 0")
    if first < 1 or last < first:
        raise ValueError(f"window [{first}, {last}]: need 1 <= first <= last")
    if min_gap < 1:
        raise ValueError(f"min_gap={min_gap}: must be >= 1")
    if count > 1 and (count - 1) * min_gap > last - first:
        raise ValueError(f"{count} preemptions at least {min_gap} iterations apart do not fit in "
                         f"iterations [{first}, {last}]")
