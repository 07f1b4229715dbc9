"""The Ray Train layer on a real multi-node local cluster: restarts, slots, node loss.

Every test runs ``TorchTrainer`` (gloo, 2 workers on 2 one-CPU nodes) with the training
function of ``ray_train_jobs.py``, injects one fault, and checks where the restarted run
began (not only that it ended with the right weights: a run retrained from scratch ends
with them too) and that nothing is left behind (no agent, no slot file).
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
import uuid

import pytest
import torch
from conftest import RUN_TIMEOUT_S

pytestmark = pytest.mark.chaos

TRAIN_RESOURCE = "rcf_train"
ITERATIONS = 40


TRAIN_NODES = 5


@pytest.fixture(scope="module")
def train_nodes():
    """This module's own cluster: its one-CPU nodes for Train workers, all added at start."""
    from conftest import own_cluster

    with own_cluster(TRAIN_NODES) as cluster:
        yield cluster


def require_train_nodes(cluster, count: int) -> None:
    """Tests only remove nodes (adding one late in a run failed): the order of the tests
    below spends the module's 5 nodes, the drain and node-loss tests one each."""
    have = len(cluster.worker_nodes)
    assert have >= count, f"{have} Train nodes, this test needs {count}"


def fit(tmp_path, name: str, *, workers: int | tuple[int, int] = 2, max_failures: int = 2,
        run_name: str | None = None,
        **config) -> tuple[object, str]:
    """Run the job; afterwards nothing of the run may be left (checked here, for every run)."""
    import ray_train_jobs

    from ray_checkfreq.chaos.harness import TrainJob, fit_job

    work_dir = str(tmp_path / name)
    os.makedirs(work_dir, exist_ok=True)
    run_name = run_name or f"{name}-{uuid.uuid4().hex[:6]}"
    job = TrainJob(train=ray_train_jobs.train, config={"work_dir": work_dir, "iterations": ITERATIONS, **config},
                   name=run_name, storage_path=str(tmp_path / "results"), workers=workers,
                   resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1}, max_failures=max_failures,
                   timeout_s=RUN_TIMEOUT_S)
    outcome = fit_job(job, raise_errors=False)  # the run's error: the caller asserts on it
    assert_nothing_left(run_name)
    return outcome, work_dir


def events(work_dir: str, rank: int, kind: str) -> list[dict]:
    path = os.path.join(work_dir, f"log-{rank}.jsonl")
    with open(path) as lines:
        return [e for e in map(json.loads, lines) if e["event"] == kind]


def attempt_batches(work_dir: str, rank: int, attempt: int) -> list[dict]:
    """The batches ``rank`` logged in its ``attempt``-th start (0 = the first)."""
    started, found = -1, []
    with open(os.path.join(work_dir, f"log-{rank}.jsonl")) as lines:
        for entry in map(json.loads, lines):
            started += entry["event"] == "start"
            if entry["event"] == "batch" and started == attempt:
                found.append(entry)
    return found


