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

A sharded state (FSDP2 / HSDP / TP: DTensor parameters) needs no other code: every rank
snapshots its own shards into slots of its own in its node's agent and persists them as its
part of the step, a step is visible once every part is durable (one global commit,
``storage/committer.py``), and each sealed slot is copied to the agent of another node
(``shard_copies.py``). A restart at the same world size reads every rank's pieces from RAM
(its slot, else a peer copy) when all are there, else each rank's boxes of the newest
complete step from storage, at any world size.

One module per role: set-up in ``rank_setup.py``, the per-step path in ``CheckFreq.step``,
the restart protocol in ``restart.py``, preemption in ``preemption.py``, following the
run's shared policy in ``policy_follower.py``, RNG states in ``rng.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ray_checkfreq.engine import CheckFreq as Engine
from ray_checkfreq.engine.persist import PersistWorker
from ray_checkfreq.engine.seams import EngineSeams, local_rng_state
from ray_checkfreq.engine.state import state_adapter
from ray_checkfreq.ray import agent as agents
from ray_checkfreq.ray.decisions import BroadcastDecisions
from ray_checkfreq.ray.memory import SlotMemory, SlotPersister
from ray_checkfreq.ray.names import run_key
from ray_checkfreq.ray.policy_actor import PolicyLink
from ray_checkfreq.ray.policy_follower import PolicyFollower
from ray_checkfreq.ray.preemption import DrainWatcher, Preemption
from ray_checkfreq.ray.rank_setup import (
    adapts,
    new_gloo_group,
    new_metrics,
    new_registrar,
    place_rank,
    report_metrics,
    start_agent,
    store_for,
    train_context,
    unwrap_model,
)
from ray_checkfreq.ray.rank_setup import overhead_of as _overhead_of
from ray_checkfreq.ray.registration import RegistrationConfig
from ray_checkfreq.ray.restart import RestartProtocol
from ray_checkfreq.ray.rng import gather_rng, set_own_rng
from ray_checkfreq.ray.shard_copies import ShardSealer, peer_node, release_stale_copies
from ray_checkfreq.storage import CheckpointStore

logger = logging.getLogger("ray_checkfreq.ray")

@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """How the Ray layer behaves; units in the names.

    ``restart_wait_s``: how long a restart waits for the agents' in-flight persists
    before it takes over (a persist still running then is fenced, never lost: its slot
    is restored and persisted again). ``agent_lease_s``: an agent that no rank renewed
    for this long removes its slots and exits (a run without ``CheckFreqCallback``, or one
    stopped with ``ray job stop`` and not submitted again).
    ``slots``: 2 (A/B: a new snapshot never overwrites the newest complete one) or 1
    (half the RAM; a crash mid-copy then leaves only storage to restore from).
    ``registration``: when pointer checkpoints are reported to Ray Train (None: never).
    ``metrics_every_s``: how often rank 0 records its figures as Ray metrics (None: never).
    ``shared_policy``: k adapts in the run's ``PolicyActor`` from every rank's iterations
    and every agent's persists (False: from rank 0's own measurements only).
    ``replicas``: the first rank on every node keeps a RAM copy in its node's agent (True),
    or only rank 0's node does (False: less memory traffic per checkpoint, but losing rank
    0's node falls back to storage, and a notice on it cannot hand the persist to another
    node). ``peer_copies``: a sharded run's ranks copy each snapshot to another node's agent.
    """

    restart_wait_s: float = 120.0
    """Seconds a restart waits for the node agents' persists in flight."""
    restart_warn_every_s: float = 15.0
    """Seconds between warnings while it waits."""
    agent_lease_s: float = 600.0
    """Seconds after which an agent (or the policy actor) nobody renewed exits (runs without
    ``CheckFreqCallback``, or stopped with ``ray job stop`` and not submitted again)."""
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
    peer_copies: bool = True
    """Sharded runs: each rank's sealed snapshot is also copied to another node's agent, so a
    lost node's ranks restore from RAM (False: they read storage; less network and memory)."""

    def __post_init__(self) -> None:
        for name in ("restart_wait_s", "restart_warn_every_s", "agent_lease_s", "drain_poll_s", "replica_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be > 0 seconds")
        if self.slots not in (1, 2):
            raise ValueError(f"slots={self.slots!r}: must be 1 or 2")


