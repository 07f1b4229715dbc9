"""The goodput replay (benchmarks/goodput_replay.py): its accounting over synthetic logs,
and one short real replay of ours through ``ray-checkfreq bench goodput`` (a child
process with its own cluster)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.goodput_replay import (
    ReplayJob,
    _checkpoint_stall,
    _driver_instants,
    _interval,
    figures,
    model_check,
)
from ray_checkfreq.chaos.trace import LocalSchedule


def _run() -> dict:
    """Two attempts: the first trains to 30 from 0 at 10 it/s, a node goes at t = 103.5,
    the second restores 20 (entered 110, set up 112, restored 113) and trains to 50."""
    log = [{"t": 100.0, "event": "start", "iteration": 0}]
    log += [{"t": 100.0 + i / 10, "event": "step", "iteration": i, "ckpt_s": 0.05 if i % 10 == 0 else 0.0}
            for i in range(1, 31)]
    log += [{"t": 113.0, "event": "start", "iteration": 20}]
    log += [{"t": 113.0 + (i - 20) / 10, "event": "step", "iteration": i, "ckpt_s": 0.05 if i % 10 == 0 else 0.0}
            for i in range(21, 51)]
    workers = [{"t": 101, "rank": 0, "node": "a", "t_entered": 99.0, "t_set_up_begin": 99.5, "t_restoring": 99.5,
                "t_start": 100.0},
               {"t": 113, "rank": 0, "node": "a", "t_entered": 110.0, "t_set_up_begin": 111.0, "t_restoring": 112.5,
                "t_start": 113.0},
               {"t": 113, "rank": 1, "node": "b", "t_entered": 110.5, "t_set_up_begin": 112.0,
                "t_restoring": 112.2, "t_start": 113.0}]
    driver = [{"t": 100.1, "event": "first_step"}, {"t": 103.5, "event": "remove", "node": "b"},
              {"t": 116.05, "event": "stop"}]
    return {"variant": "ours", "log": log, "workers": workers, "driver": driver, "error": None}


def test_the_figures_of_a_run_come_from_its_log_and_the_driver_events() -> None:
    row = figures(_run(), reference_rate=10.0)
    assert row["iterations_kept"] == 50 and row["iterations_recomputed"] == 30 - 20 and row["restarts"] == 1
    assert row["goodput"] == pytest.approx(50 / (10.0 * 15.95), abs=1e-4)
    (recovery,) = row["recoveries"]
    assert recovery["to_next_step_s"] == pytest.approx(113.1 - 103.5)
    assert recovery["group_restart_and_process_start_s"] == pytest.approx(110.5 - 103.5)  # the slowest rank
    assert recovery["job_set_up_s"] == pytest.approx(112.0 - 110.5)
    assert recovery["checkpointing_s"] == pytest.approx(113.0 - 112.0)
    assert recovery["restore_s"] == pytest.approx(113.0 - 112.5)
    assert recovery["resumed_at"] == 20
    assert _checkpoint_stall(_run()["log"], "ours", ReplayJob()) == pytest.approx(0.05)
    down = _run()
    down["driver"].insert(2, {"t": 116.02, "event": "remove", "node": "a"})  # lost after its last step
    down["log"].append({"t": 130.0, "event": "start", "iteration": 40})
    assert figures(down, reference_rate=10.0)["iterations_kept"] == 40  # what the next attempt resumed
    assert _checkpoint_stall(_run()["log"], "sync", ReplayJob(every=10)) == pytest.approx(0.05)


def test_a_step_logged_as_its_node_went_is_not_kept_and_a_hit_restart_is_not_one_restarts_cost() -> None:
    killed = _run()  # node b, rank 1's, goes just before rank 0 logs iteration 50; then 40 resumes
    killed["driver"].insert(2, {"t": 115.99, "event": "remove", "node": "b"})
    killed["log"].append({"t": 130.0, "event": "start", "iteration": 40})
    assert figures(killed, reference_rate=10.0)["iterations_kept"] == 40
    hit = _run()  # a second node goes while the job restarts: the first restart began again
    hit["driver"][1]["nodes"] = 2
    hit["driver"].insert(2, {"t": 105.0, "event": "remove", "node": "c", "nodes": 1})
    first, second = figures(hit, reference_rate=10.0)["recoveries"]
    assert first["hit"] and not second["hit"] and second["to_next_step_s"] == pytest.approx(113.1 - 105.0)
    schedule = LocalSchedule(initial_nodes=3, peak_live=3, duration_s=16.0, events=[])
    rows = [figures(hit, reference_rate=10.0)]
    (modelled,) = model_check(rows, {"ours": hit}, schedule, ReplayJob(), rate=10.0, max_nodes=3)
    assert modelled["restart_s"] == pytest.approx(113.1 - 105.0 - 0.5)  # the clean one, its restore apart
    # the model gets each loss at the driver's time and its own restart, the restore apart
    assert _driver_instants(hit, 3) == [(0.0, 0, 3), (pytest.approx(3.4), 1, 2), (pytest.approx(4.9), 1, 1)]
    assert modelled["restarts_s"] == pytest.approx([113.1 - 103.5 - 0.5, 113.1 - 105.0 - 0.5])
    # a step's own time is the gap to the one before less its checkpoint call (0.05 s at each 10th)
    assert modelled["step_s"] == pytest.approx((2 * 26 * 0.1 - 6 * 0.05) / 52, abs=1e-4)


def test_ours_k_is_the_one_the_job_logged_else_the_span_between_its_snapshots() -> None:
    log = _run()["log"]
    assert _interval(log) == 10  # snapshots at 10, 20, 30 from 0; at 30, 40, 50 from 20
    log[5]["k"], log[25]["k"] = 7, 8
    assert _interval(log) == 8  # the mean of 7 and 8, rounded
    # at k = 5 the six 0.05 s calls of 60 steps make 12 snapshots of 0.025 s: as long in all
    assert _checkpoint_stall(log, "ours", ReplayJob(), k=5) == pytest.approx(5 * 6 * 0.05 / 60)


def test_the_driver_events_become_the_models_instants_those_of_one_time_together() -> None:
    run = _run()
    run["driver"][1:2] = [{"t": 105.1, "event": "remove", "node": "b", "nodes": 1},
                          {"t": 105.1, "event": "add", "node": "c", "nodes": 2},
                          {"t": 110.1, "event": "remove", "node": "a", "nodes": 1}]
    assert _driver_instants(run, 2) == [(0.0, 0, 2), (pytest.approx(5.0), 1, 2), (pytest.approx(10.0), 1, 1)]


@pytest.mark.chaos
@pytest.mark.integration
def test_a_short_replay_of_ours_measures_its_restart_and_runs_the_model_beside_it(tmp_path) -> None:
    out = tmp_path / "goodput.json"
    done = subprocess.run(
        [sys.executable, "-m", "ray_checkfreq.cli", "bench", "goodput", "--variants", "ours", "--replay-start",
         "10800", "--replay-duration", "750", "--compression", "30", "--max-nodes", "2", "--state-gb", "0.25",
         "--reference-s", "6", "--json", str(out), "--work-dir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=600)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    replay = json.loads(out.read_text())["replay"]
    (row,) = replay["variants"]
    assert row["variant"] == "ours" and row["error"] is None, done.stdout[-3000:]
    assert row["preemptions"] >= 1 and row["restarts"] >= 1 and row["iterations_kept"] > 0, done.stdout[-3000:]
    recovery = row["recoveries"][0]
    assert recovery["to_next_step_s"] >= recovery["checkpointing_s"] >= recovery["restore_s"] >= 0
    assert replay["reference_rate"] > 0 and replay["model"][0]["variant"] == "ours"
