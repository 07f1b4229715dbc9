"""RAM copies of a sharded run's snapshots: each rank's own slots, a peer copy on another
node, and the restart's choice over them.

Every rank of a sharded run snapshots into slots of its own in its node's agent
(``SlotMemory(owner=rank)``). Its persist thread seals the slot (``ShardSealer``: the
state plus its sharding record, COMPLETE last) before it writes its part to storage, then
asks its agent to send the sealed slot to the agent of the next node in the ring of the
run's nodes (``peer_node``). At most one copy per rank is on its way: a snapshot sealed
while the previous copy still travels goes without one (counted as skipped).

At a restart at the same world size, ``choose_shard_sources`` (pure) takes the newest step
at least as new as the newest commit that every rank has in RAM, as a slot or a peer copy
of one writer generation; each rank reads its own source (``read_rank_source``): a slot
on its node directly, another node's slot or a peer copy through that node's agent.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from ray_checkfreq.engine.sharded_restore import SHARDING_KEY, sharding_record
from ray_checkfreq.engine.snapshot import Snapshot
from ray_checkfreq.ray import agent as agents
from ray_checkfreq.ray import slots
from ray_checkfreq.ray.slots import SlotError
from ray_checkfreq.ray.transfer import unpack_state
from ray_checkfreq.storage.arrays import leaf_bytes
from ray_checkfreq.storage.checksum import crc32
from ray_checkfreq.storage.tree import flatten_state

logger = logging.getLogger("ray_checkfreq.ray")

SOURCE_KINDS = ("slot", "peer")
READ_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class RankSource:
    """Where rank ``owner``'s snapshot of ``step`` is kept in RAM: a ``slot`` of its own
    (``path``, ``seq``) or a ``peer`` copy, in the agent of ``node_id``."""

    kind: str
    node_id: str
    owner: int
    step: int
    generation: int
    path: str | None = None
    seq: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"kind={self.kind!r}: expected one of {SOURCE_KINDS}")
        if self.kind == "slot" and (self.path is None or self.seq is None):
            raise ValueError("a slot source needs its path and seq")


def peer_node(nodes: Sequence[str], node_id: str) -> str | None:
    """The node whose agent keeps this node's peer copies: the next in the ring of the run's
    nodes (in order of their first rank); None on a run of one node."""
    ring = list(dict.fromkeys(nodes))
    if len(ring) < 2 or node_id not in ring:
        return None
    return ring[(ring.index(node_id) + 1) % len(ring)]


def choose_shard_sources(*, committed_step: int | None, slot_headers: Mapping[str, Sequence[Mapping[str, Any]]],
                         peer_headers: Mapping[str, Sequence[Mapping[str, Any]]], run: str, world_size: int,
                         rank_nodes: Sequence[str]) -> tuple[int, list[RankSource]] | None:
    """The newest step every rank of ``world_size`` holds in RAM (one generation, saved at
    this world size) and at least as new as ``committed_step`` (RAM wins a tie), with one
    source per rank: on the rank's node before elsewhere, a slot before a peer copy."""
    found: dict[tuple[int, int], dict[int, list[RankSource]]] = {}
    for source in _sources(slot_headers, peer_headers, run=run, world_size=world_size):
        found.setdefault((source.step, source.generation), {}).setdefault(source.owner, []).append(source)
    for step, generation in sorted(found, reverse=True):
        if committed_step is not None and step < committed_step:
            break
        held = found[(step, generation)]
        if all(rank in held for rank in range(world_size)):
            return step, [_nearest(held[rank], rank_nodes[rank]) for rank in range(world_size)]
    return None


def _nearest(sources: list[RankSource], node_id: str) -> RankSource:
    """On the rank's node before elsewhere, then a slot (read in place) before a peer copy."""
    return min(sources, key=lambda s: (s.node_id != node_id, s.kind != "slot", s.node_id))


def _sources(slot_headers: Mapping[str, Sequence[Mapping[str, Any]]],
             peer_headers: Mapping[str, Sequence[Mapping[str, Any]]], *, run: str,
             world_size: int) -> list[RankSource]:
    sources = []
    for node, headers in slot_headers.items():
        for header in headers:
            if header.get("owner") is not None and header.get("state") == slots.SLOT_COMPLETE \
                    and header.get("run") == run and header.get("world_size") == world_size:
                sources.append(RankSource(kind="slot", node_id=node, owner=int(header["owner"]),
                                          step=int(header["step"]), generation=int(header["generation"]),
                                          path=str(header["path"]), seq=int(header["seq"])))
    for node, copies in peer_headers.items():
        for info in copies:
            if info.get("run") == run and info.get("world_size") == world_size:
                sources.append(RankSource(kind="peer", node_id=node, owner=int(info["owner"]), step=int(info["step"]),
                                          generation=int(info["generation"])))
    return sources


def ram_headers(live: Mapping[str, Any]) -> tuple[dict[str, list], dict[str, list]]:
    """({node: slot headers}, {node: peer copy headers}) of the agents that answer."""
    refs = {node: (handle.slot_headers.remote(), handle.peer_headers.remote()) for node, handle in live.items()}
    slot_found, peer_found = {}, {}
    for node, (slot_ref, peer_ref) in refs.items():
        try:
            slot_found[node], peer_found[node] = ray.get([slot_ref, peer_ref], timeout=30)
        except ray.exceptions.RayError as err:
            logger.warning("restart: node agent %s did not answer (%s)", node[:8], err)
    return slot_found, peer_found


