"""Spot availability traces: parsed, sliced, time-compressed and scaled down to a local
cluster (pure: no Ray, no clock).

A trace file holds one event a line, ``time_ms,add|remove,node``: time in milliseconds
from the trace's start, ``add`` a node the cloud granted, ``remove`` a node it took back
(a spot preemption). ``read_trace`` refuses a malformed line, a clock that goes back, an
``add`` of a node already held and a ``remove`` of one not held, naming the file and line.

The mapping onto a local cluster of at most ``max_nodes`` training nodes
(``local_schedule``) keeps the trace's preemptions and scales its size down. ``peak`` is
the most nodes the slice holds at once, and ``scaled(live) = ceil(live * max_nodes /
peak)``, kept within ``[min_nodes, max_nodes]``. At each instant of the trace (its events
at one time, taken together):

1. if the instant removes ``r`` nodes, ``max(1, round(r * max_nodes / peak))`` local nodes
   are removed (as many as there are at most): a job that spans the fleet loses a node to
   every preemption, so every instant with a ``remove`` is a preemption locally too;
2. then nodes are added (or removed) until the local count is ``scaled(live)`` of the
   live count after the instant: the cloud's new nodes, which the job may grow onto.

Time runs ``compression`` times faster than the trace's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ACTIONS = ("add", "remove")


@dataclass(frozen=True)
class TraceEvent:
    time_s: float
    action: str  # "add" or "remove"
    node: str


@dataclass(frozen=True, kw_only=True)
class TraceSlice:
    """Which part of a trace to replay and how fast: ``start_s`` and ``duration_s`` (None:
    to the end) in trace seconds, ``compression`` trace seconds per replayed second."""

    start_s: float = 0.0
    duration_s: float | None = None
    compression: float = 1.0

    def __post_init__(self) -> None:
        if not (self.start_s >= 0 and math.isfinite(self.start_s)):
            raise ValueError(f"trace start {self.start_s!r}: must be a finite number of seconds >= 0")
        if self.duration_s is not None and not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"trace duration {self.duration_s!r}: must be a finite number of seconds > 0")
        if not (self.compression > 0 and math.isfinite(self.compression)):
            raise ValueError(f"compression {self.compression!r}: must be a finite factor > 0")


@dataclass(frozen=True)
class LocalEvent:
    """One change of the local cluster: ``at_s`` replayed seconds from the slice's start."""

    at_s: float
    action: str  # "add" or "remove"
    nodes_after: int  # the local target after it
    trace_time_s: float  # when the trace event that caused it happened (trace seconds)
    trace_live: int  # the trace's live count after that event


@dataclass(frozen=True)
class LocalSchedule:
    initial_nodes: int  # the local target when the slice starts
    events: list[LocalEvent]
    peak_live: int  # the most trace nodes held at once in the slice
    duration_s: float  # the slice's length, replayed


def read_trace(path: str | Path) -> list[TraceEvent]:
    """The events of a trace file in order; ValueError naming the file and line when it is not one."""
    events: list[TraceEvent] = []
    live: set[str] = set()
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            event = _parse_line(text, f"{path}:{number}")
            if events and event.time_s < events[-1].time_s:
                raise ValueError(f"{path}:{number}: time {event.time_s * 1000:.0f} ms is before the line above")
            if event.action == "add" and event.node in live:
                raise ValueError(f"{path}:{number}: node {event.node!r} added while it is held")
            if event.action == "remove" and event.node not in live:
                raise ValueError(f"{path}:{number}: node {event.node!r} removed while it is not held")
            (live.add if event.action == "add" else live.discard)(event.node)
            events.append(event)
    if not events:
        raise ValueError(f"{path}: no events")
    return events


def _parse_line(text: str, where: str) -> TraceEvent:
    fields = [field.strip() for field in text.split(",")]
    if len(fields) != 3:
        raise ValueError(f"{where}: expected 'time_ms,add|remove,node', got {text!r:.80}")
    time_ms, action, node = fields
    try:
        milliseconds = int(time_ms)
    except ValueError:
        raise ValueError(f"{where}: time {time_ms!r:.40} is not a whole number of milliseconds") from None
    if milliseconds < 0:
        raise ValueError(f"{where}: time {milliseconds} ms is negative")
    if action not in ACTIONS:
        raise ValueError(f"{where}: action {action!r:.40}: expected 'add' or 'remove'")
    if not node:
        raise ValueError(f"{where}: no node name")
    return TraceEvent(time_s=milliseconds / 1000.0, action=action, node=node)


def instants(events: Iterable[TraceEvent]) -> list[tuple[float, int, int]]:
    """(time, nodes removed then, live count after) for each time at which events happen."""
    out: list[tuple[float, int, int]] = []
    live = 0
    for event in events:
        removed = event.action == "remove"
        live += -1 if removed else 1
        if out and out[-1][0] == event.time_s:
            out[-1] = (event.time_s, out[-1][1] + removed, live)
        else:
            out.append((event.time_s, int(removed), live))
    return out


def local_schedule(events: list[TraceEvent], window: TraceSlice, *, max_nodes: int,
                   min_nodes: int = 1) -> LocalSchedule:
    """The slice ``window`` of ``events`` as changes of a local cluster of ``min_nodes`` to
    ``max_nodes`` training nodes (the module docstring's rule)."""
    if not 1 <= min_nodes <= max_nodes:
        raise ValueError(f"nodes ({min_nodes}, {max_nodes}): need 1 <= min <= max")
    moments = instants(events)
    last = moments[-1][0]
    if window.start_s >= last:
        raise ValueError(f"trace start {window.start_s} s: the trace's last event is at {last} s")
    end = last if window.duration_s is None else window.start_s + window.duration_s
    before = [live for time, _, live in moments if time <= window.start_s]
    inside = [moment for moment in moments if window.start_s < moment[0] <= end]
    initial_live = before[-1] if before else 0
    peak = max([initial_live] + [live for _, _, live in inside])
    if peak == 0:
        raise ValueError(f"the trace holds no node from {window.start_s} s to {end} s")

    def scaled(count: int) -> int:
        return min(max_nodes, max(min_nodes, math.ceil(count * max_nodes / peak)))

    nodes = scaled(initial_live)
    local: list[LocalEvent] = []
    for time, removed, live in inside:
        at = (time - window.start_s) / window.compression
        lost = min(nodes, max(1, round(removed * max_nodes / peak))) if removed else 0
        for _ in range(lost):
            nodes -= 1
            local.append(LocalEvent(at_s=at, action="remove", nodes_after=nodes, trace_time_s=time, trace_live=live))
        while nodes != scaled(live):
            step = 1 if scaled(live) > nodes else -1
            nodes += step
            local.append(LocalEvent(at_s=at, action="add" if step > 0 else "remove", nodes_after=nodes,
                                    trace_time_s=time, trace_live=live))
    return LocalSchedule(initial_nodes=scaled(initial_live), events=local, peak_live=peak,
                         duration_s=(end - window.start_s) / window.compression)
