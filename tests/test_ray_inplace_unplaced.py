"""In-place recovery when the replacement never comes: a replica's node is removed and no
node is left for its replacement (each worker needs one of the cluster's three
``rcf_train`` slots). The survivors train on to the end of the job's work; then the last
step's rank 0 ends the unplaced replacement, so ``fit()`` returns (Ray 2.60's controller
would wait for it for ever, ``ray_checkfreq.ray.unplaced``).

A cluster of this module's own (it removes a node; conftest's ``own_cluster``).
"""

from __future__ import annotations

import time
import uuid

import inplace_jobs  # tests/ is on sys.path
import pytest
from conftest import TRAIN_RESOURCE, own_cluster
from test_ray_inplace import CONFIG, REPLICAS, assert_every_step_whole, read_events, remove_node, when_all_trained

pytestmark = pytest.mark.chaos

REPLACEMENT_WAIT_S = 2.0
# fit() ends within this of the survivors' end: the wait above, the controller's next
# replacement try (it fails at once) and its shutdown; a hang is cut at the job's timeout.
RETURN_LIMIT_S = 60.0
JOB_TIMEOUT_S = 300.0


def test_a_replacement_that_never_comes_leaves_the_survivors_training_and_fit_returns(ray_session, tmp_path):
    from ray.train import ControllerError

    from ray_checkfreq.chaos.harness import TrainJob, fit_job
    from ray_checkfreq.ray.inplace import InPlaceConfig

    work_dir = str(tmp_path)
    config = {**CONFIG, "kill_step": None, "max_epochs": 1, "storage": str(tmp_path / "checkpoints"),
              "replacement_wait_s": REPLACEMENT_WAIT_S, "work_dir": work_dir}
    removed: list = []
    with own_cluster(REPLICAS) as cluster:
        def lose(node: str) -> None:
            remove_node(cluster, node)
            removed.append((node, time.time()))

        remover = when_all_trained(work_dir, REPLICAS - 1, lose, timeout_s=JOB_TIMEOUT_S)
        outcome = fit_job(TrainJob(train=inplace_jobs.train, config=config, workers=REPLICAS,
                                   resources_per_worker={"CPU": 1, TRAIN_RESOURCE: 1},
                                   name=f"unplaced-{uuid.uuid4().hex[:6]}", storage_path=work_dir + "/results",
                                   max_failures=2, timeout_s=JOB_TIMEOUT_S,
                                   in_place=InPlaceConfig(replacement_wait_s=REPLACEMENT_WAIT_S)),
                          raise_errors=False)
        returned = time.time()
        remover.join(timeout=1)
    assert removed, "the node was never removed"
    assert not isinstance(outcome, TimeoutError), f"fit() did not return: {outcome}"
    events = read_events(work_dir)
    ends = [e for e in events if e["event"] == "end"]
    inplace_jobs.xfail_on_ray_node_race(outcome, survivors_ended=bool(ends))
    last = inplace_jobs.quorum_steps(CONFIG).steps_per_epoch * config["max_epochs"]
    # The two survivors trained on, in a quorum of two, to the end of the work; nobody else started.
    assert sorted(e["world_rank"] for e in ends) == list(range(REPLICAS - 1)) and {e["step"] for e in ends} == {last}, \
        f"ends {ends}; fit() gave {outcome!r}"
    assert isinstance(outcome, ControllerError), f"fit() gave {outcome!r}"
    assert len([e for e in events if e["event"] == "start"]) == REPLICAS
    # Every step after the lost replica's last commit committed in a quorum of two (on a quiet
    # machine the survivors finish the epoch within seconds of the loss).
    lost_last = max(e["step"] for e in events if e["event"] == "commit" and e["world_rank"] == REPLICAS - 1)
    after = [e for e in events if e["event"] == "commit" and e["step"] > lost_last + 1]
    assert len({e["step"] for e in after}) >= 10 and {e["size"] for e in after} == {REPLICAS - 1}, after[:4]
    assert_every_step_whole(events, 0, last)
    waited = returned - max(e["t"] for e in ends)
    print(f"fit() returned {waited:.1f} s after the survivors' work ended "
          f"({returned - removed[0][1]:.1f} s after the node's loss)")
    assert waited < RETURN_LIMIT_S
