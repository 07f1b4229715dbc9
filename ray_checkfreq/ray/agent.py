"""NodeAgent: one actor per node and run that owns the snapshot slots and persists them.

Training ranks on the node map the agent's slot files and copy their snapshot straight
into them; the agent encodes, writes and commits a COMPLETE slot in its own process, so
a persist that started finishes even if the rank that asked for it dies. Slot files are
named by run, node and agent incarnation, and removed by the agent that made them; files
of dead agents are swept by creator pid and start time (``slots.sweep_leftovers``).

Lifetime: an agent (detached) outlives worker-group restarts. ``CheckFreqCallback`` ends it
when ``fit()`` returns or fails; otherwise, as after ``ray job stop`` (no controller hook
runs), its lease is its time to live: once no rank renewed it for ``lease_s``, it removes
its slot files and exits, and until then a resubmitted run resumes from its slots.

Invariant: one persist in flight per agent; a persist writes under the writer generation
the request carries, so a persist of an older generation than the store's newest fails
(fenced) instead of overwriting a newer run's view.

Sharded runs (DTensor state): every rank on the node has slots of its own (``owner``: its
rank) and writes its own part to storage itself; the agent keeps the slots and sends a
sealed slot to another node's agent (``replicate``), which keeps the newest two copies of
each rank (``keep_peer_copy``) so that losing a node loses none of its ranks' snapshots.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import ray

from ray_checkfreq.engine.persist import PERSIST_NICE, lower_thread_priority
from ray_checkfreq.ray import slots
from ray_checkfreq.ray.names import NAMESPACE, SLOT_PREFIX, agent_name, agent_prefix
from ray_checkfreq.storage import CheckpointStore

logger = logging.getLogger("ray_checkfreq.ray")

PEER_COPIES_KEPT = 2  # per rank: the newest and the one before (a restart needs a step every rank has)
REPLICATE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class PeerCopy:
    """Another node's rank's sealed slot as it travels (``MappedSlot.regions``): its meta
    region, and its data region in an object of this agent's own (in Ray's object store when
    this agent is an actor, so that a read hands it out without copying it again)."""

    info: dict  # run, owner, world_size, step, generation, seq, data_crc32, from_node, leaf_crc32
    meta: bytes
    data: Any  # an ObjectRef this agent owns, or (in a process without Ray) a private array
    nbytes: int


class NodeAgent:
    """The actor class (wrapped with ``ray.remote`` by ``agent_actor``)."""

    def __init__(self, run: str, node_id: str, *, shm_dir: str = "/dev/shm", slot_count: int = 2,
                 lease_s: float | None = None) -> None:
        self.run = run
        self.node_id = node_id
        self.shm_dir = shm_dir
        self.slot_count = slot_count
        self.incarnation = random.getrandbits(31)
        self._lock = threading.Lock()  # guards the slot table
        self._persist_lock = threading.Lock()  # one persist in flight
        self._slots: dict[int | None, dict[str, slots.MappedSlot]] = {}  # owner (None: the replica) -> slots
        self._worlds: dict[int, int] = {}  # owner rank -> the world size it allocated for
        self._peers: dict[int, list[PeerCopy]] = {}  # owner rank -> its peer copies here, oldest first
        self._replicating: set[int] = set()  # owner ranks whose slot is on its way to a peer
        # Low-priority threads for peer copies: one sends, one receives (one for both would
        # deadlock two agents that send to each other at once).
        self._copier = _low_priority_thread("rcf-peer-send")
        self._receiver = _low_priority_thread("rcf-peer-receive")
        self._retired: dict[str, slots.MappedSlot] = {}  # outgrown; removed when no persist runs
        self._layout_version = 0
        self._stores: dict[tuple[str, int], CheckpointStore] = {}
        self._in_flight: int | None = None
        self._lease_s = lease_s
        self._renewed = time.monotonic()
        self._persists = 0
        swept = slots.sweep_leftovers(shm_dir, SLOT_PREFIX)
        if swept:
            logger.info("node agent %s: removed %d slot files of dead agents", node_id[:8], len(swept))
        if lease_s is not None:
            threading.Thread(target=self._watch_lease, name="rcf-lease", daemon=True).start()

    # ------------------------------------------------------------------ slots
    def info(self) -> dict:
        return {"node_id": self.node_id, "pid": os.getpid(), "incarnation": self.incarnation,
                "shm_free_bytes": slots.shm_free_bytes(self.shm_dir)}

    def allocate(self, data_bytes: int, meta_capacity: int, owner: int | None = None,
                 world_size: int | None = None) -> list[str]:
        """Paths of the slots of ``owner`` (a rank of a sharded run; None: the node's replica),
        with room for ``data_bytes``; new files only when needed.

        Old files are dropped (ranks that mapped them keep their mapping until they remap).
        """
        with self._lock:
            current = list(self._slots.get(owner, {}).values())
            if owner is not None and world_size is not None:
                self._worlds[owner] = world_size
            if current and all(s.header().data_capacity >= data_bytes and s.header().meta_capacity >= meta_capacity
                               for s in current):
                return [s.path for s in current]
            needed = self.slot_count * (data_bytes + meta_capacity + 4096)
            free = slots.shm_free_bytes(self.shm_dir) + sum(os.path.getsize(s.path) for s in current)
            if free < needed:
                raise slots.SlotError(self.shm_dir, f"{needed} bytes needed for {self.slot_count} slots, "
                                      f"{free} free")
            self._layout_version += 1
            fresh = {}
            mark = "" if owner is None else f"r{owner}-"
            for letter in "AB"[:self.slot_count]:
                path = os.path.join(self.shm_dir, f"{SLOT_PREFIX}{self.run}-{self.node_id[:12]}-"
                                    f"{self.incarnation:08x}-{self._layout_version}-{mark}{letter}")
                slots.create_slot_file(path, run=self.run, node=self.node_id, incarnation=self.incarnation,
                                       data_capacity=data_bytes, meta_capacity=meta_capacity)
                fresh[path] = slots.MappedSlot.open(path)
            # A slot may be in a persist right now: retired slots go once no persist runs.
            self._retired.update({slot.path: slot for slot in current})
            self._drop_retired()
            self._slots[owner] = fresh
            return list(fresh)

    def slot_headers(self) -> list[dict]:
        """Every slot's header (state, step, seq, generation, ...) plus its path, its owner
        (None: the node's replica) and, for a rank's slot, the world size it was made for."""
        with self._lock:
            return [{"path": path, "owner": owner, "world_size": self._worlds.get(owner) if owner is not None else None,
                     **asdict(slot.header())}
                    for owner, table in self._slots.items() for path, slot in table.items()]

    # ------------------------------------------------------------ peer copies
    def replicate(self, path: str, seq: int, owner: int, peer: Any) -> dict:
        """Send the sealed slot ``path`` (still holding ``seq``) of rank ``owner`` to the agent
        ``peer`` on another node; returns what was sent, or ``{"skipped": ...}`` while the
        previous copy of that rank is still on its way (one in flight per rank)."""
        with self._lock:
            if owner in self._replicating:
                return {"skipped": "a copy of this rank is still on its way"}
            self._replicating.add(owner)
        try:
            start = time.perf_counter()
            # In the agent's one low-priority copier thread: training keeps the cores first.
            return self._copier.submit(self._send_copy, path, seq, owner, peer, start).result()
        finally:
            with self._lock:
                self._replicating.discard(owner)

    def _send_copy(self, path: str, seq: int, owner: int, peer: Any, start: float) -> dict:
        """``replicate``'s work: the slot's regions as they are, the data region put into Ray's
        object store once (the one copy on this side), the rank's checksums with them (checked
        by the rank that restores from the copy), so the slot is not read twice here."""
        slot = self._slot(path)
        header, meta, data = slot.regions()
        if header.seq != seq:
            return {"skipped": f"the slot holds snapshot #{header.seq}, not #{seq}"}
        leaf_crcs = slots.decode_copy(meta, data, path)[1]  # from the meta region: no data leaf is read
        sent = ray.put(data)
        del data
        if slot.header() != header:  # its rank began the next snapshot in it while it was copied
            return {"skipped": f"the slot was rewritten while snapshot #{seq} was copied"}
        info = {"run": header.run, "owner": owner, "world_size": self._worlds.get(owner), "step": header.step,
                "generation": header.generation, "seq": header.seq, "data_crc32": header.data_crc32,
                "from_node": self.node_id}
        ray.get(peer.keep_peer_copy.remote({**info, "leaf_crc32": leaf_crcs}, meta, sent),
                timeout=REPLICATE_TIMEOUT_S)
        return {**info, "bytes": int(header.data_bytes + len(meta)), "seconds": time.perf_counter() - start}

    def keep_peer_copy(self, info: dict, meta: bytes, data: np.ndarray) -> None:
        """Keep a copy of another node's rank's slot: an object of this agent's own (the
        sender may die), the one copy on this side."""
        kept = PeerCopy(info=dict(info), meta=bytes(meta), data=self._receiver.submit(_own_copy, data).result(),
                        nbytes=int(data.nbytes))
        owner = int(info["owner"])
        with self._lock:
            copies = [c for c in self._peers.get(owner, []) if c.info["step"] != kept.info["step"]]
            self._peers[owner] = [*copies, kept][-PEER_COPIES_KEPT:]

    def peer_headers(self) -> list[dict]:
        """What each peer copy here is of (no bytes, no checksums)."""
        with self._lock:
            return [{k: v for k, v in copy.info.items() if k != "leaf_crc32"}
                    for copies in self._peers.values() for copy in copies]

    def read_peer(self, owner: int, step: int, generation: int) -> tuple[bytes, list, list]:
        """The peer copy of rank ``owner``'s snapshot of ``step`` (``generation``): its meta
        region, ``[data]`` (the data region's object, boxed so that Ray hands over the reference
        and the reader gets it without a copy here) and its leaves' crc32 as the rank computed
        them (``flatten_state`` order, None: no data leaf)."""
        with self._lock:
            for copy in self._peers.get(owner, []):
                if (copy.info["step"], copy.info["generation"]) == (step, generation):
                    return copy.meta, [copy.data], list(copy.info.get("leaf_crc32", []))
        raise slots.SlotError(f"<peer copy of rank {owner}>", f"the agent on node {self.node_id[:12]} holds no copy "
                                                               f"of step {step} (generation {generation})")

    # ---------------------------------------------------------------- persist
    def persist(self, path: str, seq: int, store: CheckpointStore, generation: int, *, codec: str | None = None,
                epoch_boundary: bool = False) -> dict:
        """Encode, write and commit the COMPLETE slot ``path`` (it must still hold ``seq``)."""
        with self._persist_lock:
            start = time.perf_counter()
            cpu_start = time.process_time()
            slot = self._slot(path)
            # The leaves' checksums were computed by the rank at the seal; the store keeps
            # them (not ones of the bytes as they are now), so the load checks the rank's.
            header, state, leaf_crcs = slot.read_with_checksums(verify_data=False)
            if header.seq != seq:
                raise slots.SlotError(path, f"holds snapshot #{header.seq}, the request was for #{seq}")
            self._in_flight = header.step
            try:
                writer = self._writer(store, generation)
                ref = writer.save(header.step, state, epoch_boundary=epoch_boundary, codec=codec,
                                  raw_crc32=leaf_crcs)
                if slot.header().seq != seq:  # the A/B rule makes this impossible; say so if it ever happens
                    logger.error("slot %s was rewritten while step %d was persisted from it", path, header.step)
            finally:
                self._in_flight = None
                del state
                with self._lock:
                    self._drop_retired()
            self._persists += 1
            seconds = time.perf_counter() - start
            return {"step": header.step, "seconds": seconds, "cpu_s": time.process_time() - cpu_start,
                    "stored_bytes": ref.size_bytes, "raw_bytes": header.data_bytes, "uri": ref.uri,
                    "codec": codec or writer.config.codec, "node_id": self.node_id}

    def read_packed(self, path: str, seq: int) -> Any:
        """The COMPLETE slot ``path`` (still holding ``seq``) packed for a rank on another node:
        a JSON layout and the bytes in one uint8 array (``transfer.unpack_state``), no pickle."""
        from ray_checkfreq.ray.transfer import pack_state

        header, state = self._slot(path).read()
        if header.seq != seq:
            raise slots.SlotError(path, f"holds snapshot #{header.seq}, the request was for #{seq}")
        try:
            return pack_state(state)
        finally:
            del state

    def release_stale(self, generation: int, owners_here: list[int]) -> dict:
        """Free the sharded RAM copies that no restart can choose any more, once
        ``generation`` has committed a step: a restart takes one (step, generation) from every
        rank, and nothing older than that commit. Removes the slots of ranks that are no
        longer on this node (all older than ``generation``; one being sent to a peer stays)
        and the peer copies of older generations. Returns {"slots", "peer_copies", "bytes"}."""
        released = {"slots": 0, "peer_copies": 0, "bytes": 0}
        with self._lock:
            for owner in [o for o in self._slots if o is not None and o not in owners_here]:
                table = self._slots[owner]
                if owner in self._replicating or any(s.header().generation >= generation for s in table.values()):
                    continue
                for slot in table.values():
                    released["bytes"] += os.path.getsize(slot.path)
                    self._remove(slot)
                released["slots"] += len(table)
                del self._slots[owner]
                self._worlds.pop(owner, None)
            for owner, copies in list(self._peers.items()):
                kept = [c for c in copies if int(c.info["generation"]) >= generation]
                stale = [c for c in copies if int(c.info["generation"]) < generation]
                released["peer_copies"] += len(stale)
                released["bytes"] += sum(c.nbytes + len(c.meta) for c in stale)
                if kept:
                    self._peers[owner] = kept
                else:
                    del self._peers[owner]
        return released

    def _drop_retired(self) -> None:
        """Remove outgrown slots unless a persist is reading one (caller holds ``_lock``)."""
        if self._in_flight is None:
            for slot in self._retired.values():
                self._remove(slot)
            self._retired = {}

    def _slot(self, path: str) -> slots.MappedSlot:
        with self._lock:
            slot = next((table[path] for table in self._slots.values() if path in table), None) \
                or self._retired.get(path)
        if slot is None:
            raise slots.SlotError(path, f"not a slot of the agent on node {self.node_id[:12]}")
        return slot

    def _writer(self, store: CheckpointStore, generation: int) -> CheckpointStore:
        """One store per (URI, generation): keeps its delta base from one persist to the next."""
        key = (store.uri, generation)
        writer = self._stores.get(key)
        if writer is None:
            writer = store.with_writer(generation)
            self._stores = {key: writer}
        return writer

    def in_flight(self) -> int | None:
        """The step being persisted, or None."""
        return self._in_flight

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no persist is in flight; False after ``timeout_s``."""
        acquired = self._persist_lock.acquire(timeout=timeout_s)
        if acquired:
            self._persist_lock.release()
        return acquired

    # ------------------------------------------------------------ lifetime
    def renew(self) -> None:
        self._renewed = time.monotonic()

    def _watch_lease(self) -> None:
        assert self._lease_s is not None
        while True:
            time.sleep(min(5.0, self._lease_s / 4))
            if time.monotonic() - self._renewed > self._lease_s and self._in_flight is None:
                logger.warning("node agent %s: no rank renewed its lease for %.0f s; exiting",
                               self.node_id[:8], self._lease_s)
                self._remove_all()
                os._exit(0)

    def shutdown(self) -> None:
        """Wait for the persist in flight (bounded), remove the slot files, and exit."""
        self.wait_idle(60.0)
        self._remove_all()
        ray.actor.exit_actor()

    def forget(self) -> None:
        """Start over without a new process: wait for the persist in flight (bounded), remove
        the slot files, and drop the cached writers and policy handle. ``bench ray`` runs
        its variants one after another in one run, each from nothing."""
        self.wait_idle(60.0)
        with self._persist_lock:
            self._remove_all()
            self._stores, self._policy = {}, None

    def _remove_all(self) -> None:
        with self._lock:
            for slot in [*(s for table in self._slots.values() for s in table.values()), *self._retired.values()]:
                self._remove(slot)
            self._slots, self._retired, self._peers = {}, {}, {}

    @staticmethod
    def _remove(slot: slots.MappedSlot) -> None:
        slot.close()
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass


