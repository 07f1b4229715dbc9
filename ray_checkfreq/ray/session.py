"""``ray_checkfreq.ray.CheckFreq``: the engine inside a Ray Train training function.

    cf = CheckFreq(model=model, optimizer=optimizer, data=batches)
    start = cf.restore()
    for it in range(start, total):
        ...; loss.backward(); optimizer.step()
        cf.step()
    cf.close()

Rank, world size and storage come from the Ray Train context. Rank 0 plans every
checkpoint and every rank applies the same decision one iteration later. The first rank
on each node copies its replica of the state into its node's agent (one copy); rank 0's
agent persists it. ``restore()`` runs the restart protocol of ``restart.py``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

import numpy as np
import ray
import torch
import torch.distributed as dist

from ray_checkfreq.engine import CheckFreq as Engine
from ray_checkfreq.engine import CheckFreqConfig
from ray_checkfreq.engine.persist import PersistWorker
from ray_checkfreq.engine.seams import EngineSeams, local_rng_state, set_local_rng_state
from ray_checkfreq.ray import agent as agents
from ray_checkfreq.ray import slots
from ray_checkfreq.ray.decisions import BroadcastDecisions
from ray_checkfreq.ray.memory import SlotMemory, SlotPersister
from ray_checkfreq.ray.metrics import CheckFreqMetrics
from ray_checkfreq.ray.names import run_key
from ray_checkfreq.ray.policy_actor import PolicyLink
from ray_checkfreq.ray.preemption import DrainWatcher, Notice, lost_after_notice, notice_record, stop_iteration
from ray_checkfreq.ray.registration import PointedSteps, Registrar, RegistrationConfig
from ray_checkfreq.ray.restart import RestoreChoice, choose_source
from ray_checkfreq.ray.transfer import (
    all_gather_json,
    all_gather_state,
    broadcast_json,
    broadcast_state,
    unpack_state,
)
from ray_checkfreq.storage import CheckpointStore

logger = logging.getLogger("ray_checkfreq.ray")

NOTICES_NAME = "checkfreq-notices.json"


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """How the Ray layer behaves; units in the names.

    ``restart_wait_s``: how long a restart waits for the agents' in-flight persists
    before it takes over (a persist still running then is fenced, never lost: its slot
    is restored and persisted again). ``agent_lease_s``: an agent that no rank renewed
    for this long removes its slots and exits (runs without ``CheckFreqCallback``).
    ``slots``: 2 (A/B: a new snapshot never overwrites the newest complete one) or 1
    (half the RAM; a crash mid-copy then leaves only storage to restore from).
    ``registration``: when pointer checkpoints are reported to Ray Train (None: never).
    ``metrics_every_s``: how often rank 0 records its figures as Ray metrics (None: never).
    ``shared_policy``: k adapts in the run's ``PolicyActor`` from every rank's iterations
    and every agent's persists (False: from rank 0's own measurements only).
    ``replicas``: the first rank on every node keeps a RAM copy in its node's agent (True),
    or only rank 0's node does (False: less memory traffic per checkpoint, but losing rank
    0's node falls back to storage, and a notice on it cannot hand the persist to another
    node).
    """

    restart_wait_s: float = 120.0
    """Seconds a restart waits for the node agents' persists in flight."""
    restart_warn_every_s: float = 15.0
    """Seconds between warnings while it waits."""
    agent_lease_s: float = 600.0
    """Seconds after which an agent (or the policy actor) nobody renewed exits (runs without
    ``CheckFreqCallback``)."""
    slots: int = 2
    """Shared-memory slots per node agent: 2 (A/B) or 1 (half the RAM)."""
    shm_dir: str = "/dev/shm"
    """Where the slot files live."""
    use_agents: bool = True
    """False: no node agents, rank 0 persists in its own process."""
    watch_preemption: bool = True
    """Act on drain notices (checkpoint and stop before the deadline)."""
    drain_poll_s: float = 0.5
    """Seconds between polls of the nodes' drain state."""
    replica_wait_s: float = 30.0
    """Seconds a draining rank 0 waits for another node's replica to be sealed."""
    registration: RegistrationConfig | None = field(default_factory=RegistrationConfig)
    """When pointer checkpoints are reported to Ray Train (None: never)."""
    metrics_every_s: float | None = 5.0
    """Seconds between records of the Ray metrics (None: never)."""
    shared_policy: bool = True
    """k adapts in the run's policy actor (False: on rank 0 alone)."""
    replicas: bool = True
    """A RAM copy on every node (False: on rank 0's node only)."""

    def __post_init__(self) -> None:
        for name in ("restart_wait_s", "restart_warn_every_s", "agent_lease_s", "drain_poll_s", "replica_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be > 0 seconds")
        if self.slots not in (1, 2):
            raise ValueError(f"slots={self.slots!r}: must be 1 or 2")