class CheckFreq:
    """CheckFreq checkpoints for a Ray Train worker: same interface as the engine's.

    Not the engine's ``ray_checkfreq.CheckFreq`` (one process): one ``CheckFreq`` per import
    path (docs/architecture.md); this one builds an engine per rank (its ``engine``).
    """

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
        self.ray_config = config = ray_config or RayConfig()
        context = train_context()
        self.rank, self.world_size = int(context.get_world_rank()), int(context.get_world_size())
        self.seed = seed
        self.run = run_key(context.get_experiment_name())
        self.store = store_for(storage, context)
        self.sharded = state_adapter(unwrap_model(model), optimizer).sharded
        decision_group = new_gloo_group(self.world_size)  # the per-iteration broadcast only
        self._control_group = new_gloo_group(self.world_size)  # every other collective
        place = place_rank(rank=self.rank, world_size=self.world_size, group=self._control_group,
                           replicas=config.replicas)
        self.node_id, self.nodes = place.node_id, place.nodes
        self.snapshots = self.sharded or place.snapshots  # sharded: every rank holds shards of its own
        self.generation: int | None = None
        self.restore_info: dict | None = None
        self.agent = (start_agent(run=self.run, node_id=self.node_id, model=model, optimizer=optimizer,
                                  shm_dir=config.shm_dir, slot_count=config.slots, lease_s=config.agent_lease_s)
                      if self.snapshots and config.use_agents else None)
        self._renewed = time.monotonic()
        # Sharded: slots of this rank's own (its pieces), sealed and sent to a peer node by the persist thread.
        self._memory = (SlotMemory(self.agent, generation=self._current_generation,
                                   owner=self.rank if self.sharded else None,
                                   world_size=self.world_size if self.sharded else None)
                        if self.agent else None)
        self._sealer = (ShardSealer(rank=self.rank, world_size=self.world_size, agent=lambda: self.agent,
                                    peer=self._peer_agent)
                        if self.sharded and self.agent else None)
        self._peer: Any = None
        self.stale_ram_released: dict | None = None  # sharded: what this generation's first commit freed
        self._decisions = BroadcastDecisions(decision_group, self.rank)
        self.metrics = new_metrics(run=self.run, rank=self.rank, node_id=self.node_id, every_s=config.metrics_every_s)
        watcher = (DrainWatcher(set(self.nodes), poll_s=config.drain_poll_s)
                   if self.rank == 0 and config.watch_preemption else None)
        self._preemption = Preemption(rank=self.rank, store=self.store, watcher=watcher,
                                      every_rank_flushes=self.sharded, detection_lag_s=config.drain_poll_s,
                                      generation=self._current_generation,
                                      on_notices=self.metrics.record_notices if self.metrics is not None else None)
        self._restart = RestartProtocol(rank=self.rank, world_size=self.world_size, run=self.run, node_id=self.node_id,
                                        nodes=self.nodes, store=self.store, group=self._control_group,
                                        wait_s=config.restart_wait_s, warn_every_s=config.restart_warn_every_s,
                                        sharded=self.sharded)
        self._registrar = new_registrar(config=config.registration, rank=self.rank, group=self._control_group,
                                        store=self.store,
                                        context=context, run_filesystem=storage is None,
                                        overhead=_overhead_of(engine_options), stats=lambda: self.engine.stats(),
                                        metrics=self.metrics)
        self._policy = (PolicyLink(self.run, rank=self.rank, lease_s=config.agent_lease_s)
                        if config.shared_policy and adapts(engine_options) else None)
        self._follower = PolicyFollower(self._policy) if self._policy is not None and self.rank == 0 else None
        self.engine = Engine(model=unwrap_model(model), optimizer=optimizer,
                             storage=self.store, data=data,
                             extra_state=extra_state, seams=self._engine_seams(), **engine_options)

    def _engine_seams(self) -> EngineSeams:
        """What the engine of this rank takes from the Ray layer."""
        return EngineSeams(
            decisions=self._decisions,
            # Sharded: the engine's own persister writes this rank's part (rank 0's reports the commit).
            persister=None if self.sharded else self._persister,
            on_persisted=self._persisted if self.sharded else None,
            host_memory=self._memory,
            seal_snapshot=self._sealer,
            # Sharded: each rank's RNG goes into its own part (no collective); else all ranks' into one state.
            rng_state=local_rng_state if self.sharded else lambda: gather_rng(world_size=self.world_size,
                                                                                group=self._control_group),
            set_rng_state=lambda saved: set_own_rng(saved, rank=self.rank, seed=self.seed),
            # Without agents (no room in /dev/shm) there is no replica to keep: rank 0 alone snapshots.
            takes_snapshots=self.sharded or (self.snapshots and (self.agent is not None or self.rank == 0)),
            observe=self._policy.observe if self._policy is not None else None,
            local_adaptive=self._policy is None,
            restore_group=self._control_group,  # a sharded restore agrees on what every rank read
        )

    # ----------------------------------------------------------------- steps
    def step(self) -> None:
        """Call once per iteration, after ``optimizer.step()``, on every rank.

        The collectives, in this order (every rank makes the same ones at the same iteration):
        the decision broadcast (every iteration), the RNG all-gather (at a checkpoint), the
        registration broadcast (at iterations agreed in advance). After a preemption notice
        the checkpoint of the chosen iteration is made durable, and this call then blocks on
        every rank until Ray Train stops the group.
        """
        self._preemption.time_iteration()
        self._preemption.plan_for_notice(self.engine, self._decisions.lookahead)  # rank 0: sets engine.stop_at
        # Collectives: the decision broadcast (BroadcastDecisions.exchange); at a checkpoint,
        # the RNG all-gather (gather_rng).
        self.engine.step()
        if self._follower is not None:  # rank 0: the shared policy's k for the next action
            self._follower.after_step(self.engine, world_size=self.world_size, generation=self.generation)
        if self._registrar is not None:  # collective: a broadcast at agreed iterations
            self._registrar.after_step(self.engine.iteration)
        if self.metrics is not None:
            self.metrics.maybe_record_stats(self.engine.stats)
        self._renew_agent_lease()
        if self.engine.stop_requested:
            self._preemption.stop_and_wait(self.engine)  # never returns

    # ----------------------------------------------------------------- restore
    def restore(self) -> int:
        """The restart protocol (``restart.py``); returns the iteration to resume at (0 on a fresh run)."""
        decided = self._restart.decide()  # collective: rank 0's choice, broadcast
        self.generation = decided.generation
        if self.sharded:  # every rank writes its parts as the run's generation
            self.store.adopt_generation(decided.generation)
        if self._policy is not None:
            self._policy.generation = self.generation
        if self.rank == 0:
            self.engine.load_cached_profile()
        restored = self._restart.apply(decided, self.engine)  # collectives: the read's outcome, the state
        self.restore_info = restored.info
        if self._registrar is not None:
            self._registrar.start(restored.iteration, restored.committed_step)
        if self._follower is not None:  # a notice that kept everything is no loss that needs a checkpoint
            self._follower.lost_work = restored.info.get("lost_after_notice") != 0
        if self.metrics is not None:
            self.metrics.record_restore(restored.info["kind"], restored.info.get("lost_after_notice"))
        return restored.iteration

    # ------------------------------------------------------- the node agent
    def _persister(self, store: Any, on_done: Any) -> Any:
        on_done = _also(self._persisted, on_done)
        if self.agent is None:  # rank 0 without agents: persist in this process
            return PersistWorker(store, on_done=on_done)
        return SlotPersister(store, on_done, agent=self.agent, persists=self.rank == 0,
                             generation=self._current_generation, on_agent_lost=self._replace_agent,
                             route=lambda: self._preemption.persist_route(run=self.run, node_id=self.node_id,
                                                                          nodes=self.nodes),
                             replica_wait_s=self.ray_config.replica_wait_s,
                             on_agent_report=self._policy.persisted if self._policy is not None else None)

    def _persisted(self, result: Any) -> None:
        """Rank 0: a persist committed (from the persist thread)."""
        if self.sharded and self.rank != 0:
            return  # another rank's part is durable: only rank 0's reports a commit
        if self.sharded and self.agent is not None and self.stale_ram_released is None:
            # This generation's first commit: no restart can choose an older generation's copies now.
            self.stale_ram_released = release_stale_copies(agents.live_agents(self.run),
                                                           generation=self._current_generation(),
                                                           rank_nodes=self.nodes)
        self._restart.settle_notice()
        if self.sharded and self._policy is not None:  # no agent reports it
            self._policy.persisted({"step": result.step, "seconds": result.seconds,
                                    "stored_bytes": result.stored_bytes, "node_id": self.node_id})
        if self._registrar is not None:
            self._registrar.committed(result.step)
        if self.metrics is not None:
            self.metrics.record_persist(result.seconds, result.stored_bytes)

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

    def _peer_agent(self, refresh: bool) -> Any:
        """The agent that keeps this node's peer copies (sharded runs); None on one node."""
        node = peer_node(self.nodes, self.node_id) if self.ray_config.peer_copies else None
        if node is None:
            return None
        if self._peer is None or refresh:
            self._peer = agents.get_or_create_agent(self.run, node, lease_s=self.ray_config.agent_lease_s,
                                                    slot_count=self.ray_config.slots)
        return self._peer

    def _renew_agent_lease(self) -> None:
        if self.agent is not None and time.monotonic() - self._renewed > self.ray_config.agent_lease_s / 4:
            self._renewed = time.monotonic()
            self.agent.renew.remote()

    def _current_generation(self) -> int:
        if self.generation is None:
            raise RuntimeError("call restore() before the first step(): it takes this run's writer generation")
        return self.generation

    # ------------------------------------------------------------ the rest
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

        ray.train.report({**metrics, **report_metrics(self.engine.stats()), "iteration": self.engine.iteration})

    def close(self) -> None:
        """Make the checkpoint in flight durable, then finish the per-iteration broadcast."""
        try:
            self.engine.close()
        finally:
            self._preemption.close()
            self._decisions.close()
            if self._policy is not None:
                self._policy.close()
            if self._memory is not None:
                self._memory.close()
        if self._registrar is not None:
            self._registrar.close(self.engine.iteration)  # after the last checkpoint is durable
        if self.metrics is not None:
            self.metrics.record_stats(self.engine.stats())

    @property
    def notices(self) -> list[dict]:
        """Rank 0: the preemption notices seen (each with the iteration it stops at)."""
        return self._preemption.notices

    @property
    def policy_decisions(self) -> list[dict]:
        """Rank 0: each new decision of the policy actor."""
        return self._follower.decisions if self._follower is not None else []

    def stats(self) -> dict:
        return {**self.engine.stats(), "rank": self.rank, "world_size": self.world_size,
                "snapshots": self.snapshots, "sharded": self.sharded, "restore": self.restore_info,
                "peer_copies": self._sealer.stats() if self._sealer is not None else None,
                "stale_ram_released": self.stale_ram_released,
                "notices": list(self.notices),
                "policy_decisions": list(self.policy_decisions),
                "metrics": self.metrics.values() if self.metrics is not None else None,
                "registration": self._registrar.stats() if self._registrar is not None else None}

    @property
    def extra_state(self) -> dict[str, Any]:
        """The engine's ``extra_state``: a plain value is read from here at each checkpoint
        and found here after ``restore()``."""
        return self.engine.extra_state

    @property
    def iteration(self) -> int:
        return self.engine.iteration

    def __enter__(self) -> CheckFreq:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _also(first: Any, then: Any) -> Any:
    def both(result: Any) -> None:
        first(result)
        if then is not None:
            then(result)

    return both

