"""The local spot cluster (``ray-checkfreq cluster up --local``): Ray's own autoscaler, a job
submitted with ``cluster/submit.sh``, S3 on moto, and ``down`` stopping exactly what ``up`` started.

The cluster is its own Ray (not the session's): a head with no resources for training, so
every Train worker needs a spot node that the autoscaler launches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from ray_checkfreq.chaos.spot_cluster import BUCKET, WORKER_TYPE, SpotClusterConfig, down, marked_pids, up

pytestmark = pytest.mark.chaos

SUBMIT = Path(__file__).resolve().parent.parent / "cluster" / "submit.sh"
# A small run of cluster/train_spot.py: 2 epochs of 10 iterations on 1 or 2 CPU workers.
JOB_ARGS = ["--cpu", "--workers", "1-2", "--epochs", "2", "--samples", "960", "--features", "16", "--width", "32",
            "--depth", "1", "--global-batch", "96", "--overhead", "0.035"]


def alive_spot_nodes(cluster) -> list[str]:
    """The spot nodes Ray's state API lists as alive (through the dashboard, with the cluster's token)."""
    request = urllib.request.Request(f"{cluster.dashboard_url}/api/v0/nodes?limit=1000",
                                     headers={"Authorization": f"Bearer {Path(cluster.token_path).read_text()}"})
    nodes = json.loads(urllib.request.urlopen(request, timeout=10).read())["data"]["result"]["result"]
    return [n["node_id"] for n in nodes if n["state"] == "ALIVE" and WORKER_TYPE in n["resources_total"]]


class NodeCounter(threading.Thread):
    """The most alive spot nodes seen, and when that many were first up."""

    def __init__(self, cluster) -> None:
        super().__init__(daemon=True)
        self.cluster, self.most, self.started, self.reached_s = cluster, 0, time.monotonic(), None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            count = len(alive_spot_nodes(self.cluster))
            if count > self.most:
                self.most, self.reached_s = count, time.monotonic() - self.started


def wait_until(condition, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` held."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.5)
    return time.monotonic() - start


def test_a_submitted_job_scales_up_succeeds_on_s3_and_the_cluster_scales_down(tmp_path):
    directory = tmp_path / "spot"
    cluster = up(SpotClusterConfig(directory=str(directory), max_workers=2, idle_timeout_s=5.0))
    try:
        assert marked_pids(cluster.cluster_id), "up started no process with the cluster's marker"
        assert alive_spot_nodes(cluster) == []  # min 0: nothing runs before a job asks
        run = f"spot-{uuid.uuid4().hex[:6]}"
        env = {**os.environ, **cluster.client_env(), "STORAGE_PATH": f"s3://{BUCKET}/runs", "RUN_NAME": run,
               "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}  # its `ray`
        counter = NodeCounter(cluster)
        counter.start()
        try:
            done = subprocess.run(["bash", str(SUBMIT), *JOB_ARGS], env=env, capture_output=True, text=True,
                                  timeout=300)
        finally:
            counter.done.set()
        assert counter.most == 2, counter.most  # the autoscaler launched up to max_workers for the job
        print(f"2 spot nodes up {counter.reached_s:.1f} s after the submit")
        assert done.returncode == 0 and "succeeded" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
        assert "attempt starts at iteration 0 on 2 workers" in done.stdout, done.stdout[-4000:]
        import boto3

        keys = [o["Key"] for o in boto3.client("s3", endpoint_url=cluster.s3_endpoint, **_credentials())
                .list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{run}/checkfreq/").get("Contents", [])]
        assert any(key.endswith("manifest.json") for key in keys), keys[:20]
        scaled_down_s = wait_until(lambda: alive_spot_nodes(cluster) == [], 60, "the idle spot nodes removed")
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
