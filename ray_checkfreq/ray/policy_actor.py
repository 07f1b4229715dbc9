"""PolicyActor: one per run, on the driver's side, running ``SharedPolicy`` for all ranks.

``CheckFreqCallback`` creates it when the Train controller starts (on the controller's
node) and ends it with ``fit()``; without the callback, rank 0 creates it on first use
(on the head node) and it ends once nobody reported for its lease. It is a detached,
named actor (``rcf-policy:<run>``), so it outlives worker-group restarts: a restart at
the same world size goes on with the k learned so far.

Ranks report through ``PolicyLink``: iterations in batches, fire-and-forget; rank 0 also
polls the decision without waiting for it (``ray.wait`` with timeout 0), and hands a new
k to its engine, whose next per-iteration decision carries it to every rank. Rank 0
reports each persist its node agent ran (``PolicyLink.persisted``, the agent's own
figures). Nothing here blocks an iteration; if the actor
is gone, rank 0 keeps the last k it applied and creates a new actor.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any

import ray

from ray_checkfreq.engine.adaptive import AdaptiveConfig
from ray_checkfreq.engine.policy import MAX_OVERHEAD
from ray_checkfreq.ray.names import NAMESPACE, policy_name
from ray_checkfreq.ray.shared_policy import IterationReport, PersistReport, SharedPolicy, SharedPolicyConfig

logger = logging.getLogger("ray_checkfreq.ray")


MAX_UNSENT_ROWS = 4096  # iterations a rank keeps while the policy actor is not found yet


class PolicyActor:
    """The actor class (sequential: one call at a time, so ``SharedPolicy`` needs no lock)."""

    def __init__(self, run: str, *, lease_s: float | None = None) -> None:
        self.run = run
        self._policy: SharedPolicy | None = None
        self._lease_s = lease_s
        self._renewed = time.monotonic()
        if lease_s is not None:
            threading.Thread(target=self._watch_lease, name="rcf-policy-lease", daemon=True).start()

    def start(self, *, generation: int, world_size: int, k: int, k_floor: int, iter_s: float, overhead: float,
              adaptive: dict, k_cap: int | None = None, cost_s: float = 0.0, max_overhead: float = MAX_OVERHEAD,
              restart_s: float = 60.0, lost_work: bool = True) -> int:
        self._renewed = time.monotonic()
        config = SharedPolicyConfig(overhead=overhead, adaptive=AdaptiveConfig(**adaptive), max_overhead=max_overhead,
                                    restart_s=restart_s)
        if self._policy is None or self._policy.config != config:
            self._policy = SharedPolicy(config)
        return self._policy.start(generation=generation, world_size=world_size, k=k, k_floor=k_floor,
                                  iter_s=iter_s, k_cap=k_cap, cost_s=cost_s, now_s=time.monotonic(),
                                  lost_work=lost_work)

    def record_iterations(self, generation: int, rank: int, rows: list[tuple[int, float, float, bool]]) -> None:
        self._renewed = time.monotonic()
        if self._policy is not None:
            reports = [IterationReport(iteration=int(i), iter_s=float(t), stall_s=float(s), busy=bool(b))
                       for i, t, s, b in rows]
            self._policy.record_iterations(generation=generation, rank=rank, reports=reports,
                                           now_s=time.monotonic())

    def record_persist(self, generation: int, report: dict) -> None:
        if self._policy is not None:
            self._policy.record_persist(generation=generation, report=PersistReport(**report),
                                        now_s=time.monotonic())

    def decision(self) -> dict | None:
        return self._policy.decision() if self._policy is not None else None

    def history(self) -> list[dict]:
        return list(self._policy.history) if self._policy is not None else []

    def shutdown(self) -> None:
        ray.actor.exit_actor()

    def _watch_lease(self) -> None:
        assert self._lease_s is not None
        while True:
            time.sleep(min(5.0, self._lease_s / 4))
            if time.monotonic() - self._renewed > self._lease_s:
                logger.warning("policy actor of run %s: no report for %.0f s; exiting", self.run, self._lease_s)
                os._exit(0)


def get_or_create_policy(run: str, *, node_id: str | None = None, lease_s: float | None = None) -> Any:
    """The run's PolicyActor: the live one, or a new detached one near ``node_id`` (default:
    the head node, where the driver runs)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or _head_node_id()
    options: dict[str, Any] = {"name": policy_name(run), "namespace": NAMESPACE, "lifetime": "detached",
                               "get_if_exists": True, "num_cpus": 0, "max_restarts": 0}
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=True)
    return ray.remote(PolicyActor).options(**options).remote(run, lease_s=lease_s)