class CheckFreq:
    """CheckFreq checkpoints for a Ray Train worker: same interface as the engine's."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Any = None,
        extra_state: Mapping[str, Any] | None = None,
        storage: str | CheckpointStore | None = None,
        seed: int = 0,
        ray_config: RayConfig | None = None,
        **engine_options: Any,
    ) -> None:
        from ray_checkfreq.data import refuse_distributed_sampler

        refuse_distributed_sampler(data, "data")
        self.ray_config = ray_config or RayConfig()
        context = _train_context()
        self.rank = int(context.get_world_rank())
        self.world_size = int(context.get_world_size())
        self.seed = seed
        self.run = run_key(context.get_experiment_name())
        self.store = _store_for(storage, context)
        self._group = _new_gloo_group(self.world_size)
        self._control_group = _new_gloo_group(self.world_size)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.nodes = all_gather_json(self.node_id, world_size=self.world_size, group=self._control_group)
        first_on_node = self.nodes.index(self.node_id) == self.rank
        self.snapshots = first_on_node and (self.ray_config.replicas or self.rank == 0)
        self.generation: int | None = None
        self.agent = self._agent(model, optimizer) if self.snapshots else None
        self.restore_info: dict | None = None
        self._fell_back = False
        self._renewed = time.monotonic()
        self._memory = SlotMemory(self.agent, generation=self._current_generation) if self.agent else None
        self._decisions = BroadcastDecisions(self._group, self.rank)
        self._watcher = (DrainWatcher(set(self.nodes), poll_s=self.ray_config.drain_poll_s)
                         if self.rank == 0 and self.ray_config.watch_preemption else None)
        self.notices: list[dict] = []
        self._last_step_s: float | None = None
        self._iter_s = 0.0
        self.metrics = self._new_metrics()
        self._registrar = self._new_registrar(storage, context, _overhead_of(engine_options))
        self._policy = (PolicyLink(self.run, rank=self.rank, lease_s=self.ray_config.agent_lease_s)
                        if self.ray_config.shared_policy and _adapts(engine_options) else None)
        self._policy_version = -1
        self.policy_decisions: list[dict] = []  # rank 0: each new decision of the policy actor
        seams = EngineSeams(
            decisions=self._decisions,
            persister=self._persister,
            host_memory=self._memory,
            rng_state=self._gather_rng,
            set_rng_state=self._set_own_rng,
            # Without agents (no room in /dev/shm) there is no replica to keep: rank 0 alone snapshots.
            takes_snapshots=self.snapshots and (self.agent is not None or self.rank == 0),
            observe=self._policy.observe if self._policy is not None else None,
            local_adaptive=self._policy is None,
        )
        self.engine = Engine(model=unwrap_model(model), optimizer=optimizer, storage=self.store, data=data,
                             extra_state=extra_state, seams=seams, **engine_options)

    # ------------------------------------------------------------------ set-up
    def _agent(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        if not self.ray_config.use_agents:
            return None
        free = slots.shm_free_bytes(self.ray_config.shm_dir)
        needed = self.ray_config.slots * _state_bytes_guess(model, optimizer)
        if free < needed:
            logger.warning("%s has %d MiB free, the snapshot slots need about %d MiB: persisting in the training "
                           "process instead (raise the shared-memory size, e.g. docker --shm-size)",
                           self.ray_config.shm_dir, free >> 20, needed >> 20)
            return None
        handle = agents.get_or_create_agent(self.run, self.node_id, lease_s=self.ray_config.agent_lease_s,
                                            slot_count=self.ray_config.slots)
        ray.get(handle.renew.remote())
        return handle

    def _new_metrics(self) -> CheckFreqMetrics | None:
        every_s = self.ray_config.metrics_every_s
        if self.rank != 0 or every_s is None:
            return None
        return CheckFreqMetrics(run=self.run, rank=self.rank, node_id=self.node_id, every_s=every_s)

    def _new_registrar(self, storage: Any, context: Any, overhead: float) -> Registrar | None:
        config = self.ray_config.registration
        if config is None:
            return None
        run_storage = context.get_storage()
        if self.store.protected_steps is None:
            self.store.protected_steps = PointedSteps(run_storage.storage_filesystem, run_storage.experiment_fs_path,
                                                      self.store.uri)
        return Registrar(rank=self.rank, group=self._control_group, store=self.store, storage=run_storage,
                         run_filesystem=storage is None, overhead=overhead, config=config,
                         metrics=lambda: _report_metrics(self.engine.stats()),
                         on_registered=self.metrics.record_registration if self.metrics is not None else None)

    def _persisted(self, result: Any) -> None:
        """Rank 0: a persist committed (from the persist thread)."""
        if self._registrar is not None:
            self._registrar.committed(result.step)
        if self.metrics is not None:
            self.metrics.record_persist(result.seconds, result.stored_bytes)

    def _persister(self, store: CheckpointStore, on_done: Any) -> Any:
        on_done = _also(self._persisted, on_done)
        if self.agent is None:  # rank 0 without agents: persist in this process
            return PersistWorker(store, on_done=on_done)
        return SlotPersister(store, on_done, agent=self.agent, persists=self.rank == 0,
                             generation=self._current_generation, on_agent_lost=self._replace_agent,
                             route=self._persist_route, replica_wait_s=self.ray_config.replica_wait_s,
                             on_agent_report=self._policy.persisted if self._policy is not None else None)

    def _persist_route(self) -> Any:
        """Another node's agent to persist from when this node is draining, else None (own)."""
        if self._watcher is None or self.node_id not in self._watcher.draining():
            return None
        draining = self._watcher.draining()
        live = agents.live_agents(self.run)
        for node in dict.fromkeys(self.nodes):
            if node not in draining and node in live:
                return live[node]
        return None

    def _replace_agent(self) -> Any:
        """The node's agent died mid-run (noticed by a persist, off the training thread):
        a new one takes its place; the next snapshot maps its fresh slots."""
        logger.warning("rank %d: the node agent died; starting a new one (this checkpoint is skipped)", self.rank)
        handle = agents.get_or_create_agent(self.run, self.node_id, lease_s=self.ray_config.agent_lease_s,
                                            slot_count=self.ray_config.slots)
        self.agent = handle
        if self._memory is not None:
            self._memory.replace_agent(handle)
        return handle

    def _current_generation(self) -> int:
        if self.generation is None:
            raise RuntimeError("call restore() before the first step(): it takes this run's writer generation")
        return self.generation

    # ----------------------------------------------------------------- restore
    def restore(self) -> int:
        """The restart protocol; returns the iteration to resume at (0 on a fresh run)."""
        mine = ([asdict(self._choose()), self.generation, self.store.read_metadata(NOTICES_NAME)]
                if self.rank == 0 else None)
        decided = broadcast_json(mine, src=0, rank=self.rank, group=self._control_group)
        choice = RestoreChoice(**decided[0])
        self.generation = int(decided[1])
        recorded_notice = decided[2]
        if self._policy is not None:
            self._policy.generation = self.generation
        started = time.perf_counter()
        if self.rank == 0:
            self.engine.load_cached_profile()
        if choice.kind == "none":
            iteration = 0
            self.restore_info = {"kind": "none", "step": 0, "seconds": 0.0}
        else:
            state = self._load(choice)
            iteration = self.engine.apply_state(state)
            del state
            kind = "storage" if self._fell_back else choice.kind  # what was read, not only what was chosen
            self.restore_info = {"kind": kind, "step": iteration, "node_id": choice.node_id,
                                 "committed_step": choice.committed_step, "seconds": time.perf_counter() - started}
        self.restore_info["lost_after_notice"] = self._count_notice_loss(recorded_notice, iteration)
        if self.rank == 0 and choice.needs_persist and choice.kind == "slot":
            self._persist_restored_slot(choice)
        logger.info("rank %d restored iteration %d from %s", self.rank, iteration, choice.kind)
        self._restored(iteration, iteration if choice.kind == "storage" else choice.committed_step)
        return iteration

    def _restored(self, iteration: int, committed_step: int | None) -> None:
        if self._registrar is not None:
            self._registrar.start(iteration, committed_step)
        if self.metrics is not None and self.restore_info is not None:
            self.metrics.record_restore(self.restore_info["kind"], self.restore_info.get("lost_after_notice"))

    def _count_notice_loss(self, record: dict | None, restored: int) -> int | None:
        """Iterations lost to the previous attempt's notice (None: it stopped for another
        reason); rank 0 marks the record counted, so a later restart does not count it again."""
        lost = lost_after_notice(record, restored=restored, generation=self._current_generation())
        if lost is None or record is None:
            return None
        if record.get("stopped_at") is None and self.rank == 0:
            logger.warning("the previous attempt was stopped before its notice checkpoint (iteration %s) was "
                           "confirmed durable: up to %d iterations are trained again", record.get("stop_at"), lost)
        if self.rank == 0:
            self._write_notice_record({**record, "restored_by": self.generation})
        return lost

    def _write_notice_record(self, record: dict) -> None:
        """A failed write loses only the statistic, never training: logged, not raised."""
        try:
            self.store.write_metadata(NOTICES_NAME, record)
        except Exception as err:  # the store's errors vary by backend; the run goes on
            logger.warning("could not record the preemption notice in %s: %s", NOTICES_NAME, err)

    def _choose(self) -> RestoreChoice:
        live = agents.live_agents(self.run)
        self._wait_for_persists(live)
        self.generation = self.store.acquire_writer()
        headers = _slot_headers(live)
        newest = self.store.latest()
        return choose_source(committed_step=newest.step if newest else None, slot_headers=headers, run=self.run,
                             reachable_nodes=set(self.nodes), prefer_node=self.node_id)

    def _wait_for_persists(self, live: Mapping[str, Any]) -> None:
        """Bounded wait for the agents' in-flight persists, with a warning naming the setting."""
        cfg = self.ray_config
        deadline = time.monotonic() + cfg.restart_wait_s
        pending = dict(live)
        while pending and time.monotonic() < deadline:
            wait_s = min(cfg.restart_warn_every_s, max(0.0, deadline - time.monotonic()))
            refs = {node: handle.wait_idle.remote(wait_s) for node, handle in pending.items()}
            for node, ref in refs.items():
                try:
                    if ray.get(ref, timeout=wait_s + 10):
                        pending.pop(node)
                except ray.exceptions.GetTimeoutError:
                    pass  # alive but slow to answer: still pending until the deadline
                except ray.exceptions.RayError:
                    pending.pop(node)  # that agent is gone: nothing of it to wait for
            if pending:
                logger.warning("restart: still waiting for the persist in flight on %d node agent(s); "
                               "giving up after RayConfig(restart_wait_s=%.0f)", len(pending), cfg.restart_wait_s)

    def _load(self, choice: RestoreChoice) -> dict:
        """The chosen state on every rank: loaded by one rank, broadcast to the others."""
        source = self.nodes.index(choice.node_id) if choice.kind == "slot" and not choice.via_agent else 0
        state: Any = None
        ok = True
        if self.rank == source:
            try:
                state = self._read_source(choice)
            except (slots.SlotError, OSError) as err:
                logger.error("restore: slot %s unreadable (%s); falling back to storage", choice.path, err)
                ok = False
        if not broadcast_json(ok, src=source, rank=self.rank, group=self._control_group):
            source, state = 0, (self.store.load() if self.rank == 0 else None)
            self._fell_back = True
        return broadcast_state(state, src=source, rank=self.rank, world_size=self.world_size,
                               group=self._control_group)

    def _read_source(self, choice: RestoreChoice) -> dict:
        if choice.kind == "storage":
            return self.store.load()
        assert choice.path is not None and choice.seq is not None
        if choice.via_agent:
            holder = agents.live_agents(self.run).get(choice.node_id or "")
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

    def _persist_restored_slot(self, choice: RestoreChoice) -> None:
        holder = agents.live_agents(self.run).get(choice.node_id or "")
        if holder is None:
            logger.warning("restore: the agent holding step %s is gone; it stays uncommitted", choice.step)
            return
        # Not awaited: the agent commits it in the background; the next persist waits behind it.
        self._restored_persist = holder.persist.remote(choice.path, choice.seq, self.store, self.generation)

    # -------------------------------------------------------------------- rng
    def _gather_rng(self) -> dict:
        """Every rank's RNG states (a collective: every rank calls it at each checkpoint)."""
        ranks = all_gather_state({"rng": local_rng_state()}, world_size=self.world_size, group=self._control_group)
        return {"world_size": self.world_size, "ranks": [entry["rng"] for entry in ranks]}

    def _set_own_rng(self, saved: Any) -> None:
        ranks = saved.get("ranks") if isinstance(saved, Mapping) else None
        if ranks is None:
            set_local_rng_state(saved)  # a single-process checkpoint
        elif self.rank < len(ranks):
            set_local_rng_state(ranks[self.rank])
        else:
            _seed_new_rank(self.seed, self.rank, int(saved["world_size"]))

    # ----------------------------------------------------------------- steps
    def step(self) -> None:
        """Call once per iteration, after ``optimizer.step()``, on every rank.

        After a preemption notice, the checkpoint of the chosen iteration is taken and made
        durable, and then this call blocks on every rank until Ray Train stops the group.
        """
        self._time_iteration()
        if self._watcher is not None:
            self._plan_for_notice(self._watcher.notice)
        self.engine.step()
        if self._policy is not None and self.rank == 0:
            self._follow_policy(self._policy)
        self._after_step_hooks()
        if self.agent is not None and time.monotonic() - self._renewed > self.ray_config.agent_lease_s / 4:
            self._renewed = time.monotonic()
            self.agent.renew.remote()
        if self.engine.stop_requested:
            self._stop_and_wait()

    def _after_step_hooks(self) -> None:
        """Registration with Ray Train (a collective at agreed iterations) and rank 0's metrics."""
        if self._registrar is not None:
            self._registrar.after_step(self.engine.iteration)
        if self.metrics is not None:
            self.metrics.maybe_record_stats(self.engine.stats)

    def _follow_policy(self, link: PolicyLink) -> None:
        """Rank 0: propose the engine's profiled k once, then apply the policy actor's k (the
        next planned action carries it to every rank)."""
        engine = self.engine
        if link.started is None:
            if engine.policy_ready and engine.decision is not None and engine.profile is not None:
                link.start(world_size=self.world_size, k=engine.decision.k, k_floor=engine.decision.k_floor,
                           iter_s=engine.profile.iter_s, overhead=engine.config.overhead,
                           adaptive=asdict(engine.config.adaptive_config), k_cap=engine.decision.k_cap)
            return
        decision = link.poll()
        if (decision is None or decision.get("generation") != self.generation or decision.get("k") is None
                or decision["version"] == self._policy_version):
            return
        self._policy_version = decision["version"]
        self.policy_decisions.append(decision)
        if decision["k"] != engine.planned_k:
            logger.info("policy actor: k -> %d (overhead %s, persists %s s)", decision["k"], decision["overhead"],
                        decision["persist_s"])
        engine.set_k(decision["k"])

    def _time_iteration(self) -> None:
        now = time.monotonic()
        if self._last_step_s is not None:
            spent = now - self._last_step_s
            self._iter_s = spent if self._iter_s == 0 else 0.9 * self._iter_s + 0.1 * spent
        self._last_step_s = now

    def _plan_for_notice(self, notice: Notice | None) -> None:
        if notice is None or self.engine.stop_at is not None:
            return
        persist_s = self.engine.stats()["last_persist_s"] or 0.0
        earliest = self.engine.iteration + 1 + self._decisions.lookahead  # what the next step() plans
        self.engine.stop_at = stop_iteration(now_s=time.time(), notice=notice, iteration=earliest,
                                             iter_s=self._iter_s, persist_s=persist_s,
                                             detection_lag_s=self.ray_config.drain_poll_s)
        self.notices.append({"node_id": notice.node_id, "deadline_s": notice.deadline_s, "seen_s": notice.seen_s,
                             "iteration": self.engine.stop_at})
        if self.metrics is not None:
            self.metrics.record_notices(len(self.notices))
        logger.warning("preemption notice: checkpoint at iteration %d, then stop", self.engine.stop_at)
        # Recorded now, not only at the commit: the group may be torn down before it.
        self._write_notice_record(notice_record(self.notices, generation=self._current_generation(),
                                                stop_at=self.engine.stop_at, stopped_at=None))

    def _stop_and_wait(self) -> None:
        """Make the stop checkpoint durable (rank 0), then block until the group is torn down:
        returning would end the run as finished, raising would count as a failure."""
        if self.rank == 0:
            self.engine.flush()
            record = self.notices[-1] if self.notices else {}
            record["committed_s"] = time.time()
            if record.get("deadline_s"):
                record["committed_before_deadline_s"] = record["deadline_s"] - record["committed_s"]
            self._write_notice_record(notice_record(self.notices, generation=self._current_generation(),
                                                    stop_at=self.engine.iteration,
                                                    stopped_at=self.engine.iteration))
            logger.warning("preemption: iteration %d is durable; waiting for the restart", self.engine.iteration)
        while True:
            time.sleep(1.0)

    def flush(self) -> float:
        """Block until the checkpoint in flight is durable. Call it on every rank: it may
        complete a checkpoint that waits for the next iteration (a collective)."""
        return self.engine.flush()

    def report(self, metrics: Mapping[str, Any]) -> None:
        """Report your metrics to Ray Train: use it in place of ``ray.train.report(metrics)``,
        on every rank, as often on each (it is a barrier, as Ray's is).

        They are reported now, with a pointer to the newest committed checkpoint when there
        is one, and again with every later registration, so ``Result.metrics`` holds them
        beside ours (``iteration`` and ``checkfreq_*`` are ours). Ray Train takes
        ``Result.metrics`` from the newest report that carried a checkpoint: a plain
        ``ray.train.report`` never reaches it while ray_checkfreq registers checkpoints.
        """
        if not isinstance(metrics, Mapping) or not all(isinstance(key, str) for key in metrics):
            raise TypeError(f"report(metrics={metrics!r}): expected a mapping with str keys")
        if self._registrar is not None:
            self._registrar.report_now(self.engine.iteration, metrics)
            return
        import ray.train

        ray.train.report({**metrics, **_report_metrics(self.engine.stats()), "iteration": self.engine.iteration})

    def close(self) -> None:
        """Make the checkpoint in flight durable, then finish the per-iteration broadcast."""
        try:
            self.engine.close()
        finally:
            if self._watcher is not None:
                self._watcher.close()
            self._decisions.close()
            if self._policy is not None:
                self._policy.close()
            if self._memory is not None:
                self._memory.close()
        if self._registrar is not None:
            self._registrar.close(self.engine.iteration)  # after the last checkpoint is durable
        if self.metrics is not None:
            self.metrics.record_stats(self.engine.stats())

    def stats(self) -> dict:
        return {**self.engine.stats(), "rank": self.rank, "world_size": self.world_size,
                "snapshots": self.snapshots, "restore": self.restore_info, "notices": list(self.notices),
                "policy_decisions": list(self.policy_decisions),
                "metrics": self.metrics.values() if self.metrics is not None else None,
                "registration": self._registrar.stats() if self._registrar is not None else None}

    @property
    def iteration(self) -> int:
        return self.engine.iteration

    def __enter__(self) -> CheckFreq:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _overhead_of(engine_options: Mapping[str, Any]) -> float:
    """The overhead budget p the engine will use (``config=`` or the ``overhead`` keyword)."""
    config = engine_options.get("config")
    if config is not None:
        return float(config.overhead)
    return float(engine_options.get("overhead", CheckFreqConfig().overhead))


