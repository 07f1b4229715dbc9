"""In-place recovery on Ray Train's torchft replica groups: a lost replica no longer restarts the job.

Driver side, ``in_place_config()`` is the ``torch_config`` of a ``TorchTrainer``: Ray 2.60's
``TorchftConfig`` with a lighthouse that a 0-CPU head can run, and timeouts for spot nodes.
Worker side, ``InPlaceReplica`` holds torchft's ``Manager`` beside the data: each step's
global batch is a pure function of the step (``QuorumSteps``), split among that step's
participants by their rank in the quorum, and the data position moves only when the step
commits. A healed replica receives the data position with the weights.

In Ray 2.60 a replica group is one worker, so this mode is for replicated (DDP) state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
from ray.train.v2.torch.torchft_config import LighthouseServerActor, TorchftConfig, _TorchftBackend
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_checkfreq.data.quorum import QuorumShare, QuorumSteps
from ray_checkfreq.engine import CheckFreq, CheckFreqConfig
from ray_checkfreq.ray.preemption import DrainWatcher, Notice
from ray_checkfreq.ray.unplaced import end_unplaced_replacements
from ray_checkfreq.storage import CheckpointStore

logger = logging.getLogger("ray_checkfreq.ray")


@dataclass(frozen=True, kw_only=True)
class InPlaceConfig:
    """Timeouts of the in-place mode (defaults for spot nodes on one cluster network)."""

    min_replicas: int = 1
    """Fewest replicas that may commit a step; fewer, and the step waits for the quorum."""
    heartbeat_timeout_ms: int = 1000
    """The lighthouse drops a replica silent this long: the survivors' pause after a loss."""
    join_timeout_ms: int = 1000
    """How long the lighthouse waits for late joiners before forming a smaller quorum."""
    quorum_tick_ms: int = 100
    timeout_s: float = 30.0
    """Collectives, commits and the healing transfer: a loaded node re-forms its gloo group in seconds."""
    notice_poll_s: float = 0.5
    """How often each replica polls the drain state of its own node (a preemption notice)."""
    replacement_wait_s: float = 30.0
    """How long a replica whose work has ended waits for a lost replica's replacement that
    Ray cannot place (no node); then it ends it, so that ``fit()`` returns (it raises
    ``ControllerError``) instead of waiting for ever (``ray_checkfreq.ray.unplaced``)."""

    def __post_init__(self) -> None:
        for name in ("min_replicas", "heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"InPlaceConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("timeout_s", "notice_poll_s", "replacement_wait_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"InPlaceConfig.{name} must be > 0 seconds, got {value!r}")

    def lighthouse_kwargs(self) -> dict[str, Any]:
        return {"min_replicas": self.min_replicas, "heartbeat_timeout_ms": self.heartbeat_timeout_ms,
                "join_timeout_ms": self.join_timeout_ms, "quorum_tick_ms": self.quorum_tick_ms}


class _Backend(_TorchftBackend):
    """Ray's backend, but the lighthouse asks for no CPU: Ray 2.60 pins it to the controller's
    node with the default demand of 1 CPU, which a 0-CPU head never schedules ("The actor is
    not schedulable"). It only answers quorum RPCs."""

    def _maybe_create_lighthouse_actor(self, backend_config: Any) -> str:
        if self.lighthouse_actor is None:
            self.lighthouse_actor = LighthouseServerActor.options(  # type: ignore[attr-defined]
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=ray.get_runtime_context().get_node_id(), soft=False),
            ).remote(lighthouse_kwargs={"bind": "[::]:0", **backend_config.lighthouse_kwargs})
        return str(ray.get(self.lighthouse_actor.address.remote()))


class InPlaceTorchConfig(TorchftConfig):
    """Ray 2.60's ``TorchftConfig`` with the lighthouse of ``_Backend`` and ``InPlaceConfig``'s timeouts."""

    def __init__(self, in_place: InPlaceConfig, **torch_config: Any) -> None:
        self.in_place = in_place
        super().__init__(lighthouse_kwargs=in_place.lighthouse_kwargs(), **torch_config)

    @property
    def backend_cls(self) -> type:
        return _Backend


def in_place_config(config: InPlaceConfig | None = None, *, backend: str = "gloo",
                    **torch_config: Any) -> InPlaceTorchConfig:
    """The ``torch_config`` of a ``TorchTrainer`` for in-place recovery (one worker per replica)."""
    return InPlaceTorchConfig(config or InPlaceConfig(), backend=backend, **torch_config)


class InPlaceReplica:
    """One replica group (one Ray Train worker) of an in-place job.

    Each step::

        share = replica.next_share()        # the quorum, then this replica's samples
        loss = mean_loss(share.indices) * share.loss_scale
        loss.backward()                     # replica.model averages gradients over the quorum
        replica.commit(share)               # the optimizer steps only if the step commits

    ``model`` and ``optimizer`` are the caller's; ``replica.model`` wraps the model for the
    gradient average. Model, optimizer, data position and any ``extra_state`` travel to a
    healing replica.
    """

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: QuorumSteps,
                 config: InPlaceConfig | None = None, extra_state: Mapping[str, Any] | None = None,
                 storage: str | None = None, checkpoint: CheckFreqConfig | None = None) -> None:
        from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        self.config = config or InPlaceConfig()
        self.steps = steps
        self.optimizer = optimizer
        self._module = model
        self._extra_state = dict(extra_state or {})
        self.storage, self.checkpoint = storage, checkpoint or CheckFreqConfig()
        self._writer: CheckFreq | None = None
        self._led_last_step = False  # rank 0 of the last committed step's quorum
        self._shut_down = False
        timeout = timedelta(seconds=self.config.timeout_s)
        group = ProcessGroupGloo(timeout=timeout)
        self.replica_rank = ray.train.get_context().get_world_rank()
        self.manager = Manager(
            pg=group, load_state_dict=None, state_dict=None, min_replica_size=self.config.min_replicas,
            # The quorum is known before the batch is fetched: the share depends on it.
            use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=0, world_size=1, replica_id=f"checkfreq_{self.replica_rank}",
            checkpoint_transport=PGTransport(group, timeout=timeout, device=torch.device("cpu")))
        self.manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        self.manager.register_state_dict_fn("optimizer", optimizer.load_state_dict, optimizer.state_dict)
        self.manager.register_state_dict_fn("data", steps.load_state_dict, steps.state_dict)
        for name, holder in self._extra_state.items():
            self.manager.register_state_dict_fn(f"extra/{name}", holder.load_state_dict, holder.state_dict)
        self.model = DistributedDataParallel(self.manager, model)
        self.start_step = self._restore()
        # Ray Train's preemption watcher is off in this mode (Ray 2.60): each replica watches its own node.
        self._drain = DrainWatcher({ray.get_runtime_context().get_node_id()}, poll_s=self.config.notice_poll_s)

    def next_share(self) -> QuorumShare:
        """Join this step's quorum (healing first if behind) and return this replica's share
        of the next uncommitted step's global batch."""
        if self._drain.notice is not None:
            self._leave(self._drain.notice)
        self.optimizer.zero_grad()
        self.manager.start_quorum()
        rank, size = self.manager.participating_rank(), self.manager.num_participants()
        if rank is None:
            raise RuntimeError(f"replica {self.replica_rank} is not in the quorum of step "
                               f"{self.manager.current_step()} after healing (a spare?): in-place "
                               "recovery expects every live replica to take part")
        if self.steps.step != self.manager.current_step():
            raise RuntimeError(f"replica {self.replica_rank}: the data is at step {self.steps.step} but torchft "
                               f"at step {self.manager.current_step()}; the two commit together")
        return self.steps.fetch(rank=rank, size=size)

    def commit(self, share: QuorumShare) -> bool:
        """Step the optimizer and the data if every participant's step went through; the
        writer of the step (rank 0 of its quorum) then counts it for its checkpoints."""
        if not self.manager.should_commit():
            return False
        self.optimizer.step()
        self.steps.commit(share.step)
        self._led_last_step = share.rank == 0
        if self.storage is not None:
            self._count_for_checkpoints(writer=share.rank == 0)
        return True

    @property
    def is_writer(self) -> bool:
        """Whether this replica writes the checkpoints now (rank 0 of the last committed step's quorum)."""
        return self._writer is not None

    def shutdown(self, *, end_unplaced: bool = True) -> None:
        """Make the writer's last checkpoint durable, then end the manager (a replica that
        returns while another is healing must not leave it waiting). The last step's rank 0
        then ends a replacement that Ray could not place within ``replacement_wait_s``."""
        if self._shut_down:
            return
        self._shut_down = True
        self._drain.close()
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            self.manager.shutdown(wait=False)
        if end_unplaced and self._led_last_step:  # one replica, once its checkpoint is durable
            end_unplaced_replacements(self.config.replacement_wait_s)

    def _leave(self, notice: Notice) -> None:
        """This replica's node is draining: leave the quorum at this step boundary (no step
        is aborted; the writer's checkpoint becomes durable first), then wait for the node to
        go, so that Ray places the replacement on another node. A node still up
        ``replacement_wait_s`` after its deadline: raise, and Ray replaces this replica."""
        logger.warning("in-place replica %d leaves the quorum after step %d: its node %s is draining",
                       self.replica_rank, self.steps.step, notice.node_id[:8])
        self.shutdown(end_unplaced=False)
        until = (notice.deadline_s or time.time()) + self.config.replacement_wait_s
        while time.time() < until:
            time.sleep(0.5)
        raise RuntimeError(f"in-place replica {self.replica_rank} left the quorum on a drain notice for node "
                           f"{notice.node_id}, which still runs {self.config.replacement_wait_s:g} s after its "
                           "deadline: this replica fails so that Ray replaces it")

    # ------------------------------------------------------------ checkpoints
    def _engine(self) -> CheckFreq:
        return CheckFreq(model=self._module, optimizer=self.optimizer, storage=self.storage,  # type: ignore[arg-type]
                         extra_state={"data": self.steps, "torchft": _ManagerStep(self.manager), **self._extra_state},
                         config=self.checkpoint)

    def _restore(self) -> int:
        """Every replica loads the newest checkpoint (reading takes no writer generation); a
        replacement then heals from a live peer at its first quorum anyway."""
        if self.storage is None or not CheckpointStore(self.storage).list():
            return 0
        loader = self._engine()
        try:
            step = loader.apply_state(loader.store.load())
        finally:
            loader.close()
        if step != self.steps.step or step != self.manager.current_step():
            raise RuntimeError(f"checkpoint of step {step} in {self.storage} holds data step {self.steps.step} and "
                               f"torchft step {self.manager.current_step()}: not a checkpoint of this mode's job?")
        logger.info("in-place replica %d resumed at step %d from %s", self.replica_rank, step, self.storage)
        return step

    def _count_for_checkpoints(self, *, writer: bool) -> None:
        """One writer at a time: the step's quorum rank 0. A new writer's first save takes a
        newer writer generation, which fences an old writer still persisting (``FencedWriterError``:
        its checkpoint is withdrawn and never the latest)."""
        # A writer retires when another replica is rank 0 now, or when it rolled a step back
        # that the others committed and healed from them (its engine did not count that step).
        # Its in-flight persist finishes (or is fenced) without stalling the steps.
        if self._writer is not None and (not writer or self._writer.iteration != self.steps.step - 1):
            self._writer.close(wait=False)
            self._writer = None
        if writer and self._writer is None:
            self._writer = self._engine()
            self._writer.begin_at(self.steps.step - 1)
        if self._writer is not None:
            self._writer.step()


class _ManagerStep:
    """torchft's step count, saved with the checkpoint: a job submitted again starts its
    manager where the data and weights are."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def state_dict(self) -> dict[str, int]:
        return {key: int(value) for key, value in self.manager.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.manager.load_state_dict(dict(state))

