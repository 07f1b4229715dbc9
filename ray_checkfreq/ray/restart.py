"""The restart protocol: where a restarted run resumes from, and how every rank gets there.

``RestartProtocol.decide`` (rank 0, then broadcast): find the run's live agents (those
whose process has started: a new node's, started without waiting, holds nothing); wait for
their in-flight persists (bounded); only then take a new writer generation; choose with
``choose_source`` (pure) over the newest commit and every agent's COMPLETE slots.
``RestartProtocol.apply`` (every rank): the rank on the chosen slot's node (rank 0 for
storage or a slot its agent sends) reads it and broadcasts it, falling back to storage
when it is unreadable; a slot newer than the newest commit is persisted under the new
generation; iterations lost to the previous attempt's preemption notice are counted once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import ray

from ray_checkfreq.engine.restore import exact_checkpoints
from ray_checkfreq.ray import agent as agents
from ray_checkfreq.ray import slots
from ray_checkfreq.ray.preemption import NOTICES_NAME, lost_after_notice, write_notice_record
from ray_checkfreq.ray.shard_copies import RankSource, choose_shard_sources, ram_headers, read_rank_source
from ray_checkfreq.ray.slots import SLOT_COMPLETE
from ray_checkfreq.ray.transfer import all_gather_json, broadcast_json, broadcast_state, unpack_state
from ray_checkfreq.storage import CheckpointRef, CheckpointStore

logger = logging.getLogger("ray_checkfreq.ray")


@dataclass(frozen=True, kw_only=True)
class RestoreChoice:
    """``kind``: "none" (start at 0), "storage" (the newest valid commit) or "slot"."""

    kind: str
    step: int | None = None
    node_id: str | None = None
    path: str | None = None
    seq: int | None = None
    needs_persist: bool = False  # a slot newer than the newest commit
    committed_step: int | None = None
    via_agent: bool = False  # no rank on the slot's node: its agent sends it through the object store
    # A sharded run's RAM copies: rank r reads ``sources[r]`` (shard_copies.RankSource as a dict).
    sources: list[dict] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("none", "storage", "slot"):
            raise ValueError(f"kind={self.kind!r}: expected 'none', 'storage' or 'slot'")


def choose_source(*, committed_step: int | None, slot_headers: Mapping[str, Sequence[Mapping[str, Any]]],
                  run: str, reachable_nodes: Collection[str], prefer_node: str | None = None) -> RestoreChoice:
    """The newest of the newest commit and every reachable COMPLETE slot of ``run``.

    A slot wins a tie with storage (RAM is faster). Slots of one step that disagree on
    their checksum across nodes are all ignored (a replica should be bit-identical).
    ``prefer_node`` breaks ties between nodes (rank 0's node: no broadcast hop), then nodes
    with a rank of this run (``reachable_nodes``); a slot on a node without one is sent
    by its agent (``via_agent``).
    """
    by_step: dict[int, list[tuple[str, Mapping[str, Any]]]] = {}
    for node, headers in slot_headers.items():
        for header in headers:
            if header.get("state") == SLOT_COMPLETE and header.get("run") == run and header.get("owner") is None:
                by_step.setdefault(int(header["step"]), []).append((node, header))
    for step in sorted(by_step, reverse=True):
        copies = by_step[step]
        if len({int(h["data_crc32"]) for _, h in copies}) > 1:
            logger.error("restore: the slots of step %d differ across nodes (%s); not using them", step,
                         ", ".join(node[:8] for node, _ in copies))
            continue
        if committed_step is not None and step < committed_step:
            break
        node, header = min(copies, key=lambda c: (c[0] != prefer_node, c[0] not in reachable_nodes, c[0]))
        return RestoreChoice(kind="slot", step=step, node_id=node, path=str(header["path"]), seq=int(header["seq"]),
                             needs_persist=committed_step is None or step > committed_step,
                             committed_step=committed_step, via_agent=node not in reachable_nodes)
    if committed_step is not None:
        return RestoreChoice(kind="storage", step=committed_step, committed_step=committed_step)
    return RestoreChoice(kind="none")


@dataclass(frozen=True)
class Decided:
    """What rank 0 decided, on every rank: the choice, the new writer generation, and the
    previous attempt's notice record (None: none was stored)."""

    choice: RestoreChoice
    generation: int
    notice_record: dict | None


@dataclass(frozen=True, kw_only=True)
class Restored:
    iteration: int
    info: dict  # kind, step, seconds, lost_after_notice, ...: what stats() reports as "restore"
    committed_step: int | None  # the newest commit after the restore (the restored step from storage)


@dataclass(kw_only=True)
class RestartProtocol:
    """The restart protocol of one rank; ``group`` is the run's control gloo group."""

    rank: int
    world_size: int
    run: str
    node_id: str
    nodes: list[str]  # rank r's node id
    store: CheckpointStore
    group: Any
    wait_s: float  # how long to wait for in-flight persists (RayConfig.restart_wait_s)
    warn_every_s: float
    restored_persist: Any = None  # rank 0: the agent's persist of a restored slot (not awaited)
    # A sharded (DTensor) state: every rank wrote its part of each step here (and may hold
    # its snapshots in slots of its own and peer copies: shard_copies.py).
    sharded: bool = False
    _unsettled_notice: tuple[dict, int] | None = None  # the notice this attempt counted, until its first commit

    def decide(self) -> Decided:
        """Rank 0 chooses, every rank gets its choice (a collective: a broadcast)."""
        mine = None
        if self.rank == 0:
            choice, generation = self._choose()
            mine = [asdict(choice), generation, self.store.read_metadata(NOTICES_NAME)]
        decided = broadcast_json(mine, src=0, rank=self.rank, group=self.group)
        return Decided(RestoreChoice(**decided[0]), int(decided[1]), decided[2])

    def apply(self, decided: Decided, engine: Any) -> Restored:
        """The chosen state into ``engine`` on every rank (collectives: the read's outcome and
        the state, broadcast from the reading rank); returns where the run resumes."""
        choice = decided.choice
        started = time.perf_counter()
        if choice.kind == "none":
            iteration = 0
            info: dict = {"kind": "none", "step": 0, "seconds": 0.0}
        else:
            if self.sharded:  # every rank reads its own pieces (collectives)
                iteration, kind = self._load_shards(choice, engine)
            else:
                state, fell_back = self._load(choice)
                iteration, kind = engine.apply_state(state), "storage" if fell_back else choice.kind
                del state
            info = {"kind": kind,  # what this rank read, not only what was chosen
                    "step": iteration, "node_id": choice.node_id, "committed_step": choice.committed_step,
                    "seconds": time.perf_counter() - started}
        info["lost_after_notice"] = self._count_notice_loss(decided.notice_record, iteration, decided.generation)
        if self.rank == 0 and choice.needs_persist and choice.kind == "slot":
            self._persist_restored_slot(choice, decided.generation)
        logger.info("rank %d restored iteration %d from %s", self.rank, iteration, choice.kind)
        committed = iteration if choice.kind == "storage" else choice.committed_step
        return Restored(iteration=iteration, info=info, committed_step=committed)

    def _choose(self) -> tuple[RestoreChoice, int]:
        if self.sharded:
            return self._choose_sharded()
        live = agents.started_agents(agents.live_agents(self.run))
        wait_for_persists(live, wait_s=self.wait_s, warn_every_s=self.warn_every_s)
        generation = self.store.acquire_writer()  # only now: a persist still running is fenced
        headers = slot_headers(live)
        newest = newest_exact(self.store)
        choice = choose_source(committed_step=newest.step if newest else None, slot_headers=headers, run=self.run,
                               reachable_nodes=set(self.nodes), prefer_node=self.node_id)
        return choice, generation

    def _choose_sharded(self) -> tuple[RestoreChoice, int]:
        """The newest step complete across all its parts (of either placement: a replicated
        one loads into the shards too), or newer in every rank's RAM copies
        (``shard_copies.choose_shard_sources``). The generation comes first: an old rank
        still writing is fenced from then on; then a step whose parts were all written but
        whose committer died is committed (salvage)."""
        generation = self.store.acquire_writer()
        salvaged = self.store.salvage()
        if salvaged is not None:
            logger.warning("restart: committed step %d, whose parts were all durable but not committed",
                           salvaged.step)
        newest = newest_exact(self.store)  # a replicated one loads too
        committed = newest.step if newest is not None else None
        slot_found, peer_found = ram_headers(agents.started_agents(agents.live_agents(self.run)))
        in_ram = choose_shard_sources(committed_step=committed, slot_headers=slot_found, peer_headers=peer_found,
                                      run=self.run, world_size=self.world_size, rank_nodes=self.nodes)
        if in_ram is not None:
            step, sources = in_ram
            return RestoreChoice(kind="slot", step=step, committed_step=committed,
                                 sources=[asdict(source) for source in sources]), generation
        if committed is None:
            return RestoreChoice(kind="none"), generation
        return RestoreChoice(kind="storage", step=committed, committed_step=committed), generation

    def _load_shards(self, choice: RestoreChoice, engine: Any) -> tuple[int, str]:
        """Every rank's pieces of the chosen step: from the RAM copies when every rank's is
        readable and fits, else every rank from storage, falling back together past a step
        some rank's part of is damaged; (iteration, what this rank read)."""
        if choice.kind == "slot" and choice.sources is not None:
            source = RankSource(**choice.sources[self.rank])
            state: Any = None
            try:
                state = read_rank_source(source, run=self.run, node_id=self.node_id)
                why = engine.rank_snapshot_mismatch(state)
            except (slots.SlotError, OSError) as err:
                why = str(err)
            reasons = all_gather_json(why, world_size=self.world_size, group=self.group)
            if not any(reasons):
                iteration = engine.load_rank_snapshot(state)
                if choice.committed_step is None or iteration > choice.committed_step:
                    engine.persist_rank_snapshot(state)  # storage gets it too: RAM may go next
                return iteration, source.kind
            unusable = {rank: reason for rank, reason in enumerate(reasons) if reason}
            logger.error("restore: the RAM copies of step %s are unusable (%s); every rank reads storage",
                         choice.step, "; ".join(f"rank {r}: {why}" for r, why in unusable.items()))
            del state
            if choice.committed_step is None:
                return 0, "none"
            return engine.load_sharded(choice.committed_step, fall_back=True), "storage"
        # The chosen step, or (a rank's part damaged) the newest older one every rank reads.
        return engine.load_sharded(choice.step, fall_back=True), "storage"

    def _load(self, choice: RestoreChoice) -> tuple[Any, bool]:
        """The chosen state on every rank, read by one rank and broadcast; True: it fell back to storage."""
        on_a_rank = choice.kind == "slot" and not choice.via_agent and choice.node_id is not None
        source = self.nodes.index(str(choice.node_id)) if on_a_rank else 0
        state: Any = None
        ok = True
        if self.rank == source:
            try:
                state = read_source(choice, store=self.store, run=self.run)
            except (slots.SlotError, OSError) as err:
                logger.error("restore: slot %s unreadable (%s); falling back to storage", choice.path, err)
                ok = False
        fell_back = False
        if not broadcast_json(ok, src=source, rank=self.rank, group=self.group):
            source, state = 0, (self.store.load() if self.rank == 0 else None)
            fell_back = True
        return broadcast_state(state, src=source, rank=self.rank, world_size=self.world_size,
                               group=self.group), fell_back

    def _persist_restored_slot(self, choice: RestoreChoice, generation: int) -> None:
        holder = agents.live_agents(self.run).get(choice.node_id or "")
        if holder is None:
            logger.warning("restore: the agent holding step %s is gone; it stays uncommitted", choice.step)
            return
        # Not awaited: the agent commits it in the background; the next persist waits behind it.
        self.restored_persist = holder.persist.remote(choice.path, choice.seq, self.store, generation)

    def _count_notice_loss(self, record: dict | None, restored: int, generation: int) -> int | None:
        """Iterations lost to the previous attempt's notice (None: it stopped for another
        reason). The record is settled only at this attempt's first commit (``settle_notice``):
        an attempt that ends before it (resized, or its start failed) leaves the notice for
        the next restart to count again."""
        lost = lost_after_notice(record, restored=restored, generation=generation)
        if lost is None or record is None:
            return None
        if record.get("stopped_at") is None and self.rank == 0:
            logger.warning("the previous attempt was stopped before its stop checkpoint (iteration %s) was "
                           "confirmed durable: up to %d iterations are trained again", record.get("stop_at"), lost)
        self._unsettled_notice = (record, generation)
        return lost

    def settle_notice(self) -> None:
        """Rank 0, at this attempt's first commit: a later restart resumes from this attempt's
        progress, so it does not count the previous attempt's notice again."""
        if self.rank != 0 or self._unsettled_notice is None:
            return
        (record, generation), self._unsettled_notice = self._unsettled_notice, None
        write_notice_record(self.store, {**record, "settled_by": generation})


def wait_for_persists(live: Mapping[str, Any], *, wait_s: float, warn_every_s: float) -> None:
    """Bounded wait for the agents' in-flight persists, with a warning naming the setting."""
    deadline = time.monotonic() + wait_s
    pending = dict(live)
    while pending and time.monotonic() < deadline:
        step_s = min(warn_every_s, max(0.0, deadline - time.monotonic()))
        refs = {node: handle.wait_idle.remote(step_s) for node, handle in pending.items()}
        for node, ref in refs.items():
            try:
                if ray.get(ref, timeout=step_s + 10):
                    pending.pop(node)
            except ray.exceptions.GetTimeoutError:
                pass  # alive but slow to answer: still pending until the deadline
            except ray.exceptions.RayError:
                pending.pop(node)  # that agent is gone: nothing of it to wait for
        if pending:
            logger.warning("restart: still waiting for the persist in flight on %d node agent(s); "
                           "giving up after RayConfig(restart_wait_s=%.0f)", len(pending), wait_s)


def slot_headers(live: Mapping[str, Any]) -> dict[str, list]:
    """{node id: its agent's slot headers} of the agents that answer."""
    refs = {node: handle.slot_headers.remote() for node, handle in live.items()}
    headers = {}
    for node, ref in refs.items():
        try:
            headers[node] = ray.get(ref, timeout=30)
        except ray.exceptions.RayError as err:
            logger.warning("restart: node agent %s did not answer (%s)", node[:8], err)
    return headers


def newest_exact(store: CheckpointStore) -> CheckpointRef | None:
    """The newest complete exact checkpoint of either placement, from the listings and
    manifests only: its data is read (and checked, falling back past a corrupt one) only
    when storage is the source."""
    exact = exact_checkpoints(store)
    return exact[-1] if exact else None


def read_source(choice: RestoreChoice, *, store: CheckpointStore, run: str) -> dict:
    """The chosen state, read on this rank (a slot of its node, or sent by the slot's agent)."""
    if choice.kind == "storage":
        return store.load()
    assert choice.path is not None and choice.seq is not None
    if choice.via_agent:
        holder = agents.live_agents(run).get(choice.node_id or "")
        if holder is None:
            raise slots.SlotError(choice.path, "its node agent is gone")
        try:
            return unpack_state(ray.get(holder.read_packed.remote(choice.path, choice.seq), timeout=120))
        except ray.exceptions.RayError as err:
            raise slots.SlotError(choice.path, f"its node agent could not send it: {err}") from err
    slot = slots.MappedSlot.open(choice.path)
    header, state = slot.read(copy=True)
    slot.close()
    if header.seq != choice.seq:
        raise slots.SlotError(choice.path, f"changed since it was chosen (#{choice.seq} -> #{header.seq})")
    return state
