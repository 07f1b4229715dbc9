"""``ray-checkfreq chaos`` end to end: preemptions of mixed kinds injected into a real TorchTrainer run.

Each run is a child process with its own ``cluster_utils.Cluster`` (adding nodes to the
session cluster late in a run is unreliable, and a lost node here is replaced with
``add_node``). The uninterrupted run's weights are computed once and shared through a
cache directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.chaos

ITERATIONS = "56"  # 2 epochs of 28


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("chaos-reference")


def chaos(tmp_path, cache_dir, *args: str, env: dict | None = None) -> tuple[dict, str]:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "ray_checkfreq.cli", "chaos", "--iterations", ITERATIONS, "--json", str(out),
         "--work-dir", str(tmp_path / "work"), "--cache-dir", str(cache_dir), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout + f"\n(exit status {done.returncode})\n" + done.stderr[-3000:]


def test_mixed_preemptions_on_a_fixed_world_end_bit_identical_with_every_sample_once(tmp_path, cache_dir):
    # A kill during an agent's persist is tests/test_ray_train.py's (with where the restart began).
    report, output = chaos(tmp_path, cache_dir, "--preemptions", "2", "--kinds", "notice,commit",
                           "--png", str(tmp_path / "timeline.png"))
    assert report["finished"] and not report["injector_errors"], output
    outcomes = report["detail"]["preemptions"]
    assert [o["kind"] for o in outcomes] == ["notice", "commit"], output
    assert all(o["restarted"] for o in outcomes), output
    assert report["preemptions_survived"] == 2
    assert report["identical_to_uninterrupted"] is True, output
    assert report["samples_lost"] == 0 and report["samples_repeated"] == 0, output
    assert report["k_max"] == 4 and report["lost_iterations_max"] <= 2 * report["k_max"], output
    assert next(o for o in outcomes if o["kind"] == "notice")["lost_iterations"] == 0, output
    # the world size stayed fixed: the drained node was replaced (a node lost without notice:
    # the elastic run below, and tests/test_ray_train.py)
    assert report["nodes_replaced"] == 1 and {a["world_size"] for a in report["detail"]["attempts"]} == {2}
    # restarts began at a checkpoint, not from scratch
    assert all(o["restored_step"] > 0 for o in outcomes), output
    assert "final weights identical to an uninterrupted run: yes" in output
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


# Two nodes; the trace loses one, grants a new one, then loses the other (at compression 12:
# 8 s, 20 s and 30 s after the first step).
TRACE = "0,add,a\n0,add,b\n96000,remove,a\n240000,add,c\n360000,remove,b\n"


def test_a_spot_trace_shrinks_and_regrows_an_elastic_run_with_every_sample_once(tmp_path, cache_dir):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    report, output = chaos(tmp_path, cache_dir, "--trace", str(trace), "--compression", "12", "--sleep-s", "0.4",
                           "--workers", "2", "--nodes", "2",
                           env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"})
    assert report["finished"] and not report["injector_errors"], output
    assert report["preemptions_survived"] == 2 and report["nodes_added"] == 1, output
    events = [json.loads(line) for line in next((tmp_path / "work").glob("chaos-*/events.jsonl")).open()]
    first_step = min(e["t"] for e in events if e["event"] == "batch")
    injects = [e for e in events if e["event"] == "inject"]
    added = next(e for e in events if e["event"] == "add")
    # the trace's clock: each loss at its time or later (the second waits for the restart)
    assert injects[0]["t"] >= first_step + 8.0 and added["t"] >= first_step + 20.0, output
    assert injects[1]["t"] >= max(first_step + 30.0, added["t"]), output
    # the job ran on the node the trace granted, and never on a lost one after its loss
    later = [e for e in events if e["event"] == "start" and e["t"] > added["t"]]
    assert added["node"] in {e["node"] for e in later}, output
    lost = {e["node"]: e["t_kill"] for e in injects}
    assert all(e["t"] < lost.get(e["node"], float("inf")) for e in events if e["event"] == "start"), output
    assert report["detail"]["attempts"][0]["world_size"] == 2, output
    assert report["samples_lost"] == 0 and report["samples_repeated"] == 0, output
    assert report["lost_iterations_max"] <= 2 * report["k_max"], output
    assert all(o["restored_step"] > 0 for o in report["detail"]["preemptions"]), output
    # one worker follows two up to the reduction order of float64 sums
    assert report["max_abs_diff"] is not None and report["max_abs_diff"] <= 1e-9, output