def _own_copy(data: np.ndarray) -> Any:
    """An object of this process's own holding ``data``: put into Ray's object store by an
    actor (a read then hands it out without a copy), a private array in a process without Ray."""
    return ray.put(data) if ray.is_initialized() else np.array(data, copy=True)


def _low_priority_thread(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=lower_thread_priority,
                              initargs=(PERSIST_NICE,))


def agent_actor() -> Any:
    """The NodeAgent as a Ray actor class: no CPU, threaded so it answers while it persists."""
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 8, "max_restarts": 0}
    return ray.remote(**options)(NodeAgent)


def get_or_create_agent(run: str, node_id: str, *, lease_s: float | None, slot_count: int = 2) -> Any:
    """This run's agent on ``node_id``: the live one, or a new detached one pinned there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = agent_name(run, node_id)
    return agent_actor().options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(run, node_id, slot_count=slot_count, lease_s=lease_s)


def live_agents(run: str) -> dict[str, Any]:
    """{node id: handle} of this run's agents that the GCS still lists."""
    prefix = agent_prefix(run)
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(prefix):
            try:
                found[entry["name"][len(prefix):]] = ray.get_actor(entry["name"], namespace=NAMESPACE)
            except ValueError:  # died between the listing and the lookup
                continue
    return found


def started_agents(live: Mapping[str, Any]) -> dict[str, Any]:
    """The agents of ``live`` whose process has started. One still being created (the
    agent of a node that joined with this attempt, started without waiting) holds no slot
    and runs no persist: a restart has nothing to wait for or read there. The state comes
    from the GCS actor table (Ray's ``ray._private.state``, read in Ray 2.60's source); where
    that cannot be read, an agent counts as started."""
    from ray._private import state

    found = {}
    for node, handle in live.items():
        try:
            pending = state.actors(actor_id=handle._actor_id.hex()).get("State") in (
                "DEPENDENCIES_UNREADY", "PENDING_CREATION")
        except Exception:  # a private API: when it changes, wait on the agent as before
            pending = False
        if not pending:
            found[node] = handle
    return found


def shutdown_agents(run: str, timeout_s: float = 30.0) -> int:
    """Stop every agent of ``run`` (each removes its slot files); returns how many were found."""
    agents = live_agents(run)
    refs = {node: handle.shutdown.remote() for node, handle in agents.items()}
    for node, ref in refs.items():
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayActorError:
            pass  # exited, as asked
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            ray.kill(agents[node])
    return len(agents)
