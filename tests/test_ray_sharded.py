"""FSDP2 on Ray Train (CPU gloo, 2 workers on three one-CPU nodes): the same
``ray_checkfreq.ray.CheckFreq`` line as for DDP, every rank writing its own shards, one
global commit per step, and restarts that read each rank's copy of the newest step from RAM
(its own slot, or a peer's copy where its node was lost). Resharding onto another world size
in a Ray Train run: tests/test_ray_train.py (an elastic FSDP2 run losing a node).

Each test checks where the restarted run began (a run retrained from scratch ends with the
same weights) and compares the final state with training that never stopped (spawned gloo
ranks, no checkpoints).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import numpy as np
import pytest
from conftest import RUN_TIMEOUT_S

pytestmark = pytest.mark.chaos

TRAIN_RESOURCE = "rcf_train"


@pytest.fixture(scope="module")
def train_nodes():
    """A cluster of this module's own: a Train run started right after another module's runs
    on the session cluster once waited for its workers indefinitely (its controller never
    placed them, with the resources free)."""
    from conftest import own_cluster

    with own_cluster(3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The whole state after ``ITERATIONS`` uninterrupted steps at world size 2."""
    import ray_sharded_jobs
    import sharded_state_jobs

    root = tmp_path_factory.mktemp("reference")
    sharded_state_jobs.spawn(ray_sharded_jobs.reference, 2, str(root))
    return sharded_state_jobs.load_arrays(root / "reference.npz")


def fit(tmp_path, name: str, storage: str, *, workers: int, max_failures: int, **config) -> tuple[object, str]:
    import ray_sharded_jobs

    from ray_checkfreq.chaos.harness import TrainJob, fit_job

    work_dir = str(tmp_path / name)
    os.makedirs(work_dir, exist_ok=True)
    job = TrainJob(train=ray_sharded_jobs.train,
                   config={"work_dir": work_dir, "storage": storage, "iterations": ray_sharded_jobs.ITERATIONS,
                           **config},
                   name=f"{name}-{uuid.uuid4().hex[:6]}", storage_path=str(tmp_path / "results"), workers=workers,
                   resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1}, max_failures=max_failures,
                   timeout_s=RUN_TIMEOUT_S)
    return fit_job(job, raise_errors=False), work_dir


def events(work_dir: str, rank: int, kind: str) -> list[dict]:
    with open(os.path.join(work_dir, f"log-{rank}.jsonl")) as lines:
        return [e for e in map(json.loads, lines) if e["event"] == kind]


def starts(work_dir: str, rank: int) -> list[dict]:
    return events(work_dir, rank, "start")


def committed_steps(storage: str) -> list[int]:
    from ray_checkfreq.storage.sharded_store import ShardedStore

    return [ref.step for ref in ShardedStore(storage).list()]


def assert_equal_state(final: dict, reference: dict, *, atol: float = 0.0) -> None:
    assert sorted(final) == sorted(reference)
    for name, value in reference.items():
        if atol == 0.0:
            assert np.array_equal(final[name], value), name
        else:
            np.testing.assert_allclose(final[name], value, rtol=0, atol=atol, err_msg=name)


def remove_node_when(cluster, work_dir: str, *, attempt: int, iteration: int, removed: dict) -> threading.Thread:
    """Remove rank 1's node (SIGKILL of its raylet and processes) once rank 1 of the given
    attempt (0-based) logged ``iteration`` and a peer copy of its that arrived."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                begun = starts(work_dir, 1)
                reached = [e["iteration"] for e in events(work_dir, 1, "batch")
                           if e["t"] > begun[attempt]["t"] and e["peer_copies"]["sent"] > 0] \
                    if len(begun) > attempt else []
            except (FileNotFoundError, IndexError):
                reached = []
            if reached and max(reached) >= iteration:
                node = begun[attempt]["node"]
                cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node), allow_graceful=False)
                removed["node"] = node
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def ram_source(node: str, *, own: str, ring: list[str]) -> str:
    """What a rank that restarted on ``node`` reads: its slot (on ``own``, its node before)
    in place or through that node's agent, except where its node holds its peer copy (the
    other node of the previous attempt's ring of two)."""
    peer = ring[1 - ring.index(own)]
    return "peer" if node == peer else "slot"


def test_a_killed_rank_and_then_a_lost_node_resume_every_rank_from_ram(train_nodes, tmp_path, reference):
    """Attempt 1: rank 1 SIGKILLed after iteration 11 (k = 3): every rank restarts at 9
    from RAM. Attempt 2: the part writes of step 12 are held (storage stays at 9), and rank
    1's node is removed after iteration 14: attempt 3 resumes at 12, newer than anything in
    storage, rank 1 from the peer copy the lost node had sent, rank 0 from its slot."""
    import sharded_state_jobs

    from ray_checkfreq.chaos import holds

    storage, control = str(tmp_path / "store"), str(tmp_path / "holds")
    holds.arm(control, "persist", hold_s=120, from_step=12)
    work_dir = str(tmp_path / "kill")
    removed: dict = {}
    os.makedirs(work_dir)
    remover = remove_node_when(train_nodes, work_dir, attempt=1, iteration=14, removed=removed)
    result, _ = fit(tmp_path, "kill", storage, workers=2, max_failures=2, every=3, sleep_s=0.3,
                    kill={"rank": 1, "iteration": 11}, gather_at=15, hold_control=control)
    remover.join(timeout=5)
    assert not isinstance(result, Exception), result
    assert removed, "rank 1's node was never removed"
    assert holds.inside(control, "persist")["step"] == 12  # a part of 12 was held, so 12 was never committed
    nodes = [starts(work_dir, rank)[0]["node"] for rank in (0, 1)]
    for rank in (0, 1):
        first, killed, lost = starts(work_dir, rank)
        assert first["iteration"] == 0 and first["restore"]["kind"] == "none"
        # Checkpoints at 3, 6, 9; rank 1 died after iteration 11, before 12's. From RAM, not storage.
        assert killed["iteration"] == 9 and killed["restore"]["step"] == 9, killed
        assert killed["restore"]["kind"] == ram_source(killed["node"], own=first["node"], ring=nodes), (rank, killed)
        # Storage had 9 only: 12 came from RAM, rank 1's from the peer copy of its lost node.
        assert lost["iteration"] == 12 and lost["restore"]["committed_step"] == 9, lost
        assert lost["restore"]["kind"] == ("peer" if rank == 1 else "slot"), (rank, lost)
    # The restored 12 was written again from RAM (under the new generation) and committed.
    assert {12, 15} <= set(committed_steps(storage))
    ends = [events(work_dir, rank, "end")[-1]["stats"] for rank in (0, 1)]
    assert all(end["sharded"] and end["snapshots"] for end in ends), ends
    final = sharded_state_jobs.load_arrays(os.path.join(work_dir, "final.npz"))
    assert_equal_state(final, reference)
    # Result.checkpoint points at the newest committed step; load() gathers it whole here.
    from ray_checkfreq.ray import load
    from ray_checkfreq.storage.tree import leaves_of

    loaded = load(result.checkpoint)
    assert loaded["checkfreq"]["iteration"] == 15
    gathered = {name: np.asarray(leaf) for _, name, leaf in leaves_of({"model": loaded["model"],
                                                                       "optimizer": loaded["optimizer"]})}
    assert_equal_state(gathered, sharded_state_jobs.load_arrays(os.path.join(work_dir, "at-15.npz")))
