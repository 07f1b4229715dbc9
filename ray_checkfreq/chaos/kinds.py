"""The preemption kinds: what the injector does to a running Ray Train job.

Everything here acts on one machine's ``ray.cluster_utils.Cluster`` (several raylets,
one host): processes are SIGKILLed by pid and nodes are removed with
``remove_node(allow_graceful=False)``. On a real cluster the same events are: SIGKILL on
the host that runs the process (e.g. ``ray.util.state.list_workers`` for the pid, then
``kill -9`` over ssh), and for a node loss stopping that node's raylet
(``ray stop --force`` on it, or terminating the instance); the drain notice is the same
``GcsClient.drain_node`` call the autoscaler makes. Those paths are documented, not tested.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_checkfreq.chaos import holds

TRAIN_RESOURCE = "rcf_chaos_train"
MiB = 1 << 20


@dataclass
class JobView:
    """What the injector knows of the running job (from its event log)."""

    run: str | None = None
    attempt: int | None = None
    ranks: dict[int, dict] = field(default_factory=dict)  # rank -> its start event in the current attempt
    iteration: int = 0  # newest iteration rank 0 logged

    def world_size(self) -> int:
        return max(len(self.ranks), 1)

    def rank_of(self, target: int) -> dict:
        if not self.ranks:
            raise RuntimeError("no rank of the job has started yet")
        return self.ranks[sorted(self.ranks)[target % len(self.ranks)]]

    def pids_on(self, node_id: str) -> list[int]:
        return [start["pid"] for start in self.ranks.values() if start["node"] == node_id]


class LocalCluster:
    """A ``cluster_utils.Cluster`` of one-CPU training nodes; the head only hosts the driver."""

    def __init__(self, *, nodes: int, object_store_mb: int = 128) -> None:
        from ray.cluster_utils import Cluster

        self.object_store_bytes = object_store_mb * MiB
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": self.object_store_bytes, "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                               "health_check_timeout_ms": 500}})
        for _ in range(nodes):
            self.add_node()
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self) -> str:
        node = self.cluster.add_node(num_cpus=1, object_store_memory=self.object_store_bytes,
                                     resources={TRAIN_RESOURCE: 1})
        return node.node_id

    def node_ids(self) -> set[str]:
        """The training nodes held now."""
        return {node.node_id for node in self.cluster.worker_nodes}

    def resize(self, nodes: int) -> None:
        """Add training nodes, or remove idle ones, until ``nodes`` are held."""
        while len(self.cluster.worker_nodes) < nodes:
            self.add_node()
        while len(self.cluster.worker_nodes) > nodes:
            self.cluster.remove_node(list(self.cluster.worker_nodes)[-1], allow_graceful=True)
        self.cluster.wait_for_nodes()

    def remove(self, node_id: str) -> None:
        node = next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)
        if node is None:
            raise RuntimeError(f"node {node_id[:12]} is not a worker node of this cluster")
        self.cluster.remove_node(node, allow_graceful=False)

    def drain(self, node_id: str, deadline_epoch_s: float) -> None:
        """A preemption notice as the autoscaler sends it: the node keeps running until removed.
        ``deadline_epoch_s``: when it goes, seconds since the epoch (``time.time()`` + notice)."""
        import ray._raylet
        from ray.core.generated import autoscaler_pb2

        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
        accepted, why = ray._raylet.GcsClient(address=self.address).drain_node(  # type: ignore[attr-defined]
            node_id, reason, "ray_checkfreq chaos: preemption notice", int(deadline_epoch_s * 1000))
        if not accepted:
            raise RuntimeError(f"drain of node {node_id[:12]} refused: {why}")

    def shutdown(self) -> None:
        self.cluster.shutdown()


@dataclass(frozen=True, kw_only=True)
class KindSettings:
    control_dir: str
    notice_deadline_s: float = 3.0
    hold_s: float = 60.0
    hold_wait_s: float = 60.0


Emit = Callable[..., None]


def sigkill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def inject(kind: str, *, view: JobView, target: int, cluster: LocalCluster, settings: KindSettings,
           emit: Emit) -> dict:
    """Do one preemption of ``kind``; returns what was hit (``t_kill``: when it died, ``lost_node``)."""
    action = _ACTIONS.get(kind)
    if action is None:
        raise ValueError(f"kind {kind!r}: no such preemption kind")
    return action(view=view, target=target, cluster=cluster, settings=settings, emit=emit)


def _worker(*, view: JobView, target: int, **_: Any) -> dict:
    start = view.rank_of(target)
    sigkill(start["pid"])
    return {"t_kill": time.time(), "rank": start["rank"], "pid": start["pid"], "node": start["node"],
            "what": f"SIGKILL rank {start['rank']} (pid {start['pid']})"}


def _agent(*, view: JobView, target: int, **_: Any) -> dict:
    import ray

    from ray_checkfreq.ray.agent import live_agents

    start = view.rank_of(target)
    agents = live_agents(view.run or start["run"])
    node = start["node"] if start["node"] in agents else next(iter(agents), None)
    if node is None:
        raise RuntimeError("no node agent of the run is alive")
    pid = ray.get(agents[node].info.remote(), timeout=30)["pid"]
    sigkill(pid)
    return {"t_kill": time.time(), "node": node, "pid": pid, "what": f"SIGKILL node agent on {node[:8]} (pid {pid})"}


def _node_to_lose(view: JobView, target: int, cluster: LocalCluster) -> dict:
    """The start event of the rank ``target`` picks among those whose node is still up (a
    second loss before the job restarted), else any training node (one it had not reached)."""
    held = cluster.node_ids()
    ranks = [start for _, start in sorted(view.ranks.items()) if start["node"] in held]
    if ranks:
        return ranks[target % len(ranks)]
    if not held:
        raise RuntimeError("no training node is left to lose")
    return {"node": sorted(held)[target % len(held)], "rank": None}


def _node(*, view: JobView, target: int, cluster: LocalCluster, **_: Any) -> dict:
    start = _node_to_lose(view, target, cluster)
    cluster.remove(start["node"])
    return {"t_kill": time.time(), "node": start["node"], "lost_node": start["node"],
            "what": f"node {start['node'][:8]} (rank {start['rank']}) removed"}


def _notice(*, view: JobView, target: int, cluster: LocalCluster, settings: KindSettings, emit: Emit,
            **_: Any) -> dict:
    start = _node_to_lose(view, target, cluster)
    deadline = time.time() + settings.notice_deadline_s
    cluster.drain(start["node"], deadline)
    emit("notice", node=start["node"], deadline=deadline,
         what=f"drain notice for node {start['node'][:8]} (rank {start['rank']}), "
              f"deadline in {settings.notice_deadline_s:.0f} s")
    time.sleep(max(0.0, deadline - time.time()) + 1.0)
    cluster.remove(start["node"])
    return {"t_kill": time.time(), "node": start["node"], "lost_node": start["node"],
            "what": f"node {start['node'][:8]} removed after its deadline"}


def _held(phase: str, *, kill_node_workers: bool) -> Callable[..., dict]:
    def act(*, view: JobView, settings: KindSettings, **_: Any) -> dict:
        holds.arm(settings.control_dir, phase, hold_s=settings.hold_s)
        deadline = time.monotonic() + settings.hold_wait_s
        marker = holds.inside(settings.control_dir, phase)
        while marker is None:
            if time.monotonic() > deadline:
                holds.disarm(settings.control_dir, phase)
                raise TimeoutError(f"no process reached the {phase} hold point within {settings.hold_wait_s:.0f} s")
            time.sleep(0.02)
            marker = holds.inside(settings.control_dir, phase)
        victims = [marker["pid"]]
        if kill_node_workers and marker.get("node"):
            victims += view.pids_on(marker["node"])
        for pid in victims:
            sigkill(pid)
        t_kill = time.time()
        holds.disarm(settings.control_dir, phase)
        where = f"step {marker['step']}" if "step" in marker else os.path.basename(os.path.dirname(marker["path"]))
        return {"t_kill": t_kill, "pid": marker["pid"], "node": marker.get("node"), "pids": victims,
                "what": f"SIGKILL inside the {phase} of {where} (pids {', '.join(map(str, victims))})"}

    return act


_ACTIONS: dict[str, Callable[..., dict]] = {
    "worker": _worker,
    "agent": _agent,
    "node": _node,
    "notice": _notice,
    "snapshot": _held("snapshot", kill_node_workers=False),
    "persist": _held("persist", kill_node_workers=True),
    "commit": _held("commit", kill_node_workers=True),
}
