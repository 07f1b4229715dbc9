"""The run's PolicyActor on a real Ray Train run: store writes slowed mid-run (a delaying
proxy in front of the loopback S3 server) raise k for every rank at the same iteration,
and k falls again after the delay ends."""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from urllib.parse import urlparse

import pytest
from test_shared_policy import TI, iterations

pytestmark = pytest.mark.chaos

# Room for k to fall after its peak (the raise far above p is in proportion): ~90 since a save
# to S3 makes 4 PUTs (data file, part manifest, manifest, retention's abandon record), ~50 at 3.
ITERATIONS = 600
SLEEP_S = 0.05  # per iteration: Ti ~60 ms, so that load on the machine moves k little
DELAY_S = 0.5  # per PUT while the delay is on: a persist takes seconds instead of ~0.1 s
# A generous p: only the store's slowness, not the machine's load, may push k up.
POLICY = {"overhead": 0.5, "profile_iters": 10,
          "adaptive": {"window_iters": 20, "min_checkpoints_per_window": 1, "patience": 1}}


@pytest.fixture(scope="module")
def two_train_nodes(ray_cluster):
    from test_ray_train import require_train_nodes

    require_train_nodes(ray_cluster, 2)
    yield ray_cluster


class DelaySwitch(threading.Thread):
    """Follows rank 0's log: turns the proxy's delay on 20 iterations after the policy
    decided k, and off once k has risen and a persist at the new k had time to finish."""

    def __init__(self, proxy, work_dir: str) -> None:
        super().__init__(daemon=True)
        self.proxy = proxy
        self.path = os.path.join(work_dir, "log-0.jsonl")
        self.on_at: int | None = None
        self.off_at: int | None = None
        self.k_before: int | None = None
        self.done = threading.Event()

    def run(self) -> None:
        iteration, k, k_since, offset = 0, None, None, 0
        while not self.done.is_set():
            time.sleep(0.02)
            iteration, k, offset = self._follow(iteration, k, offset)
            if k is None:
                continue
            k_since = k_since or iteration
            if self.on_at is None and iteration >= k_since + 20:
                self.on_at, self.k_before, self.proxy.delay_s = iteration, k, DELAY_S
            elif self.on_at is not None and self.off_at is None and k > (self.k_before or k) \
                    and iteration >= self.on_at + k:
                self.off_at, self.proxy.delay_s = iteration, 0.0
                return

    def _follow(self, iteration: int, k: int | None, offset: int) -> tuple[int, int | None, int]:
        if not os.path.exists(self.path):
            return iteration, k, offset
        with open(self.path) as log:
            log.seek(offset)
            for line in log:
                if not line.endswith("\n"):
                    break
                offset += len(line)
                entry = json.loads(line)
                if entry["event"] == "batch":
                    iteration = entry["iteration"]
                elif entry["event"] == "decision":
                    found = re.search(r"k=(\d+)", entry["got"])
                    k = int(found.group(1)) if found else k
        return iteration, k, offset


def test_slow_store_writes_raise_k_for_every_rank_at_once_and_k_falls_after(two_train_nodes, s3_server,
                                                                              s3_bucket, tmp_path):
    from faultproxy import FaultProxy
    from test_ray_train import events, fit

    with FaultProxy(urlparse(s3_server).port) as proxy:
        proxy.add_rule(lambda method, path: method == "PUT" and proxy.delay_s > 0, "delay", times=10**9)
        work_dir = str(tmp_path / "interference")
        switch = DelaySwitch(proxy, work_dir)
        switch.start()
        try:
            result, work_dir = fit(tmp_path, "interference", iterations=ITERATIONS, policy=POLICY, sleep_s=SLEEP_S,
                                   s3={"bucket": s3_bucket, "endpoint": proxy.url}, max_failures=0)
        finally:
            switch.done.set()
            proxy.delay_s = 0.0
    assert not isinstance(result, Exception), result
    assert switch.on_at is not None and switch.off_at is not None, (switch.on_at, switch.off_at)
    histories = [events(work_dir, rank, "end")[-1]["stats"]["k_changes"] for rank in (0, 1)]
    assert histories[0] == histories[1], "every rank switched k at the same iterations"
    changes = [tuple(change) for change in histories[0]]
    # The switch turns the delay off at the first rise; persists that started under it end
    # later and may raise k further, so the peak is the highest k after the delay began.
    rises = [(iteration, k) for iteration, k in changes if iteration > switch.on_at]
    peak_at, peak = max(rises, key=lambda change: change[1], default=(0, 0))
    assert peak > switch.k_before, (switch.k_before, changes)
    after = [k for iteration, k in changes if iteration > max(peak_at, switch.off_at)]
    assert after and min(after) < peak, (switch.off_at, changes)


