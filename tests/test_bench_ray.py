"""``ray-checkfreq bench ray``: a smoke run (its own 2-node cluster, one ``fit()``, in a child
process) and the pure parts (k, per-round overhead, targets) without Ray."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import ray_bench
from benchmarks import ray_bench_job as job

TRAIN_RESOURCE = "rcf_train"  # the session cluster's train nodes (conftest.py)
REQUIRED = ("k", "overhead_ours_policy", "overhead_ours_same_k", "overhead_report_sync", "overhead_report_async")
CONFIG = {"width": 8, "layers": 1, "batch": 2, "iterations": 10, "warmup": 2, "repeats": 2, "overhead": 0.035,
          "min_interval_s": 2.0, "epoch_len": 100, "profile_iters": 2}


@pytest.mark.chaos
def test_smoke_run_measures_every_variant_and_a_recovery(ray_cluster, tmp_path):
    out = tmp_path / "ray.json"
    # On the session's cluster (two of its one-CPU train nodes; starting a cluster of its own
    # would cost ~12 s more), from a child process: the bench is a driver of its own.
    train_nodes = [node for node in ray_cluster.worker_nodes if node.node_id in _alive_train_node_ids()]
    assert len(train_nodes) >= 2, "the session cluster has fewer than 2 train nodes left"
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-m", "ray_checkfreq.cli", "bench", "ray", "--state-mb", "2", "--iterations", "8",
         "--warmup", "4", "--repeats", "1", "--every", "4", "--json", str(out),
         "--address", ray_cluster.address, "--worker-resource", TRAIN_RESOURCE],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert _actors_of_run("bench-ray") == [], "the run's agents or policy actor outlived fit() on a shared cluster"
    figures = json.loads(out.read_text())
    for key in REQUIRED:
        assert math.isfinite(figures[key]), key
    assert figures["k"] == 4
    variants = figures["variants"]
    assert set(variants) == set(job.VARIANTS)
    # In the timed stretch (iterations 5-12): checkpoints at 8 and 12, for each at k = 4.
    assert variants[job.REPORT_SYNC]["checkpoints"] == [2]
    assert variants[job.REPORT_ASYNC]["checkpoints"] == [2]
    assert variants[job.OURS_SAME_K]["checkpoints"] == [2]
    assert variants[job.OURS_SAME_K_NO_REPLICAS]["checkpoints"] == [2]
    assert variants[job.OURS_POLICY]["runs"][0]["policy_decided_before_timing"] is True
    recovery = figures["recovery"]
    assert recovery["killed_at"] == job.recovery_kill_at(4) == 10
    # The snapshot of iteration 8 lives in the agents' slots: the restart loses only what
    # followed it, never more than one interval.
    assert 0 < recovery["lost_iterations"] <= 4, recovery
    assert recovery["restart_to_first_step_s"] > recovery["restore_s"] >= 0
    for name in ("ours_policy_within_p", "ours_same_k_vs_sync", "ours_same_k_below_async"):
        assert f"target {name}: " in done.stdout
    for name in job.VARIANTS:  # every variant's timed iterations were recorded
        runs = variants[name]["runs"]
        assert len(runs[0]["iteration_ends_s"]) == runs[0]["iterations"], name
        assert math.isfinite(figures["spikes"][name]), name


def _alive_train_node_ids() -> set[str]:
    import ray

    return {node["NodeID"] for node in ray.nodes() if node["Alive"] and TRAIN_RESOURCE in node["Resources"]}


def _actors_of_run(name: str) -> list[str]:
    import ray

    from ray_checkfreq.ray.names import NAMESPACE, run_key

    key = run_key(name)
    return [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == NAMESPACE and key in entry["name"]]


def test_k_is_the_smallest_interval_past_the_report_throttle():
    assert job.choose_k(0.2, 2.0) == 10
    assert job.choose_k(0.21, 2.0) == 10  # 9 x 0.21 s = 1.89 s is too short
    assert job.choose_k(0.19, 2.0) == 11
    assert job.choose_k(5.0, 2.0) == 1


def test_the_kill_lands_mid_interval_after_the_second_checkpoint():
    for k in (2, 4, 7, 10):
        at = job.recovery_kill_at(k)
        assert 2 * k < at < 3 * k


def _results() -> list[dict]:
    """Two rounds on a machine that slows down: baselines of 10 iterations in 10 s, 30 s, then
    a closing 10 s. Every round's reference is 2 s per iteration (the mean of the baselines
    around it); each variant took the reference times (1 + its overhead) per iteration."""
    overheads = {job.REPORT_SYNC: 0.5, job.REPORT_ASYNC: 0.1, job.OURS_POLICY: 0.03, job.OURS_SAME_K: 0.05,
                 job.OURS_SAME_K_NO_REPLICAS: 0.04}
    rows = []
    for repeat, base in ((0, 10.0), (1, 30.0)):
        rows.append({"kind": "variant", "variant": job.BASELINE, "repeat": repeat, "k": 10, "seconds": base,
                     "iterations": 10, "checkpoints": 0})
        for variant, overhead in overheads.items():
            row = {"kind": "variant", "variant": variant, "repeat": repeat, "k": 10, "seconds": 20.0 * (1 + overhead),
                   "iterations": 10, "checkpoints": 1}
            if variant == job.OURS_POLICY:  # its stretch spans two of its intervals: 50 iterations
                row.update(k_used=25, iterations=50, seconds=5 * row["seconds"])
            rows.append(row)
    rows.append({"kind": "variant", "variant": job.BASELINE, "repeat": 2, "k": 10, "seconds": 10.0,
                 "iterations": 10, "checkpoints": 0})
    rows.append({"kind": "recovery", "killed_at": 25, "k": 10, "restored_step": 20, "lost_iterations": 5,
                 "source": "slot", "kill_to_function_start_s": 9.0, "restore_s": 0.5,
                 "restart_to_first_step_s": 10.0})
    return rows


def test_overhead_is_against_the_baselines_around_each_round():
    figures = ray_bench.summarize(_results(), CONFIG)
    assert figures["overhead_report_sync"] == pytest.approx(0.5)
    assert figures["overhead_report_async"] == pytest.approx(0.1)
    assert figures["overhead_ours_policy"] == pytest.approx(0.03)
    assert figures["overhead_ours_same_k"] == pytest.approx(0.05)
    assert figures["overhead_ours_same_k_no_replicas"] == pytest.approx(0.04)
    assert figures["variants"][job.OURS_SAME_K]["overhead"]["max"] == pytest.approx(0.05)
    assert figures["variants"][job.BASELINE]["overhead"]["values"] == pytest.approx([-0.5, 0.5])  # the drift
    assert len(figures["variants"][job.BASELINE]["runs"]) == 2  # the closing baseline is a reference only
    assert figures["checkpoints_per_epoch"][job.OURS_POLICY] == pytest.approx(100 / 25)
    assert figures["checkpoints_per_epoch"][job.REPORT_SYNC] == pytest.approx(100 / 10)
    assert figures["recovery"]["lost_iterations"] == 5


def test_targets_say_met_and_not_met():
    figures = ray_bench.summarize(_results(), CONFIG)
    targets = figures["targets"]
    assert targets["ours_policy_within_p"]["met"] is True  # 3 % <= 3.5 %
    assert targets["ours_same_k_vs_sync"]["met"] is True  # 0.5 / 0.05 = 10x
    assert targets["ours_same_k_below_async"]["met"] is True
    figures["overhead_ours_same_k"] = 0.2
    figures["overhead_ours_policy"] = 0.04
    targets = ray_bench.targets(figures, 0.035)
    assert not any(target["met"] for target in targets.values())


def test_bad_settings_name_the_flag(tmp_path):
    parser = __import__("argparse").ArgumentParser()
    ray_bench.add_arguments(parser)
    with pytest.raises(ValueError, match="--repeats=0"):
        ray_bench.job_config(parser.parse_args(["--repeats", "0"]), str(tmp_path))
    with pytest.raises(ValueError, match="--worker-resource=gpu_box needs --address"):
        ray_bench.job_config(parser.parse_args(["--worker-resource", "gpu_box"]), str(tmp_path))
    with pytest.raises(ValueError, match="--overhead=1.5"):
        ray_bench.job_config(parser.parse_args(["--overhead", "1.5"]), str(tmp_path))


def test_spikes_count_the_seconds_above_the_runs_own_median_iteration():
    # nine iterations of 0.2 s and one of 1.2 s (a checkpoint's stall): 1 s above 10 x 0.2 s
    ends = [round(0.2 * i, 6) for i in range(1, 10)]
    ends.append(ends[-1] + 1.2)
    assert ray_bench.above_own_median(ends) == pytest.approx(0.5)
    # a run 10 % slower all through has no spikes: the drift between variants is not counted
    assert ray_bench.above_own_median([0.22 * i for i in range(1, 11)]) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="no timed iterations"):
        ray_bench.above_own_median([])