def _adapts(engine_options: Mapping[str, Any]) -> bool:
    """Whether the engine would pick and adapt k itself (no fixed ``every``)."""
    config = engine_options.get("config")
    if config is not None:
        return config.every is None and config.adaptive
    return engine_options.get("every") is None and engine_options.get("adaptive") is not False


def _also(first: Any, then: Any) -> Any:
    def both(result: Any) -> None:
        first(result)
        if then is not None:
            then(result)

    return both


def _report_metrics(stats: Mapping[str, Any]) -> dict:
    """The engine's figures that go into a Ray Train report (plain numbers)."""
    keys = ("k", "checkpoints_committed", "stall_s_total", "overhead_estimate", "bytes_written", "last_persist_s")
    return {f"checkfreq_{key}": stats[key] for key in keys if isinstance(stats.get(key), (int, float))}


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP (``module.``) and ``torch.compile`` (``_orig_mod.``) wrappers,
    so a checkpoint loads at any world size and into a plain model."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _seed_new_rank(seed: int, rank: int, saved_world_size: int) -> None:
    """A rank the checkpoint has no RNG state for (the world grew): seeded from (seed, rank)."""
    sequence = np.random.SeedSequence([seed, rank, saved_world_size])
    value = int(sequence.generate_state(1, dtype=np.uint32)[0])
    torch.manual_seed(value)
    np.random.seed(value)
    import random

    random.seed(value)


