"""The other-node half of ``bench restore``: two raylets, one actor on each, a gloo group between them.

Node A's actor holds the slot; node B's actor restores it, timing from its request to a
loaded model: over the process group (``ray_checkfreq.ray.transfer.broadcast_state``, what
a restart uses) and through the object store (``ray.put`` of numpy views on A, ``ray.get``
on B). Each node's object store holds at least 3x the state.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import numpy as np
import ray
import torch

from benchmarks import restore_state
from benchmarks.harness import free_port

MiB = 1024 * 1024


class SlotActor:
    """Rank 0 (``holds_slot``) serves its slot; rank 1 restores from it and checks the result."""

    def __init__(self, state_mb: int, slot_path: str | None) -> None:
        torch.set_num_threads(1)  # as in the driver (see bench.restore)
        self.state_mb = state_mb
        self.slot = None
        self.target: restore_state.Target | None = None
        self.reference: dict[str, Any] | None = None
        self.group: Any = None
        if slot_path is not None:
            self.slot = restore_state.write_slot(slot_path, restore_state.reference_state(state_mb))
        else:
            self.target = restore_state.Target(state_mb)
            self.reference = restore_state.reference_state(state_mb)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def join_group(self, port: int, rank: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        self.group = dist.group.WORLD

    # -- node A -------------------------------------------------------------------------
    def send_broadcast(self) -> None:
        from ray_checkfreq.ray.transfer import broadcast_state

        assert self.slot is not None
        _, state = self.slot.read()
        broadcast_state(state, src=0, rank=0, world_size=2, group=self.group)
        del state  # views of the mapping

    def put_state(self) -> list[ray.ObjectRef]:
        assert self.slot is not None
        _, state = self.slot.read()
        return [ray.put(_numpy_views(state))]

    # -- node B -------------------------------------------------------------------------
    def restore_by_broadcast(self, peer: Any) -> float:
        from ray_checkfreq.ray.transfer import broadcast_state

        assert self.target is not None
        start = time.perf_counter()
        sent = peer.send_broadcast.remote()
        self.target.load(broadcast_state(None, src=0, rank=1, world_size=2, group=self.group))
        seconds = time.perf_counter() - start
        ray.get(sent)
        return seconds

    def restore_by_object_store(self, peer: Any) -> float:
        assert self.target is not None
        start = time.perf_counter()
        [ref] = ray.get(peer.put_state.remote())
        state = ray.get(ref)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch on read-only object-store arrays
            self.target.load(_tensor_views(state))
        seconds = time.perf_counter() - start
        del state, ref
        return seconds

    def scramble(self) -> None:
        assert self.target is not None
        self.target.scramble()

    def restored_equals_original(self) -> bool:
        assert self.target is not None and self.reference is not None
        return self.target.equals(self.reference)

    def close(self) -> None:
        import torch.distributed as dist

        if self.group is not None:
            dist.destroy_process_group()
            self.group = None
        if self.slot is not None:
            path = self.slot.path
            self.slot.close()
            self.slot = None
            os.unlink(path)


def _numpy_views(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.numpy()
    if isinstance(state, dict):
        return {k: _numpy_views(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_numpy_views(v) for v in state]
    return state


def _tensor_views(state: Any) -> Any:
    if isinstance(state, np.ndarray):
        return torch.from_numpy(state)
    if isinstance(state, dict):
        return {k: _tensor_views(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_tensor_views(v) for v in state]
    return state


class OtherNode:
    """A 2-node ``cluster_utils.Cluster`` in this process, a slot on node A, a restorer on node B."""

    def __init__(self, state_mb: int, state_nbytes: int, slot_path: str) -> None:
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            raise RuntimeError("bench restore starts its own Ray cluster: run it in a process without Ray "
                               "(the CLI `ray-checkfreq bench restore` does)")
        store_bytes = max(3 * state_nbytes, 128 * MiB)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": store_bytes, "include_dashboard": False})
        self.node_b = self.cluster.add_node(num_cpus=1, object_store_memory=store_bytes)
        ray.init(address=self.cluster.address, log_to_driver=False, configure_logging=False)
        head = self.cluster.head_node
        assert head is not None
        self.holder: Any = self._actor(head.node_id, state_mb, slot_path)
        self.restorer: Any = self._actor(self.node_b.node_id, state_mb, None)
        nodes = ray.get([self.holder.node_id.remote(), self.restorer.node_id.remote()])
        if nodes[0] == nodes[1]:
            raise RuntimeError(f"both actors landed on node {nodes[0]}")
        port = free_port()
        ray.get([self.holder.join_group.remote(port, 0), self.restorer.join_group.remote(port, 1)])

    @staticmethod
    def _actor(node_id: str, state_mb: int, slot_path: str | None) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = dict(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}},
        )
        return ray.remote(SlotActor).options(**options).remote(state_mb, slot_path)

    def by_broadcast(self) -> float:
        return self._restore(self.restorer.restore_by_broadcast)

    def by_object_store(self) -> float:
        return self._restore(self.restorer.restore_by_object_store)

    def _restore(self, method: Any) -> float:
        ray.get(self.restorer.scramble.remote())
        seconds: Any = ray.get(method.remote(self.holder))
        return float(seconds)

    def restored_equals_original(self) -> bool:
        same: Any = ray.get(self.restorer.restored_equals_original.remote())
        return bool(same)

    def close(self) -> None:
        try:
            ray.get([self.holder.close.remote(), self.restorer.close.remote()], timeout=60)
        finally:
            ray.shutdown()
            self.cluster.shutdown()