def release_stale_copies(live: Mapping[str, Any], *, generation: int, rank_nodes: Sequence[str]) -> dict:
    """Once ``generation`` has committed a step: every live agent frees the slots of ranks
    that left its node and the peer copies of older generations (``NodeAgent.release_stale``).
    Without this, each restart that moves ranks leaves their slots behind until the agent's
    lease ends, up to twice the whole state per node over a few restarts. Totals released."""
    owners: dict[str, list[int]] = {node: [] for node in live}
    for rank, node in enumerate(rank_nodes):
        owners.setdefault(node, []).append(rank)
    refs = {node: handle.release_stale.remote(generation, owners[node]) for node, handle in live.items()}
    total = {"slots": 0, "peer_copies": 0, "bytes": 0}
    for node, ref in refs.items():
        try:
            released = ray.get(ref, timeout=30)
        except ray.exceptions.RayError as err:
            logger.warning("node agent %s did not release its stale RAM copies (%s)", node[:8], err)
            continue
        for key in total:
            total[key] += int(released[key])
    return total


def read_rank_source(source: RankSource, *, run: str, node_id: str) -> dict:
    """The snapshot ``source`` holds, read on this rank; SlotError when it cannot be read."""
    if source.kind == "slot" and source.node_id == node_id:
        assert source.path is not None
        slot = slots.MappedSlot.open(source.path)
        try:
            header, state = slot.read(copy=True)
        finally:
            slot.close()
        if header.seq != source.seq:
            raise slots.SlotError(source.path, f"changed since it was chosen (#{source.seq} -> #{header.seq})")
        return state
    where = source.path or f"<peer copy of rank {source.owner} on node {source.node_id[:12]}>"
    holder = agents.live_agents(run).get(source.node_id)
    if holder is None:
        raise slots.SlotError(where, "its node agent is gone")
    try:
        if source.kind == "slot":
            return unpack_state(ray.get(holder.read_packed.remote(source.path, source.seq), timeout=READ_TIMEOUT_S))
        meta, boxed, leaf_crcs = ray.get(holder.read_peer.remote(source.owner, source.step, source.generation),
                                         timeout=READ_TIMEOUT_S)
        data = ray.get(boxed[0], timeout=READ_TIMEOUT_S) if isinstance(boxed[0], ray.ObjectRef) else boxed[0]
    except ray.exceptions.RayError as err:
        raise slots.SlotError(where, f"its node agent could not send it: {err}") from err
    # Ray hands out a read-only view of its object store: the load copies the tensors out of
    # it and never writes into them, so torch's warning about such tensors does not apply.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not writable", category=UserWarning)
        state = slots.decode_copy(meta, data, where)[0]
    return verified(state, leaf_crcs, where)


def verified(state: Any, leaf_crcs: Sequence[int | None], where: str) -> Any:
    """``state`` if its leaves match the checksums its rank computed at the seal
    (``flatten_state`` order; None: a leaf the slot's meta region checked); SlotError otherwise."""
    leaves = flatten_state(state).leaves
    if len(leaf_crcs) != len(leaves):
        raise SlotError(where, f"{len(leaf_crcs)} checksums for {len(leaves)} leaves")
    for index, (leaf, expected) in enumerate(zip(leaves, leaf_crcs)):
        if expected is not None and crc32(leaf_bytes(leaf)) != expected:
            raise SlotError(where, f"data crc32 mismatch in leaf #{index}: the copy is corrupt")
    return state


class ShardSealer:
    """The engine's ``seal_snapshot`` for a sharded rank with slots: seal the slot, then
    start its peer copy (never waits for one)."""

    def __init__(self, *, rank: int, world_size: int, agent: Callable[[], Any],
                 peer: Callable[[bool], Any | None]) -> None:
        self.rank = rank
        self.world_size = world_size
        self._agent = agent
        self._peer = peer  # peer(refresh): the peer node's agent (refresh: look it up again), None: no peer
        self._lock = threading.Lock()  # the persist thread sends, the training thread reads stats
        self._pending: Any = None
        self._peer_failed = False
        self.counts = {"sent": 0, "skipped": 0, "failed": 0}
        self.last_copy_s: float | None = None

    def __call__(self, snapshot: Snapshot) -> None:
        slot = snapshot.memory
        if not isinstance(slot, slots.MappedSlot) or snapshot.places is None:
            return
        record = sharding_record(snapshot.places, rank=self.rank, world_size=self.world_size,
                                 epoch_boundary=snapshot.epoch_boundary)
        header = slot.finish_write({**snapshot.state, SHARDING_KEY: record})
        with self._lock:
            self._send(slot.path, header.seq)

    def _send(self, path: str, seq: int) -> None:
        if not self._settle():
            self.counts["skipped"] += 1
            return
        peer = self._peer(self._peer_failed)
        self._peer_failed = False
        if peer is not None:
            self._pending = self._agent().replicate.remote(path, seq, self.rank, peer)

    def _settle(self) -> bool:
        """Collect the copy on its way if it arrived; False while it is still travelling."""
        if self._pending is None:
            return True
        if not ray.wait([self._pending], timeout=0)[0]:
            return False
        ref, self._pending = self._pending, None
        try:
            done = ray.get(ref, timeout=0)
        except ray.exceptions.RayError as err:
            self.counts["failed"] += 1
            self._peer_failed = True
            logger.warning("rank %d: the peer copy of a snapshot failed (%s)", self.rank, err)
            return True
        if "skipped" in done:
            self.counts["skipped"] += 1
        else:
            self.counts["sent"] += 1
            self.last_copy_s = float(done["seconds"])
        return True

    def stats(self) -> dict:
        """Peer copies sent, skipped and failed so far, and the last one's seconds."""
        with self._lock:
            self._settle()
            return {**self.counts, "in_flight": self._pending is not None, "last_copy_s": self.last_copy_s}
