"""The local spot cluster (``ray-checkfreq cluster up --local``): Ray's own autoscaler, jobs
submitted with ``cluster/submit.sh``, S3 on moto, and ``down`` stopping exactly what ``up`` started.

The cluster is its own Ray (not the session's): a head with no resources for training, so
every Train worker needs a spot node that the autoscaler launches. Its processes start
without the suite's own Ray settings (conftest's TRAIN_ENV): Ray's defaults, as a user's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import early_children
import pytest
from conftest import TRAIN_ENV
from state_strategies import assert_same_state

from ray_checkfreq.chaos.spot_cluster import (
    BUCKET,
    SpotCluster,
    SpotClusterConfig,
    announce,
    down,
    kill_node,
    marked_pids,
    spot_nodes,
    up,
)
from ray_checkfreq.chaos.spot_timeline import Timeline
from ray_checkfreq.cli import main

pytestmark = pytest.mark.chaos

SUBMIT = Path(__file__).resolve().parent.parent / "cluster" / "submit.sh"
WORKERS = 2
# cluster/train_spot.py on 1 or 2 one-CPU workers: one epoch of 7500 iterations (about 38 s of
# training on 2 idle cores: both losses fall inside it, the notice's deadline included).
JOB_ARGS = ["--cpu", "--workers", f"1-{WORKERS}", "--epochs", "1", "--samples", "720000", "--features", "16",
            "--width", "32", "--depth", "1", "--global-batch", "96", "--overhead", "0.035", "--resize-interval-s", "5"]
# EC2 gives 120 s; here the job must still be training at the deadline. The notice includes the
# node watcher's own latency: its `ray drain-node` took 7 s at a load average of 30 (a 5 s
# notice then reached Ray after the node was gone), and at a load of 33 a 10 s notice never
# reached rank 0 (the job printed no "preemption notice" line) while the watcher still ran.
NOTICE_S = 20.0
# Under a loaded suite the autoscaler's first two nodes took over 150 s to train (load 23).
FIRST_NODES_S = 300


def wait_until(condition, timeout_s: float, what: str, job: subprocess.Popen | None = None,
               timeline: Timeline | None = None) -> float:
    """Seconds until ``condition()`` held; a timeout says what the job printed."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s or (job is not None and job.poll() is not None):
            said = "".join(timeline.output[-60:]) if timeline else ""
            raise AssertionError(f"{what}: not within {timeout_s} s (job exit {job and job.poll()}); "
                                 f"events {timeline and timeline.events}; the job said:\n{said[-6000:]}")
        time.sleep(0.25)
    return time.monotonic() - start