def _train_context() -> Any:
    import ray.train

    try:
        return ray.train.get_context()
    except Exception as err:
        raise RuntimeError("ray_checkfreq.ray.CheckFreq runs inside a Ray Train training function; "
                           "use ray_checkfreq.CheckFreq elsewhere") from err


def _store_for(storage: str | CheckpointStore | None, context: Any) -> CheckpointStore:
    if isinstance(storage, CheckpointStore):
        return storage
    if storage is None:
        run_storage = context.get_storage()
        path = os.path.join(run_storage.experiment_fs_path, "checkfreq")
        return CheckpointStore(path, filesystem=run_storage.storage_filesystem)
    if not isinstance(storage, str):
        raise TypeError(f"storage={storage!r}: expected a URI, an absolute path or a CheckpointStore")
    if not urlparse(storage).scheme and not os.path.isabs(storage):
        raise ValueError(f"storage={storage!r} is relative: each worker would resolve it in its own working "
                         "directory; give an absolute path or a URI")
    return CheckpointStore(storage)


def _new_gloo_group(world_size: int) -> Any:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: use ray_checkfreq.ray.CheckFreq inside a "
                           "TorchTrainer training function")
    return dist.new_group(ranks=list(range(world_size)), backend="gloo")


def _slot_headers(live: Mapping[str, Any]) -> dict[str, list]:
    refs = {node: handle.slot_headers.remote() for node, handle in live.items()}
    headers = {}
    for node, ref in refs.items():
        try:
            headers[node] = ray.get(ref, timeout=30)
        except ray.exceptions.RayError as err:
            logger.warning("restart: node agent %s did not answer (%s)", node[:8], err)
    return headers


def _state_bytes_guess(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The state's size before it exists: parameters, and per parameter as many tensors again
    as the optimizer's defaults suggest (Adam: two moments)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = 2 if any(key in optimizer.defaults for key in ("betas", "beta1")) else 1
    return params * (1 + moments) + (1 << 20)
