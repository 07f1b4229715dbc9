"""The local spot cluster (``ray-checkfreq cluster up --local``): Ray's own autoscaler, a job
submitted with ``cluster/submit.sh``, S3 on moto, and ``down`` stopping exactly what ``up`` started.

The cluster is its own Ray (not the session's): a head with no resources for training, so
every Train worker needs a spot node that the autoscaler launches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ray_checkfreq.chaos.spot_cluster import (
    BUCKET,
    SpotClusterConfig,
    announce,
    down,
    kill_node,
    marked_pids,
    spot_nodes,
    up,
)

pytestmark = pytest.mark.chaos

SUBMIT = Path(__file__).resolve().parent.parent / "cluster" / "submit.sh"
# A small run of cluster/train_spot.py on 1 or 2 CPU workers: one epoch of 2000 iterations.
JOB_ARGS = ["--cpu", "--workers", "1-2", "--epochs", "1", "--samples", "192000", "--features", "16", "--width", "32",
            "--depth", "1", "--global-batch", "96", "--overhead", "0.035", "--resize-interval-s", "5"]
NOTICE_S = 8.0  # EC2 gives 120 s; here the job must still be training at the deadline


class NodeCounter(threading.Thread):
    """The most alive spot nodes seen, and when that many were first up."""

    def __init__(self, cluster) -> None:
        super().__init__(daemon=True)
        self.cluster, self.most, self.started, self.reached_s = cluster, 0, time.monotonic(), None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            count = len(spot_nodes(self.cluster))
            if count > self.most:
                self.most, self.reached_s = count, time.monotonic() - self.started


def wait_until(condition, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` held."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.5)
    return time.monotonic() - start


def committed_steps(cluster, run: str) -> list[int]:
    """The steps with a global manifest in the run's store on the cluster's S3."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=cluster.s3_endpoint, **_credentials())
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{run}/checkfreq/").get("Contents", [])]
    return sorted(int(key.split("/")[3].split("-")[1]) for key in keys if key.endswith("/manifest.json"))


def attempts(output: str) -> list[str]:
    """Rank 0's line at the start of each attempt (the job's log repeats lines: once each)."""
    return list(dict.fromkeys(line[line.index("attempt starts"):] for line in output.splitlines()
                              if "attempt starts at iteration" in line))


@pytest.mark.skipif(os.environ.get("RCF_SPOT_E2E") != "1",
                    reason="opt-in (RCF_SPOT_E2E=1): 100-170 s alone on 2 cores, and in one full suite run it did not "
                           "reach 2 nodes and a commit within 180 s; it joins the suite once bounded (issue 46)")
def test_a_submitted_job_survives_a_notice_and_its_node_lost_at_the_deadline(tmp_path):
    """The whole path of a spot preemption with a notice: the autoscaler launches 2 spot nodes
    for the job, EC2's notice (the metadata stand-in) reaches one node's watcher, which drains
    it; ray_checkfreq checkpoints before the deadline; at the deadline the node vanishes (every
    process SIGKILLed); the autoscaler replaces it and the job, resubmitted by nobody, ends
    SUCCEEDED having lost no iteration; then the idle nodes go and `down` leaves nothing."""
    directory = tmp_path / "spot"
    cluster = up(SpotClusterConfig(directory=str(directory), max_workers=2, idle_timeout_s=5.0))
    try:
        assert marked_pids(cluster.cluster_id), "up started no process with the cluster's marker"
        assert spot_nodes(cluster) == []  # min 0: nothing runs before a job asks
        run = f"spot-{uuid.uuid4().hex[:6]}"
        env = {**os.environ, **cluster.client_env(), "STORAGE_PATH": f"s3://{BUCKET}/runs", "RUN_NAME": run,
               "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}  # its `ray`
        counter = NodeCounter(cluster)
        counter.start()
        job = subprocess.Popen(["bash", str(SUBMIT), *JOB_ARGS], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        try:
            try:
                wait_until(lambda: counter.most == 2 and committed_steps(cluster, run), 180, "2 nodes and a commit")
            except AssertionError:
                job.kill()
                raise AssertionError(f"{counter.most} spot nodes, steps {committed_steps(cluster, run)}; the job "
                                     f"said:\n{job.communicate()[0][-6000:]}") from None
            victim = spot_nodes(cluster)[-1]
            deadline = announce(cluster, victim, notice_s=NOTICE_S)
            time.sleep(max(0.0, deadline - time.time()))
            killed = kill_node(cluster, victim)
            output, _ = job.communicate(timeout=300)
        finally:
            counter.done.set()
            if job.poll() is None:
                job.kill()
        assert killed, "the node had no process left to kill at its deadline"
        assert job.returncode == 0 and "succeeded" in output, output[-5000:]
        (directory / "job.out").write_text(output)
        started = attempts(output)
        assert len(started) == 2 and "iteration 0 on 2 workers" in started[0], started
        assert "'lost_after_notice': 0" in started[1], started  # the notice's checkpoint: nothing lost
        watcher_log = (directory / f"watcher-{victim[-5:]}.log").read_text()
        assert "draining node" in watcher_log, watcher_log
        print(f"2 spot nodes up {counter.reached_s:.1f} s after the submit; attempts: {started}")
        scaled_down_s = wait_until(lambda: spot_nodes(cluster) == [], 60, "the idle spot nodes removed")
        print(f"idle spot nodes removed {scaled_down_s:.1f} s after the job ended")
    finally:
        stopped = down(str(directory))
    assert stopped and marked_pids(cluster.cluster_id) == []
    assert not Path(cluster.temp_dir).exists()


def _credentials() -> dict:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def test_down_refuses_a_directory_without_a_cluster(tmp_path):
    with pytest.raises(FileNotFoundError, match="no local spot cluster was started with this directory"):
        down(str(tmp_path))


def test_the_config_refuses_bad_values(tmp_path):
    with pytest.raises(ValueError, match="max_workers=0"):
        SpotClusterConfig(directory=str(tmp_path), max_workers=0)
    with pytest.raises(ValueError, match="idle_timeout_s=0"):
        SpotClusterConfig(directory=str(tmp_path), idle_timeout_s=0)