def submit(cluster: SpotCluster, run: str, *extra: str) -> subprocess.Popen:
    """``cluster/submit.sh`` as a user runs it, against the local dashboard and S3."""
    env = {**os.environ, **cluster.client_env(), "STORAGE_PATH": f"s3://{BUCKET}/runs", "RUN_NAME": run,
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}  # its `ray`
    return subprocess.Popen(["bash", str(SUBMIT), *JOB_ARGS, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def final_state(cluster: SpotCluster, run: str) -> dict:
    """The run's newest checkpoint (its last iteration's), read from the cluster's S3."""
    from ray_checkfreq import CheckpointStore
    from ray_checkfreq.storage.backends.s3 import S3Options

    store = CheckpointStore(f"s3://{BUCKET}/runs/{run}/checkfreq", s3=S3Options(endpoint_url=cluster.s3_endpoint))
    return store.load()


E2E_TEST = "tests/test_spot_cluster.py::test_a_submitted_job_survives_a_notice_and_a_loss_without_one_bit_identical"


def _start_e2e(directory: Path, env: dict) -> subprocess.Popen:
    """This module's end-to-end test, run by a pytest child (it starts a Ray of its own)."""
    return early_children.start_logged(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--basetemp", str(directory / "base"),
         E2E_TEST], directory, env, cwd=Path(__file__).resolve().parent.parent)


early_children.register(E2E_TEST, _start_e2e)


@pytest.mark.timeout(960)  # above the wait's own 900 s, which names what the child said
def test_a_submitted_job_survives_a_notice_and_a_loss_without_one_bit_identical(tmp_path, monkeypatch):
    """Runs in a child started with the session (tests/early_children.py); see ``spot_e2e``."""
    if early_children.IN_CHILD:
        spot_e2e(tmp_path, monkeypatch)
        return
    done = early_children.wait(E2E_TEST, timeout_s=900)
    assert done.returncode == 0 and "1 passed" in done.output, done.output[-12000:]
    print(next((line for line in done.output.splitlines() if line.startswith("timeline: ")), "no timeline"))


def spot_e2e(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path of spot preemptions: the autoscaler launches 2 spot nodes for the job;
    EC2's notice (the metadata stand-in) reaches the watcher of the node without rank 0,
    which drains it;
    ray_checkfreq checkpoints before the deadline; at the deadline the node vanishes (every
    process SIGKILLed) and the autoscaler replaces it. Then rank 0's node vanishes without notice.
    The job, resubmitted by nobody, ends SUCCEEDED with the weights of an uninterrupted run
    of the same job, bit for bit; the idle nodes go and `down` leaves nothing."""
    for key in TRAIN_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    directory = tmp_path / "spot"
    cluster = up(SpotClusterConfig(directory=str(directory), max_workers=WORKERS, idle_timeout_s=10.0))
    timeline: Timeline | None = None
    try:
        assert marked_pids(cluster.cluster_id), "up started no process with the cluster's marker"
        assert spot_nodes(cluster) == []  # min 0: nothing runs before a job asks
        run = f"spot-{uuid.uuid4().hex[:6]}"
        timeline = Timeline(cluster, run)
        timeline.start()
        timeline.mark("submit")
        job = submit(cluster, run)
        assert job.stdout is not None
        threading.Thread(target=timeline.follow, args=(job.stdout,), daemon=True).start()
        reference = None
        try:
            try:
                trained_from = preempt_twice(cluster, timeline, job)
            except AssertionError as failed:
                raise AssertionError(f"{failed}\n{notice_report(directory)}") from None
            wait_until(lambda: timeline.of("done"), 300, "the job's last iteration", job, timeline)
            # The reference: an uninterrupted run of the same job on 2 workers throughout (fixed:
            # it must not start on the first node freed), submitted now so that it takes the
            # two nodes over as this job ends (before their idle timeout).
            reference = submit(cluster, f"{run}-reference", "--workers", str(WORKERS))
            job.wait(timeout=120)
            timeline.mark("job_end", job=run, returncode=job.returncode)
            # Its whole job on 2 workers: over 240 s beside a loaded suite (load 20-45).
            reference_output, _ = reference.communicate(timeout=480)
        finally:
            for child in (job, reference):
                if child is not None and child.poll() is None:
                    child.kill()
        output = "".join(timeline.output)
        (directory / "job.out").write_text(output)
        assert job.returncode == 0 and "succeeded" in output, output[-5000:]
        assert reference.returncode == 0, reference_output[-5000:]
        timeline.mark("job_end", job="reference", returncode=reference.returncode)
        reference_state, final = final_state(cluster, f"{run}-reference"), final_state(cluster, run)
        # No RAM slot of either job is left, not even the lost nodes' (a VM's /dev/shm goes with it;
        # here every node shares this machine's).
        assert not [p.name for p in Path("/dev/shm").glob(f"rcf-{run}*")]
        scaled_down_s = wait_until(lambda: spot_nodes(cluster) == [] and timeline.alive_now() == 0, 90,
                                   "the idle spot nodes removed")
        figures = timeline.write(directory / "timeline.json", full_world=WORKERS)
        print(f"timeline: {figures}\nidle spot nodes removed {scaled_down_s:.1f} s after the reference job")
    finally:
        if timeline is not None:
            timeline.stop()
        running = cluster_processes(cluster)
        stopped = down(str(directory))
    # Every process of every node, the unmarked ones too (Ray's agents hide the marker).
    assert running and stopped
    assert not [pid for pid in running if _running(pid)], [_command(pid) for pid in running if _running(pid)]
    assert cluster_processes(cluster) == [] and marked_pids(cluster.cluster_id) == []
    assert not Path(cluster.temp_dir).exists()
    first, after_notice, after_loss = trained_from
    assert first.detail["iteration"] == 0, timeline.events
    # Every attempt on 2 workers (else the float sums of the last step differ from the reference's)
    assert all(a.detail["world"] == WORKERS for a in timeline.of("attempt")), timeline.events
    # The notice's checkpoint: nothing lost, and the next attempt began at it.
    assert after_notice.detail["restore"]["lost_after_notice"] == 0, after_notice
    assert after_notice.detail["iteration"] == after_notice.detail["restore"]["step"] > 0, after_notice
    watcher_log = next(directory.glob("watcher-*.log"), None)
    assert any("draining node" in p.read_text() for p in directory.glob("watcher-*.log")), watcher_log
    # Without a notice: resumed at the newest step the store or a RAM copy held, no earlier.
    assert after_loss.detail["iteration"] >= max(e.detail["step"] for e in timeline.of("commit")
                                                 if e.t_s < timeline.of("kill")[1].t_s), timeline.events
    assert_same_state(reference_state["model"], final["model"])
    assert_same_state(reference_state["optimizer"], final["optimizer"])
    (loss_with_notice, loss_without) = figures["losses"]
    assert loss_with_notice["with_notice"] and not loss_without["with_notice"], figures


def preempt_twice(cluster: SpotCluster, timeline: Timeline, job: subprocess.Popen) -> tuple:
    """Once both nodes train and a step is committed: a notice, then the node killed at its
    deadline; once the job trains on both nodes again: a node killed without notice. Returns
    the attempts: the first, the one after the notice, the one after the loss without."""
    wait_until(lambda: timeline.alive_now() == WORKERS and timeline.of("commit") and timeline.of("attempt"),
               FIRST_NODES_S,
               "both nodes up and a step committed", job, timeline)
    first = timeline.of("attempt")[0]
    # The notice reaches the node without rank 0: the stop is decided on rank 0's and agreed by all.
    victim = next(node for node in spot_nodes(cluster) if node != first.detail["rank0_node"])
    deadline = announce(cluster, victim, notice_s=NOTICE_S)
    timeline.mark("notice", node=victim, deadline_in_s=NOTICE_S)
    time.sleep(max(0.0, deadline - time.time()))
    assert kill_node(cluster, victim), "the node had no process left to kill at its deadline"
    noticed = timeline.now()
    timeline.mark("kill", node=victim, notice=True)
    full_again = lambda: [a for a in timeline.of("attempt", noticed) if a.detail["world"] == WORKERS]  # noqa: E731
    wait_until(full_again, 150, "training on both nodes again after the notice", job, timeline)
    time.sleep(1.0)  # trains a little on the new node
    victim = full_again()[0].detail["rank0_node"]  # rank 0's node, lost without notice
    assert main(["cluster", "preempt", "--dir", cluster.directory, "--node", victim]) == 0  # as a user would
    lost = timeline.now()
    timeline.mark("kill", node=victim, notice=False)
    wait_until(lambda: timeline.of("attempt", lost), 150, "an attempt after the loss without notice", job, timeline)
    return first, timeline.of("attempt", noticed)[0], timeline.of("attempt", lost)[0]


def notice_report(directory: Path) -> str:
    """What each node's watcher logged: whether the notice was seen and the node drained, and when."""
    logs = sorted(directory.glob("watcher-*.log"))
    if not logs:
        return "no watcher log in the cluster's directory"
    return "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-1500:]}" for log in logs)


def cluster_processes(cluster: SpotCluster) -> list[int]:
    """Every process of the cluster as this test finds them (not ``down``'s own search): its
    marker in the environment, or its working directory or a file in the cluster's temp
    directory, where every node keeps its logs."""
    return sorted(set(marked_pids(cluster.cluster_id)) | {
        int(pid) for pid in os.listdir("/proc")
        if pid.isdigit() and int(pid) != os.getpid() and _open_in(int(pid), Path(cluster.temp_dir))})


def _running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return f"{pid}: gone"


def test_down_refuses_a_directory_without_a_cluster(tmp_path):
    with pytest.raises(FileNotFoundError, match="no local spot cluster was started with this directory"):
        down(str(tmp_path))


def test_the_config_refuses_bad_values(tmp_path):
    with pytest.raises(ValueError, match="max_workers=0"):
        SpotClusterConfig(directory=str(tmp_path), max_workers=0)
    with pytest.raises(ValueError, match="idle_timeout_s=0"):
        SpotClusterConfig(directory=str(tmp_path), idle_timeout_s=0)


def test_preempt_refuses_a_node_that_is_not_an_alive_spot_node(tmp_path, monkeypatch):
    from ray_checkfreq.chaos import cluster_cli

    cluster = SpotCluster(directory=str(tmp_path), cluster_id="c0ffee00", gcs_address="127.0.0.1:1",
                          dashboard_url="http://127.0.0.1:1", s3_endpoint="http://127.0.0.1:2",
                          imds_url="http://127.0.0.1:3", token_path=str(tmp_path / "token"), temp_dir=str(tmp_path))
    cluster.save()
    monkeypatch.setattr(cluster_cli, "spot_nodes", lambda _: ["ff01"])
    with pytest.raises(SystemExit, match="--node ff02: not an alive spot node of this cluster"):
        main(["cluster", "preempt", "--dir", str(tmp_path), "--node", "ff02"])
    with pytest.raises(SystemExit, match="--notice-s -1.0: must be >= 0 seconds"):
        main(["cluster", "preempt", "--dir", str(tmp_path), "--notice-s", "-1"])
    monkeypatch.setattr(cluster_cli, "spot_nodes", lambda _: [])
    with pytest.raises(SystemExit, match="no spot node is alive"):
        main(["cluster", "preempt", "--dir", str(tmp_path)])


def _sleeper(*, env: dict, cwd: str | Path | None = None, open_file: str | Path | None = None) -> subprocess.Popen:
    """A process that sleeps, with ``env`` as its whole environment, optionally holding ``open_file``."""
    code = (f"f = open({str(open_file)!r}, 'a')\n" if open_file else "") + "import time; time.sleep(120)"
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=cwd)


