"""In-place recovery and a preemption notice: Ray Train's own watcher is off in this mode
(Ray 2.60), so each replica watches its own node. The drained node's replica leaves the
quorum at a step boundary (no step aborted), waits for its node to go, and Ray places its
replacement on the spare node, which heals from a live peer.

Four one-CPU nodes of this module's own (it removes one; conftest's ``own_cluster``): three
replicas and a spare. The node of world rank 1 is drained with a deadline ``NOTICE_S`` away
once the three trained together a few steps, and removed whole at that deadline.
"""

from __future__ import annotations

import time
import uuid

import inplace_jobs  # tests/ is on sys.path
import pytest
import torch
from conftest import RUN_TIMEOUT_S, TRAIN_RESOURCE, own_cluster
from test_ray_inplace import (
    CONFIG,
    REPLICAS,
    SURVIVOR_PAUSE_LIMIT_S,
    assert_every_step_whole,
    assert_weights,
    end_step,
    read_events,
    remove_node,
    when_all_trained,
)
from test_ray_train import drain

pytestmark = pytest.mark.chaos

NOTICE_S = 8.0
VICTIM = 1  # world rank: neither the first writer nor the last rank


def notice_then_remove(cluster, node: str, marks: dict) -> None:
    """Drain ``node`` (deadline ``NOTICE_S``), then remove it whole at the deadline."""
    marks["node"], marks["notice_t"] = node, time.time()
    drain(cluster, node, time.time() + NOTICE_S)
    time.sleep(max(0.0, marks["notice_t"] + NOTICE_S - time.time()))
    remove_node(cluster, node)
    marks["removed_t"] = time.time()


def test_a_drained_replica_leaves_at_a_step_boundary_and_is_replaced_on_another_node(ray_session, tmp_path):
    from ray_checkfreq.chaos.harness import TrainJob, fit_job
    from ray_checkfreq.ray.inplace import InPlaceConfig

    work_dir = str(tmp_path)
    config = {**CONFIG, "kill_step": None, "work_dir": work_dir, "storage": str(tmp_path / "checkpoints")}
    marks: dict = {}
    with own_cluster(REPLICAS + 1) as cluster:
        announcer = when_all_trained(work_dir, VICTIM, lambda node: notice_then_remove(cluster, node, marks))
        outcome = fit_job(TrainJob(train=inplace_jobs.train, config=config, workers=REPLICAS,
                                   resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1},
                                   name=f"notice-{uuid.uuid4().hex[:6]}", storage_path=work_dir + "/results",
                                   max_failures=2, timeout_s=RUN_TIMEOUT_S, in_place=InPlaceConfig()),
                          raise_errors=False)
        announcer.join(timeout=1)
    assert "removed_t" in marks, f"the notice was never sent: {marks}"
    events = read_events(work_dir)
    inplace_jobs.xfail_on_ray_node_race(outcome, survivors_ended=any(e["event"] == "end" for e in events))
    assert not isinstance(outcome, Exception), f"fit() failed: {outcome!r}"
    starts = [e for e in events if e["event"] == "start"]
    (victim,) = {e["pid"] for e in starts if e["node"] == marks["node"]}
    victim_events = [e for e in events if e["pid"] == victim]
    last_commit = max(e["t"] for e in victim_events if e["event"] == "commit")
    # It left soon after the notice (its watcher polls every 0.5 s), at a step it had committed,
    # not at the deadline in the middle of a step.
    left_after_s = last_commit - marks["notice_t"]
    assert victim_events[-1]["event"] == "commit" and left_after_s < NOTICE_S / 2, \
        f"the drained replica's last commit came {left_after_s:.2f} s after the notice: {victim_events[-3:]}"
    left_step = victim_events[-1]["step"]
    assert not [e for e in events if e["event"] == "rollback" and abs(e["step"] - left_step) <= 1], \
        "a step was aborted where the replica left"
    commits = [e for e in events if e["event"] == "commit"]
    survivors = {e["pid"] for e in commits if e["t"] < marks["notice_t"]} - {victim}
    pauses = []
    for pid in survivors:
        times = [e["t"] for e in commits if e["pid"] == pid]
        after = [b - a for a, b in zip(times, times[1:]) if b > last_commit]
        pauses.append(max(after[:5]))  # the first steps without the replica that left
    print(f"the drained replica left {left_after_s:.2f} s after the notice (after step {left_step}); "
          f"survivors' longest wait for a commit after it: {max(pauses):.2f} s")
    assert max(pauses) < SURVIVOR_PAUSE_LIMIT_S
    # The replacement started on the spare node (not the drained one) and trained with the others.
    (replacement,) = [e for e in starts if e["t"] > marks["notice_t"]]
    assert replacement["world_rank"] == VICTIM and replacement["node"] != marks["node"]
    assert [e for e in commits if e["pid"] == replacement["pid"] and e["size"] == REPLICAS]
    last = end_step(events)
    taken = assert_every_step_whole(events, 0, last)
    per_epoch = inplace_jobs.quorum_steps(CONFIG).steps_per_epoch
    samples = CONFIG["samples"]
    for epoch in range(last // per_epoch):
        assert sorted(taken[epoch * samples:(epoch + 1) * samples]) == list(range(samples)), f"epoch {epoch}"
    final = torch.load(f"{work_dir}/final-0.pt", weights_only=True)
    assert_weights(final["model"], inplace_jobs.reference(CONFIG, [last])[last], "the run's end")
