"""FSDP2 on Ray Train (CPU gloo, 4 workers on five one-CPU nodes, ``num_workers=(2, 4)``):
the same ``ray_checkfreq.ray.CheckFreq`` line as for DDP, every rank writing its own shards,
one global commit per step, restarts that read each rank's copy of the newest step from RAM
(its own slot, or a peer's copy where its node was lost), and a restart at a smaller world
size that reshards the newest commit.

Each restart's start iteration and source per rank are checked (a run retrained from scratch
ends with the same weights), and the state is compared with training that never stopped
(spawned gloo ranks, no checkpoints).
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
from store_helpers import part_store
from test_ray_train import assert_nothing_left, attempt_batches, events

pytestmark = pytest.mark.chaos

TRAIN_RESOURCE = "rcf_train"


WORKERS = 4
ITERATIONS = 22
EVERY = 3


@pytest.fixture(scope="module")
def train_nodes():
    """A cluster of this module's own (it removes nodes): one spare node beyond the workers, so
    the first node lost still leaves room for 4. A Train run started right after another
    module's runs on the session cluster once waited for its workers indefinitely."""
    from conftest import own_cluster

    with own_cluster(WORKERS + 1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The whole state after iteration 15 and after ``ITERATIONS`` uninterrupted steps at
    world size 4."""
    import functools

    import ray_sharded_jobs
    import sharded_state_jobs

    root = tmp_path_factory.mktemp("reference")
    sharded_state_jobs.spawn(functools.partial(ray_sharded_jobs.reference, iterations=ITERATIONS, gather_at=(15,)),
                             WORKERS, str(root))
    return {name: sharded_state_jobs.load_arrays(root / f"{name}.npz") for name in ("at-15", "reference")}



def fit(tmp_path, name: str, storage: str, *, max_failures: int, **config) -> tuple[object, str]:
    import ray_sharded_jobs

    from ray_checkfreq.chaos.harness import TrainJob, fit_job

    work_dir = str(tmp_path / name)
    os.makedirs(work_dir, exist_ok=True)
    run_name = f"{name}-{uuid.uuid4().hex[:6]}"
    job = TrainJob(train=ray_sharded_jobs.train,
                   config={"work_dir": work_dir, "storage": storage, "iterations": ITERATIONS, "every": EVERY,
                           **config},
                   name=run_name, storage_path=str(tmp_path / "results"), workers=(2, WORKERS),
                   resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1}, max_failures=max_failures,
                   timeout_s=RUN_TIMEOUT_S)
    outcome = fit_job(job, raise_errors=False)  # the run's error: the caller asserts on it
    assert_nothing_left(run_name)  # no agent, no slot file of the run
    return outcome, work_dir


def starts(work_dir: str, rank: int) -> list[dict]:
    return events(work_dir, rank, "start")


def sample_accounting(work_dir: str) -> dict:
    """Lost and repeated samples per epoch over the batches no later attempt rolled back
    (``chaos.report``: every rank's k-th start is attempt k, as every restart restarts all)."""
    import ray_sharded_jobs
    import sharded_state_jobs

    from ray_checkfreq.chaos import report

    logged = []
    for rank in range(WORKERS):
        attempt = -1
        with open(os.path.join(work_dir, f"log-{rank}.jsonl")) as lines:
            for entry in map(json.loads, lines):
                attempt += entry["event"] == "start"
                logged.append({**entry, "rank": rank, "attempt": attempt})
    kept = report.surviving_batches(logged, report.attempts(logged))
    return report.sample_accounting(kept, samples=ray_sharded_jobs.SAMPLES,
                                    global_batch=sharded_state_jobs.GLOBAL_BATCH,
                                    epoch_len=ray_sharded_jobs.EPOCH_LEN, total_iterations=ITERATIONS)


def committed_steps(storage: str) -> list[int]:

    return [ref.step for ref in part_store(storage).list()]


def assert_equal_state(final: dict, reference: dict, *, atol: float = 0.0) -> None:
    assert sorted(final) == sorted(reference)
    for name, value in reference.items():
        if atol == 0.0:
            assert np.array_equal(final[name], value), name
        else:
            np.testing.assert_allclose(final[name], value, rtol=0, atol=atol, err_msg=name)


def watch_commits(storage: str, seen: set[int], stop: threading.Event) -> threading.Thread:
    """Every step committed while the run goes on (retention keeps only the newest 2)."""
    from ray_checkfreq.errors import CheckFreqError

    def watch() -> None:
        while not stop.wait(0.1):
            try:
                seen.update(committed_steps(storage))
            except (OSError, CheckFreqError):  # not made yet, or a directory retention removed mid-scan
                pass

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def remove_node_when(cluster, work_dir: str, *, rank: int, attempt: int, iteration: int, removed: list,
                     after_peer_copy: bool = False) -> threading.Thread:
    """Remove ``rank``'s node of the given attempt (0-based; SIGKILL of its raylet and
    processes) once that rank logged ``iteration`` in it (and, with ``after_peer_copy``, had
    sent a peer copy in it)."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                reached = [e["iteration"] for e in attempt_batches(work_dir, rank, attempt)
                           if e["peer_copies"]["sent"] > 0 or not after_peer_copy]
            except (FileNotFoundError, IndexError):
                reached = []
            if reached and max(reached) >= iteration:
                node = starts(work_dir, rank)[attempt]["node"]
                cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node), allow_graceful=False)
                removed.append(node)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def ram_source(rank: int, node: str, *, before: list[str], lost: set[str]) -> str:
    """What ``rank``, restarted on ``node``, reads when every rank restores from RAM.

    ``before``: the previous attempt's node per rank. A rank's slot is on its node of
    before; its peer copy on the next node of that ring (``shard_copies.peer_node``). The
    chooser prefers a slot on the rank's node, then a peer copy there, then a slot elsewhere,
    then a peer copy elsewhere."""
    own, holder = before[rank], before[(rank + 1) % len(before)]
    if node == own and own not in lost:
        return "slot"
    if node == holder:
        return "peer"
    return "slot" if own not in lost else "peer"


def test_a_killed_rank_a_lost_node_and_a_smaller_world_each_resume_where_they_should(train_nodes, tmp_path,
                                                                                   reference):
    """Four attempts of one run (22 iterations, 10 an epoch; k = 3 from each epoch's start:
    checkpoints at 3, 6, 9, the epoch end 10, 13, 16, 19, 20):

    1. W = 4: rank 1 is SIGKILLed after iteration 11, mid-interval.
    2. W = 4 again (the spare node): every rank restarts at 10 from RAM. The part writes of
       step 13 are held (storage stays at 10), and rank 1's node is removed after iteration 15.
    3. W = 4 on the 4 nodes left: every rank resumes at 13, newer than anything in storage,
       rank 1 from the peer copy its lost node had sent. 13 is written again and committed.
       The state after iteration 15 equals training that never stopped, bit for bit. Rank 3's
       node is removed after iteration 17.
    4. W = 3 (elastic): every rank reads its new shards of the newest commit from storage
       (resharding 4 -> 3). With the global batch fixed, the run ends within 1e-9 of
       training at W = 4 that never stopped.

    Over the batches that count, every sample is trained once per epoch.
    """
    import sharded_state_jobs

    from ray_checkfreq.chaos import holds

    storage, control = str(tmp_path / "store"), str(tmp_path / "holds")
    holds.arm(control, "persist", hold_s=120, from_step=13)
    work_dir = str(tmp_path / "run")
    os.makedirs(work_dir)
    removed: list[str] = []
    removers = [remove_node_when(train_nodes, work_dir, rank=1, attempt=1, iteration=15, removed=removed,
                                 after_peer_copy=True),
                remove_node_when(train_nodes, work_dir, rank=3, attempt=2, iteration=17, removed=removed)]
    committed, run_ended = set(), threading.Event()
    commits = watch_commits(storage, committed, run_ended)
    result, _ = fit(tmp_path, "run", storage, max_failures=3, sleep_s=0.3, kill={"rank": 1, "iteration": 11},
                    gather_at=[15, 20], hold_control=control)
    run_ended.set()
    for thread in (*removers, commits):
        thread.join(timeout=5)
    assert not isinstance(result, Exception), result
    assert len(removed) == 2, f"nodes removed: {removed}"
    assert holds.inside(control, "persist")["step"] == 13  # a part of 13 was held, so 13 was never committed
    attempts = [[starts(work_dir, rank)[a] for rank in range(WORKERS)] for a in range(3)]
    assert [[s["world_size"] for s in attempt] for attempt in attempts] == [[WORKERS] * WORKERS] * 3
    assert all(s["iteration"] == 0 and s["restore"]["kind"] == "none" for s in attempts[0])
    nodes = [[s["node"] for s in attempt] for attempt in attempts]
    for rank in range(WORKERS):
        killed, lost = attempts[1][rank], attempts[2][rank]
        # Rank 1 died after iteration 11, before 13's checkpoint. From RAM, not storage.
        assert killed["iteration"] == 10 and killed["restore"]["step"] == 10, killed
        assert killed["restore"]["kind"] == ram_source(rank, killed["node"], before=nodes[0], lost=set()), \
            (rank, killed, nodes)
        # Storage had 10 only: 13 came from RAM, rank 1's from the peer copy of its lost node.
        assert lost["iteration"] == 13 and lost["restore"]["committed_step"] == 10, lost
        assert lost["restore"]["kind"] == ram_source(rank, lost["node"], before=nodes[1], lost={removed[0]}), \
            (rank, lost, nodes)
    assert attempts[2][1]["restore"]["kind"] == "peer"
    assert_equal_state(sharded_state_jobs.load_arrays(os.path.join(work_dir, "at-15.npz")), reference["at-15"])
    # The restored 13 was written again from RAM (under the new generation) and committed.
    assert {13, 16} <= committed, committed
    resharded = [starts(work_dir, rank)[3] for rank in range(3)]
    reached = max(e["iteration"] for rank in range(WORKERS) for e in attempt_batches(work_dir, rank, 2))
    for start in resharded:
        assert start["world_size"] == 3 and start["restore"]["kind"] == "storage", start
        assert start["iteration"] == start["restore"]["step"] == resharded[0]["iteration"], start
    assert resharded[0]["iteration"] in committed and 16 <= resharded[0]["iteration"] <= reached
    assert len(starts(work_dir, 3)) == 3  # rank 3 of W = 4 never started again
    ends = [events(work_dir, rank, "end")[-1] for rank in range(3)]
    assert all(end["stats"]["sharded"] and end["stats"]["snapshots"] for end in ends), ends
    # The last generation's first commit freed what no restart could choose any more: the
    # slots of ranks that left a node, and every older generation's peer copy.
    generation = ends[0]["generation"]
    assert ends[0]["stats"]["stale_ram_released"]["peer_copies"] >= 1, ends[0]
    owners_now = {end["node"]: rank for rank, end in enumerate(ends)}
    for node, held in ends[0]["ram"].items():
        assert all(owner == owners_now.get(node) or gen == generation for owner, gen in held["slots"]), (node, held)
        assert all(gen == generation for _, gen in held["peers"]), (node, held)
    # Each rank's data position travelled in its part and RAM copy, also across 4 -> 3.
    assert sample_accounting(work_dir) == {"samples_lost": 0, "samples_repeated": 0}
    final = sharded_state_jobs.load_arrays(os.path.join(work_dir, "final.npz"))
    assert_equal_state(final, reference["reference"], atol=1e-9)
    # Result.checkpoint points at the newest committed step; load() gathers it whole here.
    from ray_checkfreq.ray import load
    from ray_checkfreq.storage.tree import leaves_of

    loaded = load(result.checkpoint)
    # 20 (the epoch end), or 22 where step 19 was committed before rank 3's node went (under
    # load) and the last attempt, resuming at 19, checkpointed 3 iterations later: the end.
    newest = max(committed)
    assert loaded["checkfreq"]["iteration"] == newest and newest in (20, 22), committed
    gathered = {name: np.asarray(leaf) for _, name, leaf in leaves_of({"model": loaded["model"],
                                                                       "optimizer": loaded["optimizer"]})}
    expected = "at-20.npz" if newest == 20 else "final.npz"
    assert_equal_state(gathered, sharded_state_jobs.load_arrays(os.path.join(work_dir, expected)))