def test_down_stops_the_cluster_processes_that_carry_no_marker_and_nothing_else(tmp_path):
    """Ray's agents rename themselves, which hides the marker in their environment: ``down``
    also stops every process with a file or its working directory in the cluster's temp
    directory, and their children, but neither a bystander nor its caller."""
    temp = tmp_path / "rcf-spot-c0ffee01"
    (temp / "node-00001" / "logs").mkdir(parents=True)
    cluster = SpotCluster(directory=str(tmp_path), cluster_id="c0ffee01", gcs_address="127.0.0.1:1",
                          dashboard_url="http://127.0.0.1:1", s3_endpoint="http://127.0.0.1:2",
                          imds_url="http://127.0.0.1:3", token_path=str(tmp_path / "token"), temp_dir=str(temp))
    cluster.save()
    bare = {"PATH": os.environ["PATH"]}  # no marker
    marked = _sleeper(env={**bare, "RCF_SPOT_CLUSTER": "c0ffee01"})
    child_of_marked = subprocess.Popen(["bash", "-c", f"env -i {sys.executable} -c 'import time; time.sleep(120)' & "
                                        "wait"], env={**bare, "RCF_SPOT_CLUSTER": "c0ffee01"})
    agent = _sleeper(env=bare, open_file=temp / "node-00001" / "logs" / "dashboard_agent.log")
    worker = _sleeper(env=bare, cwd=temp / "node-00001")
    bystander = _sleeper(env={**bare, "RCF_SPOT_CLUSTER": "another"}, cwd=tmp_path)
    ours = open(temp / "node-00001" / "logs" / "tail.log", "a")  # the caller: never stopped
    try:
        children = Path(f"/proc/{child_of_marked.pid}/task/{child_of_marked.pid}/children")
        wait_until(lambda: _open_in(agent.pid, temp) and _open_in(worker.pid, temp) and children.read_text().split(),
                   30, "the sleepers started")
        grandchild = [int(pid) for pid in children.read_text().split()]
        stopped = down(str(tmp_path), grace_s=2.0)
        for process in (marked, child_of_marked, agent, worker):
            assert process.wait(timeout=10) is not None
        assert {marked.pid, child_of_marked.pid, agent.pid, worker.pid, *grandchild} <= set(stopped)
        assert not Path(f"/proc/{grandchild[0]}").exists() or "zombie" in Path(f"/proc/{grandchild[0]}/status") \
            .read_text()
        assert bystander.poll() is None and bystander.pid not in stopped
        assert not temp.exists() and not (tmp_path / "cluster.json").exists()
    finally:
        ours.close()
        for process in (marked, child_of_marked, agent, worker, bystander):
            if process.poll() is None:
                process.kill()
                process.wait()


