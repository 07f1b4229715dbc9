"""The pieces of the in-place mode's answer to a replacement that never comes, on the
session cluster: finding this job's Train workers that wait for a node, and ending one by id
through the GCS (``ray_checkfreq.ray.unplaced``); and ``InPlaceConfig``'s checks."""

from __future__ import annotations

import time

import pytest

from ray_checkfreq.ray.inplace import InPlaceConfig
from ray_checkfreq.ray.unplaced import TRAIN_WORKER_CLASS, end_actor, unplaced_train_workers


@pytest.mark.parametrize("field", ["timeout_s", "notice_poll_s", "replacement_wait_s"])
@pytest.mark.parametrize("value", [0, -1.0, True, "5"])
def test_the_config_refuses_a_duration_that_is_not_positive(field, value):
    with pytest.raises(ValueError, match=f"InPlaceConfig.{field} must be > 0 seconds, got {value!r}"):
        InPlaceConfig(**{field: value})


@pytest.mark.parametrize("field", ["min_replicas", "heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"])
def test_the_config_refuses_counts_below_one(field):
    with pytest.raises(ValueError, match=f"InPlaceConfig.{field} must be an integer >= 1, got 0"):
        InPlaceConfig(**{field: 0})


def _state(ray, actor_id: str) -> str:
    from ray._private import state

    return state.actors(actor_id=actor_id)["State"]


def test_an_unplaced_train_worker_is_found_and_ended_and_a_placed_one_is_not(ray_session):
    ray = ray_session

    class Worker:  # named as Ray Train's worker class: that is what the search matches
        def ping(self) -> int:
            return 1

    Worker.__name__ = Worker.__qualname__ = TRAIN_WORKER_CLASS
    placed = ray.remote(num_cpus=0)(Worker).remote()
    ray.get(placed.ping.remote())
    unplaced = ray.remote(num_cpus=0, resources={"no-such-node": 1})(Worker).remote()
    job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + 30
    while unplaced._actor_id.hex() not in unplaced_train_workers(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert unplaced_train_workers(job) == [unplaced._actor_id.hex()]
    assert unplaced_train_workers("ffffffff") == []  # another job's: not ours to end
    end_actor(unplaced._actor_id.hex())
    deadline = time.monotonic() + 30
    while _state(ray, unplaced._actor_id.hex()) != "DEAD" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _state(ray, unplaced._actor_id.hex()) == "DEAD"
    assert unplaced_train_workers(job) == []
    assert ray.get(placed.ping.remote()) == 1
    ray.kill(placed)