def final_weights(work_dir: str) -> dict:
    saved = torch.load(os.path.join(work_dir, "final.pt"), weights_only=True)
    assert saved["iteration"] == ITERATIONS
    return saved["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def assert_nothing_left(run_name: str) -> None:
    """No agent of the run, no slot file of the run (other runs may share /dev/shm)."""
    import ray

    from ray_checkfreq.ray.names import NAMESPACE, agent_prefix, policy_name, run_key

    run = run_key(run_name)
    deadline = time.monotonic() + 20
    while True:
        agents = [a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and (a["name"].startswith(agent_prefix(run))
                                                      or a["name"] == policy_name(run))]
        files = glob.glob(f"/dev/shm/rcf-{run}-*")
        if not agents and not files:
            return
        assert time.monotonic() < deadline, f"left behind: agents {agents}, slot files {files}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def reference(train_nodes, tmp_path_factory):
    """Final weights of the same job without faults (computed once)."""
    result, work_dir = fit(tmp_path_factory.mktemp("ref"), "reference")
    assert not isinstance(result, Exception), result
    assert [e["iteration"] for e in events(work_dir, 0, "start")] == [0]
    return final_weights(work_dir)


def test_worker_killed_while_its_agent_persists_resumes_from_the_slot(reference, train_nodes, tmp_path):
    require_train_nodes(train_nodes, 2)
    # Rank 0's agent holds the persist of step 20; rank 1 dies at 22: the newest commit is 16,
    # the newest complete snapshot (20) lives only in the agent's slot. Step 16's slot is
    # sealed late, so its persist reaches the agent after the hold was set (as on a slow
    # machine): the hold must still fall on step 20.
    result, work_dir = fit(tmp_path, "kill-mid-persist", hold_persist={"iteration": 19, "step": 20, "seconds": 240},
                           kill={"rank": 1, "iteration": 22}, slow_seal={"step": 16, "seconds": 1.0})
    assert not isinstance(result, Exception), result
    starts = events(work_dir, 0, "start")
    assert [s["iteration"] for s in starts] == [0, 20]
    restored = starts[1]["restore"]
    assert restored["kind"] == "slot" and restored["committed_step"] == 16
    assert_same_weights(final_weights(work_dir), reference)


def test_kill_during_the_copy_into_a_slot_never_restores_that_slot(reference, train_nodes, tmp_path):
    require_train_nodes(train_nodes, 2)
    # Rank 0's agent is killed at 6: rank 0 replaces it without a restart. The slot of step
    # 24 is still WRITING when rank 0 dies at 25: the restart takes step 20. Rank 1's replica
    # of 24 is sealed late too, later than Ray Train's teardown kills rank 1 even on a slow
    # machine (the sleeping thread dies with its process: the test does not wait for it).
    result, work_dir = fit(tmp_path, "kill-mid-copy", slow_seal={"step": 24, "seconds": 60},
                           kill={"rank": 0, "iteration": 25}, kill_agent={"iteration": 6})
    assert not isinstance(result, Exception), result
    starts = events(work_dir, 0, "start")
    assert [s["iteration"] for s in starts] == [0, 20]
    assert starts[1]["restore"]["kind"] == "slot"  # the complete slot of 20, not a fallback from 24's
    assert_same_weights(final_weights(work_dir), reference)


def when_rank_reaches(work: str, rank: int, iteration: int, act) -> threading.Thread:
    """A thread that calls ``act(node id of that rank)`` once ``rank`` logged ``iteration``."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                batches = events(work, rank, "batch")
            except FileNotFoundError:
                batches = []
            if batches and batches[-1]["iteration"] >= iteration:
                act(events(work, rank, "start")[0]["node"])
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def remove_node_of(cluster, node_id: str) -> None:
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node, allow_graceful=False)


def remover(cluster, removed: dict):
    """``act`` for ``when_rank_reaches``: remove that node, and note which in ``removed``."""

    def remove(node_id: str) -> None:
        remove_node_of(cluster, node_id)
        removed["node"] = node_id

    return remove


def drain(cluster, node_id: str, deadline_s: float) -> None:
    """A preemption notice as the autoscaler sends it (the node keeps running)."""
    import ray._raylet
    from ray.core.generated import autoscaler_pb2

    accepted, why = ray._raylet.GcsClient(address=cluster.address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "test notice",
        int(deadline_s * 1000))
    assert accepted, why


def test_rank0s_node_gone_right_after_the_notice_snapshot_still_commits_it(reference, train_nodes, tmp_path):
    """Rank 0's node is drained (3 s deadline). Once rank 0 has planned the notice's
    checkpoints, the other node's agent holds the persist of the first (the notice
    checkpoint) for 2 s; rank 0's node is removed while it is in flight, before the deadline.
    The other agent still commits that step under the first attempt's writer generation, and
    the restart begins there."""
    from ray_checkfreq import CheckpointStore
    from ray_checkfreq.ray.agent import live_agents
    from ray_checkfreq.ray.names import run_key

    require_train_nodes(train_nodes, 3)
    work = tmp_path / "notice-gone"
    os.makedirs(work)
    name = f"notice-gone-{uuid.uuid4().hex[:6]}"
    seen: dict = {}

    def drain_and_remove_mid_persist(node_id: str) -> None:
        import ray

        drain(train_nodes, node_id, time.time() + 3.0)
        deadline = time.monotonic() + 60
        while not (planned := events(str(work), 0, "stop-planned")):
            assert time.monotonic() < deadline, "rank 0 never planned the stop"
            time.sleep(0.02)
        seen["stop"] = planned[0]["stop"]
        holders = [handle for node, handle in live_agents(run_key(name)).items() if node in planned[0]["held"]]
        while not any((ray.get(h.in_flight.remote()) or -1) >= seen["stop"] for h in holders):
            assert time.monotonic() < deadline, "no other node's agent started the stop persist"
            time.sleep(0.02)
        seen["removed_ns"] = time.time_ns()
        remove_node_of(train_nodes, node_id)
        store = CheckpointStore(str(tmp_path / "results" / name / "checkfreq"))
        # Every commit of the stop step, of any writer: the restart may commit the same step
        # again under its own generation, and a slow node removal can make the first look
        # find both.
        commits = seen.setdefault("commits", {})
        while time.monotonic() < deadline and not any(ref.writer_generation == 1 for ref in commits.values()):
            for ref in store.list():  # polled, before retention may drop it
                if ref.step == seen["stop"]:
                    commits[ref.uri] = ref
            time.sleep(0.05)

    preempter = when_rank_reaches(str(work), 0, 10, drain_and_remove_mid_persist)
    result, work_dir = fit(tmp_path, "notice-gone", run_name=name, sleep_s=0.2, max_failures=1,
                           hold_stop_persist={"seconds": 2.0})  # shorter than the job's restart_wait_s
    preempter.join(timeout=30)
    assert not isinstance(result, Exception), result
    assert "removed_ns" in seen, f"the node was never removed: {seen}"
    stop = seen["stop"]
    # Committed by the first attempt's persist (not only by the restart), after rank 0's node was gone.
    first = [ref for ref in seen["commits"].values() if ref.writer_generation == 1]
    assert first, f"the stop iteration {stop} was never committed by the first attempt: {seen['commits']}"
    assert first[0].created_unix_ns > seen["removed_ns"]
    starts = events(work_dir, 0, "start")
    assert len(starts) == 2
    # The restart began at the notice's first checkpoint or later (the stop's snapshot, when the
    # other node's replica of it was complete); no rank trained past the planned stop.
    trained = max(e["iteration"] for r in (0, 1) for e in attempt_batches(work_dir, r, 0))
    resumed = starts[1]["iteration"]
    assert stop <= resumed <= trained + 1
    # Rank 0 never confirmed the stop (its node was gone first): the notice was recorded when
    # planned, and the restart counts at most what was trained after where it resumed.
    lost = starts[1]["restore"]["lost_after_notice"]
    assert lost is not None and lost >= trained + 1 - resumed
    assert_same_weights(final_weights(work_dir), reference)


def test_losing_rank0s_node_resumes_from_the_other_nodes_slot(reference, train_nodes, tmp_path):
    work = tmp_path / "node-loss"
    os.makedirs(work)
    removed: dict = {}
    remove = remover(train_nodes, removed)
    require_train_nodes(train_nodes, 3)  # a spare for the restart
    killer = when_rank_reaches(str(work), 0, 22, remove)
    result, work_dir = fit(tmp_path, "node-loss", hold_persist={"iteration": 19, "step": 20, "seconds": 240},
                           sleep_s=0.3)
    killer.join(timeout=5)
    assert not isinstance(result, Exception), result
    assert removed, "the node was never removed"
    first, second = events(work_dir, 0, "start")[:2]
    other_node = events(work_dir, 1, "start")[0]["node"]
    assert second["restore"]["kind"] == "slot"
    assert second["restore"]["node_id"] == other_node != removed["node"]
    # Rank 1 may finish the step rank 0 was in when its node went away: its replica is then newer.
    reached = max(e["iteration"] for rank in (0, 1) for e in attempt_batches(work_dir, rank, 0))
    assert 20 <= second["iteration"] <= reached and second["restore"]["committed_step"] < second["iteration"]
    assert_same_weights(final_weights(work_dir), reference)