def _open_in(pid: int, directory: Path) -> bool:
    """``pid`` has its working directory or a file in ``directory``."""
    try:
        links = [os.readlink(f"/proc/{pid}/cwd")] + [os.readlink(f"/proc/{pid}/fd/{fd}")
                                                      for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any(link.startswith(str(directory)) for link in links)


LEASE_S = 2.5


def test_a_stopped_jobs_node_agent_serves_a_resubmit_within_its_lease_then_ends_with_its_slots(ray_session):
    """After ``ray job stop`` (no controller hook runs) the run's node agent keeps its RAM
    slots for a resubmit under the same name, whose ranks renew the lease; once nobody renews
    it for ``agent_lease_s`` the agent removes its slot files and exits."""
    from ray_checkfreq.ray.agent import get_or_create_agent, live_agents

    ray = ray_session
    run, node = f"ttl-{uuid.uuid4().hex[:6]}", ray.get_runtime_context().get_node_id()
    agent = get_or_create_agent(run, node, lease_s=LEASE_S)
    paths = ray.get(agent.allocate.remote(4096, 4096))
    incarnation = ray.get(agent.info.remote())["incarnation"]
    assert all(os.path.exists(path) for path in paths)
    time.sleep(LEASE_S / 2)  # the job was stopped: no rank renews
    again = get_or_create_agent(run, node, lease_s=LEASE_S)  # the resubmit, as its rank sets up
    assert ray.get(again.info.remote())["incarnation"] == incarnation  # the same agent, with its slots
    assert [header["path"] for header in ray.get(again.slot_headers.remote())] == paths
    renewing_until = time.monotonic() + 2 * LEASE_S  # its ranks renew, past the first lease
    while time.monotonic() < renewing_until:
        ray.get(again.renew.remote())
        time.sleep(LEASE_S / 8)
    assert ray.get(again.info.remote())["incarnation"] == incarnation
    ended_s = wait_until(lambda: not live_agents(run), LEASE_S * 3, "the agent ended after its lease")
    assert not [path for path in paths if os.path.exists(path)]
    print(f"agent ended {ended_s:.1f} s after the last renewal (lease {LEASE_S} s)")