def find_policy(run: str) -> Any | None:
    try:
        return ray.get_actor(policy_name(run), namespace=NAMESPACE)
    except ValueError:
        return None


def shutdown_policy(run: str, timeout_s: float = 10.0) -> bool:
    """Kill the run's policy actor and wait (bounded) until its name is free again."""
    handle = find_policy(run)
    if handle is None:
        return False
    ray.kill(handle)
    deadline = time.monotonic() + timeout_s
    while find_policy(run) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def _head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return None


class PolicyLink:
    """A rank's side of the PolicyActor: batched reports; on rank 0, the decisions."""

    def __init__(self, run: str, *, rank: int, lease_s: float, batch_iters: int = 32, batch_s: float = 1.0,
                 poll_s: float = 0.25, retry_s: float = 30.0) -> None:
        self.run = run
        self.rank = rank
        self._lease_s = lease_s
        self._batch_iters = batch_iters
        self._batch_s = batch_s
        self._poll_s = poll_s
        self._retry_s = retry_s
        self._handle = get_or_create_policy(run, lease_s=lease_s) if rank == 0 else find_policy(run)
        self._rows: list[tuple[int, float, float, bool]] = []
        self._sent_s = time.monotonic()
        self._pending: Any = None
        self._polled_s = 0.0
        self._lost_s: float | None = None
        self.generation: int | None = None
        self.started: dict | None = None  # what rank 0 proposed (to re-send to a new actor)

    # ---------------------------------------------------------------- reports
    def observe(self, iteration: int, iter_s: float, stall_s: float, busy: bool) -> None:
        if self.generation is None:
            return
        self._rows.append((iteration, iter_s, stall_s, busy))
        now = time.monotonic()
        if len(self._rows) >= self._batch_iters or now - self._sent_s >= self._batch_s:
            self.send(now)

    def send(self, now: float | None = None) -> None:
        self._sent_s = now if now is not None else time.monotonic()
        if not self._rows or self.generation is None:
            return
        if self._handle is None:
            self._handle = find_policy(self.run)  # rank 0 may create it after this rank started
            if self._handle is None:
                del self._rows[:-MAX_UNSENT_ROWS]  # kept for the actor, bounded
                return
        rows, self._rows = self._rows, []
        self._handle.record_iterations.remote(self.generation, self.rank, rows)  # not awaited

    def persisted(self, report: dict) -> None:
        """Rank 0: a persist its agent ran, as the agent measured it (``PersistReport``'s
        fields). Not awaited; called from the persist thread."""
        handle = self._handle
        if handle is None or self.generation is None:
            return  # one measurement fewer: the actor is gone or not found yet
        fields = {name: report[name] for name in ("step", "seconds", "cpu_s", "stored_bytes", "node_id")
                  if name in report}
        try:
            handle.record_persist.remote(self.generation, fields)
        except ray.exceptions.RayError as err:
            logger.warning("could not report a persist to the run's policy actor: %s", err)

    # ------------------------------------------------------- rank 0: decisions
    def start(self, **proposal: Any) -> None:
        """Rank 0: the engine's profiled proposal (k, k_floor, iter_s, overhead, adaptive)."""
        assert self.generation is not None
        self.started = proposal
        if self._handle is not None:
            self._handle.start.remote(generation=self.generation, **proposal)
        self._pending = None

    def poll(self) -> dict | None:
        """The actor's newest decision once it has arrived (never waits), else None."""
        if self.started is None:
            return None
        if self._handle is None:
            self._reconnect()
            return None
        now = time.monotonic()
        if now - self._polled_s < self._poll_s:  # the per-iteration path: at most one Ray call per poll_s
            return None
        self._polled_s = now
        if self._pending is None:
            self._pending = self._handle.decision.remote()
            return None
        ready, _ = ray.wait([self._pending], timeout=0)
        if not ready:
            return None
        ref, self._pending = self._pending, None
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as err:
            logger.warning("the run's policy actor is gone (%s); keeping k, starting a new one", err)
            self._handle = None  # reconnected at the next poll, then at most every retry_s
            return None

    def _reconnect(self) -> None:
        now = time.monotonic()
        if self._lost_s is not None and now - self._lost_s < self._retry_s:
            return
        self._lost_s = now
        try:
            self._handle = get_or_create_policy(self.run, lease_s=self._lease_s)
        except ray.exceptions.RayError as err:
            logger.warning("could not start the run's policy actor: %s", err)
            return
        if self.started is not None:
            self.start(**self.started)

    def close(self) -> None:
        self.send()


def adaptive_json(config: AdaptiveConfig) -> dict:
    return asdict(config)
