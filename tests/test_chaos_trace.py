"""Spot traces (ray_checkfreq/chaos/trace.py): parsing that names the bad line, and the
mapping onto a small local cluster that keeps every preemption instant of the slice."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq.chaos.trace import TraceEvent, TraceSlice, instants, local_schedule, read_trace

SHIPPED = Path(__file__).resolve().parent.parent / "benchmarks" / "traces" / "ec2-p3-spot.csv"


def test_the_shipped_ec2_trace_parses_with_its_known_shape() -> None:
    events = read_trace(SHIPPED)
    assert len(events) == 344
    assert sum(e.action == "remove" for e in events) == 167
    moments = instants(events)
    assert max(live for _, _, live in moments) == 32
    assert round(moments[-1][0] / 3600, 1) == 11.4
    assert sum(1 for _, removed, _ in moments if removed) == 79  # instants with a preemption


@pytest.mark.parametrize(("text", "reason"), [
    ("0,add,a\n5,add\n", r":2: expected 'time_ms,add\|remove,node'"),
    ("0,add,a\nsoon,add,b\n", r":2: time 'soon' is not a whole number"),
    ("0,add,a\n-5,add,b\n", r":2: time -5 ms is negative"),
    ("10,add,a\n5,add,b\n", r":2: time 5 ms is before the line above"),
    ("0,add,a\n5,add,a\n", r":2: node 'a' added while it is held"),
    ("0,add,a\n5,remove,b\n", r":2: node 'b' removed while it is not held"),
    ("0,add,a\n5,grow,b\n", r":2: action 'grow'"),
    ("# nothing\n", r": no events"),
])
def test_a_bad_trace_is_refused_naming_its_file_and_line(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"bad.csv{reason}"):
        read_trace(path)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"start_s": -1.0}, "trace start"), ({"duration_s": 0.0}, "trace duration"), ({"compression": 0.0}, "compression"),
])
def test_a_bad_slice_is_refused(kwargs: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        TraceSlice(**kwargs)


@st.composite
def traces(draw: st.DrawFn) -> list[TraceEvent]:
    """Valid traces: each step removes some held nodes and adds some new ones at one time."""
    events, live, fresh, time = [], [], 0, 0.0
    for _ in range(draw(st.integers(1, 25))):
        time += draw(st.sampled_from([0.0, 1.0, 30.0, 600.0]))
        for node in draw(st.lists(st.sampled_from(live), unique=True)) if live else []:
            live.remove(node)
            events.append(TraceEvent(time, "remove", node))
        for _ in range(draw(st.integers(0 if live else 1, 6))):
            fresh += 1
            live.append(f"n{fresh}")
            events.append(TraceEvent(time, "add", f"n{fresh}"))
    events.append(TraceEvent(time + 600.0, "add", "last"))  # the trace goes on past its start
    return events


@settings(max_examples=300, deadline=None)
@given(events=traces(), max_nodes=st.integers(1, 4), min_nodes=st.integers(1, 4),
       compression=st.sampled_from([1.0, 4.0, 60.0]))
def test_the_local_cluster_keeps_every_preemption_and_follows_the_scaled_live_count(
        events: list[TraceEvent], max_nodes: int, min_nodes: int, compression: float) -> None:
    min_nodes = min(min_nodes, max_nodes)
    moments = instants(events)
    schedule = local_schedule(events, TraceSlice(compression=compression), max_nodes=max_nodes, min_nodes=min_nodes)
    inside = [m for m in moments if m[0] > 0]
    peak = max([live for t, _, live in moments if t <= 0] + [live for _, _, live in inside] + [0])
    assert schedule.peak_live == peak

    def scaled(live: int) -> int:
        return min(max_nodes, max(min_nodes, math.ceil(live * max_nodes / peak)))

    nodes = schedule.initial_nodes
    by_time: dict[float, list] = {}
    for event in schedule.events:
        assert nodes + (1 if event.action == "add" else -1) == event.nodes_after
        nodes = event.nodes_after
        assert 0 <= nodes <= max_nodes
        by_time.setdefault(event.trace_time_s, []).append(event)
        assert event.at_s == pytest.approx(event.trace_time_s / compression)
    for time, removed, live in inside:
        changes = by_time.get(time, [])
        if removed:  # a preemption instant: it takes at least one local node first
            assert changes and changes[0].action == "remove"
        count = changes[-1].nodes_after if changes else None
        if count is not None:
            assert count == scaled(live)


def test_a_slice_starts_from_the_live_count_at_its_start_and_is_compressed() -> None:
    events = [TraceEvent(0, "add", "a"), TraceEvent(0, "add", "b"), TraceEvent(0, "add", "c"),
              TraceEvent(0, "add", "d"), TraceEvent(100, "remove", "a"), TraceEvent(200, "remove", "b"),
              TraceEvent(200, "remove", "c"), TraceEvent(300, "add", "e"), TraceEvent(400, "remove", "d")]
    schedule = local_schedule(events, TraceSlice(start_s=150, duration_s=200, compression=10), max_nodes=2)
    assert (schedule.initial_nodes, schedule.peak_live, schedule.duration_s) == (2, 3, 20.0)
    assert [(e.at_s, e.action, e.nodes_after) for e in schedule.events] == [
        (5.0, "remove", 1),  # two of the fleet's three gone at once: round(2 * 2 / 3) = 1 local node
        (15.0, "add", 2)]    # one granted: ceil(2 * 2 / 3) = 2 (the remove at 400 s is past the slice)
    with pytest.raises(ValueError, match="the trace's last event is at 400 s"):
        local_schedule(events, TraceSlice(start_s=400), max_nodes=2)


# ---------------------------------------------------------------------- the chaos harness's trace schedule
TINY = "0,add,a\n0,add,b\n0,add,c\n60000,remove,a\n60000,remove,b\n240000,add,d\n240000,add,e\n420000,remove,c\n"


def _tiny(tmp_path: Path) -> str:
    path = tmp_path / "tiny.csv"
    path.write_text(TINY)
    return str(path)


def test_a_trace_plan_loses_a_node_at_each_remove_and_adds_one_at_each_add(tmp_path: Path) -> None:
    from ray_checkfreq.chaos.runner import ChaosConfig, plan, trace_plan

    config = ChaosConfig(schedule="trace", trace=_tiny(tmp_path), kinds=("node",), workers=(1, 2), nodes=3,
                         replace=False, compression=30.0)
    traced = trace_plan(config)
    assert traced.initial_nodes == 3 and traced.duration_s == 14.0
    assert [(p.kind, p.at_s) for p in traced.preemptions] == [("node", 2.0), ("node", 2.0), ("node", 14.0)]
    assert [p.index for p in traced.preemptions] == [0, 1, 2]
    assert traced.additions_s == [8.0, 8.0]
    assert plan(config) == traced.preemptions


def test_a_noticed_trace_loss_is_drained_its_notice_before_the_traces_time(tmp_path: Path) -> None:
    from ray_checkfreq.chaos.runner import ChaosConfig, trace_plan

    config = ChaosConfig(schedule="trace", trace=_tiny(tmp_path), kinds=("notice", "node"), notice_s=1.5,
                         workers=(1, 2), nodes=3, replace=False, compression=30.0)
    assert [(p.kind, p.at_s) for p in trace_plan(config).preemptions] == [
        ("notice", 0.5), ("node", 2.0), ("notice", 12.5)]


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"schedule": "trace"}, "a trace file goes with the 'trace' schedule"),
    ({"trace": "x.csv"}, "a trace file goes with the 'trace' schedule"),
    ({"schedule": "trace", "trace": "x.csv", "replace": True}, "replace must be False"),
    ({"schedule": "trace", "trace": "x.csv", "replace": False, "kinds": ("notice",)}, "exactly when notice_s > 0"),
    ({"schedule": "trace", "trace": "x.csv", "replace": False, "compression": 0.0}, "compression 0.0"),
])
def test_a_bad_trace_setting_is_refused_by_name(kwargs: dict, reason: str) -> None:
    from ray_checkfreq.chaos.runner import ChaosConfig

    with pytest.raises(ValueError, match=reason):
        ChaosConfig(**{"kinds": ("node",), **kwargs})


def test_a_trace_loses_only_nodes() -> None:
    from ray_checkfreq.chaos.schedule import from_trace

    local = local_schedule([TraceEvent(0.0, "add", "a"), TraceEvent(5.0, "remove", "a")], TraceSlice(), max_nodes=1)
    with pytest.raises(ValueError, match="kinds worker: a trace loses nodes"):
        from_trace(local, ("worker",))


def test_the_cli_makes_a_trace_run_elastic_without_node_replacement(tmp_path: Path) -> None:
    import argparse

    from ray_checkfreq.chaos import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["chaos", "--trace", _tiny(tmp_path), "--workers", "2", "--nodes", "3",
                              "--notice-s", "1"])
    config = cli.config_from_args(args)
    assert config.schedule == "trace" and config.workers == (1, 2) and not config.replace
    assert config.kinds == ("notice",) and config.notice_s == 1.0 and config.tolerance == 1e-9