# ------------------------------------------------------- the actor, on the session cluster
# Here, in a module that runs first: late in a full suite run the policy actor of these two
# tests never answered (not root-caused; alone, and after the Ray Data tests, they pass).
def test_policy_link_round_trip_through_the_actor(ray_session):
    from ray_checkfreq.ray.names import run_key
    from ray_checkfreq.ray.policy_actor import PolicyLink, shutdown_policy

    run = run_key(f"policy-{time.time_ns()}")
    rank0 = PolicyLink(run, rank=0, lease_s=60, batch_iters=8, poll_s=0.0)
    rank1 = PolicyLink(run, rank=1, lease_s=60, batch_iters=8)
    try:
        for link in (rank0, rank1):
            link.generation = 5
        rank0.start(world_size=2, k=4, k_floor=2, iter_s=TI, overhead=0.05,
                    adaptive={"window_iters": 10, "min_checkpoints_per_window": 1, "patience": 1})
        for row in iterations(1, 40):
            rank0.observe(row.iteration, row.iter_s, row.stall_s, row.busy)
        for row in iterations(1, 40, stall_s=0.1):
            rank1.observe(row.iteration, row.iter_s, row.stall_s, row.busy)
        # Rank 0 forwards what its agent's persist returned (more keys than a report has).
        rank0.persisted({"step": 40, "seconds": 0.9, "cpu_s": 0.2, "stored_bytes": 10, "raw_bytes": 20,
                         "uri": "file:///x", "codec": "raw", "node_id": "n0"})
        decision = _poll_until(rank0, lambda d: d["iterations_aggregated"] == 40 and d["persist_s"])
        assert decision["generation"] == 5 and decision["k"] >= math.ceil(1.25 * 0.9 / TI)
        assert decision["k"] > 4 and decision["version"] >= 2
    finally:
        assert shutdown_policy(run)


def _poll_until(link, done, timeout_s: float = 120.0) -> dict:
    """The actor's process imports torch (the engine's adaptive rate): slow on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        decision = link.poll()
        if decision is not None and done(decision):
            return decision
        time.sleep(0.05)
    raise AssertionError("the policy actor never answered as expected")


def test_a_lost_policy_actor_is_replaced_and_gets_the_proposal_again(ray_session):
    import ray

    from ray_checkfreq.ray.names import run_key
    from ray_checkfreq.ray.policy_actor import PolicyLink, find_policy, shutdown_policy

    run = run_key(f"policy-lost-{time.time_ns()}")
    link = PolicyLink(run, rank=0, lease_s=60, poll_s=0.0)
    try:
        link.generation = 2
        link.start(world_size=1, k=6, k_floor=3, iter_s=TI, overhead=0.05, adaptive={})
        assert _poll_until(link, lambda d: d["k"] == 6)["generation"] == 2
        first = find_policy(run)
        ray.kill(first)

        def from_a_new_actor(d: dict) -> bool:
            # A poll sent before the kill may still be answered by the old actor: wait for
            # an answer after the link replaced it (the name's lookup may lag behind).
            return link._handle is not None and link._handle._actor_id != first._actor_id and d["k"] == 6

        decision = _poll_until(link, from_a_new_actor)
        assert decision["generation"] == 2 and decision["version"] == 1  # it got rank 0's proposal again
    finally:
        shutdown_policy(run)
