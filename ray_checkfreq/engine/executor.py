"""The executor: applies the planner's actions on this rank.

A checkpoint action takes a snapshot (phase 1, asynchronous copies) and hands it to the
persister (phase 2); the next ``optimizer.step()`` first waits for the copies (the
fence, ``before_update``). With fetch hooks on ``data`` the snapshot stays open until the
next batch is asked for (``next_iteration_starts``), and the parts that may change in
between (RNG states, extra state, the optimizer's hyper-parameters) are copied again
then. Every second spent on the training's critical path is counted as stall
(``take_stall``) and in the statistics.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ray_checkfreq.engine.agreement import RankAgreement
from ray_checkfreq.engine.persist import NullPersister, PersistResult, PersistWorker
from ray_checkfreq.engine.restore import (
    check_model_state,
    check_optimizer_state,
    keyed_by_name,
    optimizer_by_number,
    parameter_names,
)
from ray_checkfreq.engine.seams import Action, EngineSeams, Persister
from ray_checkfreq.engine.sharded_persist import ShardedPersistWorker
from ray_checkfreq.engine.sharded_restore import (
    SHARDING_KEY,
    PhaseClock,
    PreparedRankState,
    find_ref,
    load_rank_snapshot,
    prepare_rank_state,
    snapshot_mismatch,
)
from ray_checkfreq.engine.snapshot import CopyHandle, Snapshot, Snapshotter
from ray_checkfreq.engine.snapshot_plan import LocalViews
from ray_checkfreq.engine.state import ChunkPlace, StateAdapter
from ray_checkfreq.engine.stats import EngineStats
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.tree import leaves_of

logger = logging.getLogger("ray_checkfreq.engine")

_ASYNC_PARTS = {"model_params", "optimizer"}


@dataclass(frozen=True)
class _OpenCheckpoint:
    """A checkpoint taken at ``step()`` that the next iteration's start completes
    (``snapshot`` None on a rank that takes no snapshots)."""

    snapshot: Snapshot | None


@dataclass(frozen=True)
class _Restored:
    """What ``load_state`` loaded that the first fetch after it sets again."""

    rng: Any
    extra: dict[str, Any]
    groups: list[dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class ShardedMode:
    """The engine's sharded mode: every rank snapshots and persists its own local pieces."""

    adapter: StateAdapter
    rank: int
    world_size: int
    commit_wait_s: float


@dataclass(frozen=True, kw_only=True)
class TrainingState:
    """What a checkpoint holds, live: the objects whose state is saved and restored."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data: Any
    extra_state: dict[str, Any]

    def extra_dicts(self) -> dict[str, Any]:
        """Each extra entry's state: its ``state_dict()``, or a plain value itself (a copy)."""
        return {name: copy.deepcopy(obj) if is_plain(obj) else obj.state_dict()
                for name, obj in self.extra_state.items()}

    def load_extra(self, saved: Mapping[str, Any]) -> None:
        """The saved extra state back: ``load_state_dict`` for an object with state, the saved
        value for a plain one (a dict or list refilled in place, so references to it see it;
        any plain value readable as ``extra_state[name]`` of the engine)."""
        for name, obj in list(self.extra_state.items()):
            value = saved[name]
            if not is_plain(obj):
                obj.load_state_dict(value)
            elif isinstance(obj, dict) and isinstance(value, Mapping):
                obj.clear()
                obj.update(copy.deepcopy(dict(value)))
            elif isinstance(obj, list) and isinstance(value, list):
                obj[:] = copy.deepcopy(value)
            else:
                self.extra_state[name] = copy.deepcopy(value)


def is_plain(value: Any) -> bool:
    """A value ``extra_state`` keeps as it is: None, a bool, int, float or str, or a list or
    a str-keyed dict of plain values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and is_plain(item) for key, item in value.items())
    return False


class Executor:
    """Snapshot, persist, fence and open-checkpoint completion for the actions applied here."""

    def __init__(self, state: TrainingState, *, store: CheckpointStore, seams: EngineSeams,
                 stats: EngineStats, k: int | None, on_persisted: Callable[[PersistResult], None],
                 sharded: ShardedMode | None = None) -> None:
        self.state = state
        self.sharded = sharded
        self.loading = False  # a sharded restore steps the optimizer once to create its state: no update
        self.stats = stats
        self.iteration = 0  # the iterations step() counted
        self.k_applied = k  # the k of the actions applied so far
        self.stop_requested = False  # an applied action asked the run to stop (a preemption)
        self.snapshotter = Snapshotter("cpu", host_memory=seams.host_memory)
        self.persist = _new_persister(seams, store, on_persisted, sharded)
        self.sees_next_iteration = callable(getattr(state.data, "add_fetch_hook", None))
        self.update_started = 0.0  # when the running optimizer.step() began
        self._seams = seams
        self._clock = seams.clock
        self._fence_handle: Any = None
        self._open: _OpenCheckpoint | None = None  # taken at step(), completed as the next iteration starts
        self._reapply: _Restored | None = None  # set again at the first fetch after a restore
        self._pending_stall = 0.0
        self._early_wait_s = 0.0  # waited for the persist in flight before planning this step's checkpoint
        self._warned_unseen = False
        self._warned_lr = False
        self._lrs_at_step: list[float | None] | None = None  # without fetch hooks: to notice a later scheduler step
        # Sharded mode: the view each snapshot copies from.
        self.local_views = LocalViews(sharded.adapter) if sharded is not None else None

    @property
    def busy(self) -> bool:
        """Whether a checkpoint is being persisted right now."""
        return self.persist.busy

    def take_stall(self) -> float:
        """Checkpoint work on the critical path since the last call."""
        stall, self._pending_stall = self._pending_stall, 0.0
        return stall

    def settle_persist(self) -> None:
        """Wait for the persist in flight now, ahead of this step's checkpoint (a stall of it)."""
        self._early_wait_s += self.persist.wait_idle()

    def load_state(self, state: Mapping[str, Any]) -> int:
        """Load a checkpoint's state into model, optimizer, extra state, data and RNGs; returns its iteration."""
        live = self.state
        optimizer_state = state["optimizer"]
        if keyed_by_name(optimizer_state):  # a sharded checkpoint, gathered whole
            optimizer_state = optimizer_by_number(optimizer_state, parameter_names(live.model, live.optimizer))
        check_model_state(live.model, state["model"])
        check_optimizer_state(live.optimizer, optimizer_state, state["checkfreq"])
        live.model.load_state_dict(state["model"])
        live.optimizer.load_state_dict(optimizer_state)
        return self._load_rest(state, state["rng"])

    def load_sharded(self, store: CheckpointStore, step: int, agreement: RankAgreement) -> int:
        """Sharded mode, on every rank (a collective): fill model and optimizer with this
        rank's boxes of ``step`` (any saved world size), then extra state, data and this
        rank's RNG states; returns the step's iteration. Every rank reads and checks its
        part first; only when every rank's is good does any load it, else every rank
        raises (a CorruptCheckpointError on every rank when some rank's part is damaged)."""
        mode = self._require_sharded()
        clock = PhaseClock()
        optimizer_class = type(self.state.optimizer).__qualname__

        def prepare() -> PreparedRankState:
            ref = find_ref(store, step)
            clock.lap("find")
            return prepare_rank_state(store, ref, mode.adapter, rank=mode.rank, optimizer_class=optimizer_class,
                                      clock=clock)

        self.loading = True
        try:
            prepared = agreement.run(prepare, where=f"step {step} in {store.uri}")
            loaded = prepared.load(mode.adapter, clock)
        finally:
            self.loading = False
        iteration = self._load_rest(loaded.state, loaded.rng)
        clock.lap("rest")
        self.stats.restore_phases_s = clock.seconds
        return iteration

    def rank_snapshot_mismatch(self, state: Mapping[str, Any]) -> str | None:
        """Sharded mode: why this rank's own snapshot (a RAM copy) does not fit its shards
        now; None when it does. No collective."""
        mode = self._require_sharded()
        self.loading = True  # the adapter may create the optimizer's lazy state (a step, no update)
        try:
            return snapshot_mismatch(state, mode.adapter, rank=mode.rank, world_size=mode.world_size,
                                     optimizer_class=type(self.state.optimizer).__qualname__)
        finally:
            self.loading = False

    def load_rank_snapshot(self, state: Mapping[str, Any]) -> int:
        """Sharded mode, on every rank (a collective): this rank's own snapshot, which
        ``rank_snapshot_mismatch`` passed, into its shards, extra state, data and RNG
        states; returns its iteration."""
        mode = self._require_sharded()
        self.loading = True
        try:
            load_rank_snapshot(state, mode.adapter)
        finally:
            self.loading = False
        return self._load_rest(state, {"world_size": mode.world_size, "ranks": {mode.rank: state["rng"]}})

    def persist_rank_snapshot(self, state: Mapping[str, Any]) -> None:
        """Sharded mode: write this rank's own snapshot, just loaded from RAM and newer than
        the newest commit, as its part of that step (in the persist thread, not awaited;
        the next checkpoint waits for it)."""
        mode = self._require_sharded()
        body = {key: value for key, value in state.items() if key != SHARDING_KEY}
        places = {chunk.path: ChunkPlace.of(chunk) for chunk in mode.adapter.restore_targets()}
        size = sum(leaf.numel() * leaf.element_size() for _, _, leaf in leaves_of(body)
                   if isinstance(leaf, torch.Tensor))
        epoch_boundary = bool(state.get(SHARDING_KEY, {}).get("epoch_boundary", False))
        snapshot = Snapshot(step=int(body["checkfreq"]["iteration"]), state=body, epoch_boundary=epoch_boundary,
                            copies=CopyHandle.finished(), size_bytes=size, places=places)
        self.persist.wait_idle()
        self.persist.submit(snapshot)

    def _require_sharded(self) -> ShardedMode:
        if self.sharded is None:
            raise RuntimeError("a sharded restore is for a sharded model (DTensor parameters)")
        return self.sharded

    def _load_rest(self, state: Mapping[str, Any], rng: Any) -> int:
        """Extra state, data and RNGs of a loaded checkpoint (model and optimizer are in)."""
        live = self.state
        live.load_extra(state["extra"])
        if live.data is not None and state.get("data") is not None:
            live.data.load_state_dict(state["data"])
        self._seams.set_rng_state(rng)
        if self.sees_next_iteration:
            self._reapply = _Restored(
                rng=rng, extra=live.extra_dicts(),
                groups=[{k: v for k, v in group.items() if k != "params"} for group in live.optimizer.param_groups])
        return int(state["checkfreq"]["iteration"])

    # ------------------------------------------------------------- an action
    def apply(self, action: Action) -> None:
        """Apply the action due right after this iteration."""
        if action.iteration != self.iteration:
            raise RuntimeError(f"the decision channel handed iteration {self.iteration} the action planned "
                               f"for iteration {action.iteration}")
        if action.k is not None and action.k != self.k_applied:
            # Every rank records the same k history: the k each applied action carries.
            if self.k_applied is not None:
                self.stats.k_changes.append((action.iteration, action.k))
            self.k_applied = action.k
        if action.stop:
            self.stop_requested = True
        if action.checkpoint:
            self._checkpoint(action)

    def _checkpoint(self, action: Action) -> None:
        started = self._clock()
        rng = self._seams.rng_state()  # on every rank, once per checkpoint: it may be a collective
        # A stop blocks the run in this step(): no next iteration completes that checkpoint.
        stays_open = self.sees_next_iteration and not action.stop
        if not self._seams.takes_snapshots:
            self._open = _OpenCheckpoint(None) if stays_open else None
            return
        early_wait, self._early_wait_s = self._early_wait_s, 0.0
        waited = early_wait + self.persist.wait_idle()  # one in flight: this wait is stall
        self.persist.raise_if_failed()
        snapshot = self._take_snapshot(action.epoch_boundary, rng)
        if stays_open:
            snapshot.copies.hold()
            self._open = _OpenCheckpoint(snapshot)
        self._fence_handle = snapshot.copies
        self.persist.submit(snapshot, **({} if action.codec is None else {"codec": action.codec}))
        self.stats.checkpoints_started += 1
        self.stats.persist_wait_s += waited
        spent = self._clock() - started + early_wait
        self._pending_stall += spent
        self.stats.add_checkpoint_stall(spent)

    def _take_snapshot(self, epoch_boundary: bool, rng: Any) -> Snapshot:
        if self.local_views is not None:
            return self._take_sharded_snapshot(self.local_views, epoch_boundary, rng)
        live_state = self.state
        model, optimizer = live_state.model, live_state.optimizer
        param_ptrs = {p.data_ptr() for p in model.parameters()}
        model_state = model.state_dict()
        live_params = {k: v for k, v in model_state.items() if v.data_ptr() in param_ptrs}
        live = {
            "model_params": live_params,
            "model_buffers": {k: v for k, v in model_state.items() if k not in live_params},
            "optimizer": optimizer.state_dict(),
            **self._other_parts(rng),
        }
        snapshot = self.snapshotter.take(self.iteration, live, _ASYNC_PARTS, epoch_boundary=epoch_boundary)
        snapshot.state = _merge_model(snapshot.state, model_state)
        return snapshot

    def _take_sharded_snapshot(self, views: LocalViews, epoch_boundary: bool, rng: Any) -> Snapshot:
        """This rank's local pieces (``to_local()`` views) of model and optimizer, plus its
        own extra, data and RNG state; every model/optimizer leaf's place goes along."""
        view = views.take()
        try:
            model_local = view.state["model"]
            live = {
                "model_params": {k: v for k, v in model_local.items() if k in view.param_keys},
                "model_buffers": {k: v for k, v in model_local.items() if k not in view.param_keys},
                "optimizer": view.state["optimizer"],
                **self._other_parts(rng),
            }
            snapshot = self.snapshotter.take(self.iteration, live, _ASYNC_PARTS, epoch_boundary=epoch_boundary)
            snapshot.state = _merge_model(snapshot.state, model_local)
        finally:
            view.release()
        snapshot.places = view.places
        return snapshot

    def _other_parts(self, rng: Any) -> dict[str, Any]:
        live_state = self.state
        return {
            "extra": live_state.extra_dicts(),
            "data": live_state.data.state_dict() if live_state.data is not None else None,
            "rng": rng,
            "checkfreq": {
                "iteration": self.iteration,
                "optimizer_class": type(live_state.optimizer).__qualname__,
                "k": self.k_applied,
            },
        }

    def _optimizer_groups(self) -> Any:
        """The optimizer's hyper-parameter groups as its snapshot holds them."""
        if self.local_views is not None:
            return self.local_views.param_groups()
        return self.state.optimizer.state_dict()["param_groups"]

    # ------------------------------------------------- around the iterations
    def step_begins(self) -> None:
        """``step()`` was called: the restored parts were set again if they were due, and an
        open checkpoint the next iteration did not complete is completed as it is."""
        self._reapply = None
        self.complete_unseen()

    def step_ends(self) -> None:
        if not self.sees_next_iteration and not self._warned_lr:
            self._lrs_at_step = _learning_rates(self.state.optimizer)

    def before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An ``optimizer.step()`` pre-hook: the fence (the snapshot's copies land first)."""
        if self.loading:
            return
        self.complete_unseen()
        self._check_lr_unchanged()
        handle = self._fence_handle
        if handle is not None:
            start = self._clock()
            handle.fence()
            waited = self._clock() - start
            self._pending_stall += waited
            self.stats.fence_wait_s += waited
            self.stats.add_checkpoint_stall(waited, same_checkpoint=True)
            self._fence_handle = None
        self.update_started = self._clock()

    def next_iteration_starts(self) -> None:
        """A fetch hook of ``data``: the next batch is asked for, nothing of it has run yet."""
        restored, self._reapply = self._reapply, None
        if restored is not None:
            self._seams.set_rng_state(restored.rng)
            self.state.load_extra(restored.extra)
            for group, saved in zip(self.state.optimizer.param_groups, restored.groups):
                group.update(saved)
        if self._open is not None:
            self._complete_open(refresh=True)

    def _complete_open(self, *, refresh: bool) -> None:
        """Copy the parts that may have changed since ``step()`` into the open snapshot
        (``refresh``: on every rank, since the RNG states may be a collective), then let
        the persist read it."""
        started = time.perf_counter()
        opened, self._open = self._open, None
        assert opened is not None
        snapshot = opened.snapshot
        try:
            rng = self._seams.rng_state() if refresh else None
            if snapshot is not None and refresh:
                parts = {("rng",): rng, ("extra",): self.state.extra_dicts(),
                         ("optimizer", "param_groups"): self._optimizer_groups()}
                try:
                    self.snapshotter.refresh(snapshot, parts)
                except ValueError as err:
                    logger.warning("the checkpoint of iteration %d keeps its RNG, extra state and optimizer "
                                   "hyper-parameters as they were at cf.step(): %s", snapshot.step, err)
        finally:
            if snapshot is not None:
                snapshot.copies.release()
        spent = time.perf_counter() - started
        self._pending_stall += spent
        self.stats.add_checkpoint_stall(spent, same_checkpoint=True)

    def complete_unseen(self) -> None:
        """The next iteration began without asking ``data`` for a batch first (a batch fetched
        before ``cf.step()``, or none): the open checkpoint keeps what ``step()`` saw."""
        if self._open is None:
            return
        if not self._warned_unseen:
            self._warned_unseen = True
            logger.warning("iteration %d began without asking data= for its batch after cf.step(): its "
                           "checkpoints keep the RNG, extra state and optimizer hyper-parameters of cf.step() "
                           "time, so RNG draws or scheduler steps between cf.step() and the next batch are not "
                           "in them (fetch each batch from data= after cf.step())", self.iteration + 1)
        self._complete_open(refresh=False)

    def _check_lr_unchanged(self) -> None:
        """Without fetch hooks the checkpoint holds the optimizer and scheduler of ``step()``
        time: a learning rate changed between ``step()`` and the next update means a
        scheduler stepped after ``cf.step()``, which a resumed run would miss."""
        before, self._lrs_at_step = self._lrs_at_step, None
        if before is None or before == _learning_rates(self.state.optimizer) or self._warned_lr:
            return
        self._warned_lr = True
        logger.warning("the learning rate changed between cf.step() and the next optimizer.step() (iteration %d): "
                       "a scheduler stepped after cf.step()? Checkpoints then hold it one step behind. Step it "
                       "before cf.step(), or pass a resumable() iterator as data= (then the order does not matter)",
                       self.iteration + 1)

    # ----------------------------------------------------------------- ending
    def flush(self) -> float:
        """Complete an open checkpoint and wait until the one in flight is durable; returns
        the seconds waited, raises a persist failure."""
        if self._open is not None:
            self._complete_open(refresh=True)
        waited = self.persist.wait_idle()
        self.persist.raise_if_failed()
        return waited

    def close(self) -> None:
        """The last checkpoint (an open one: what the run ended with) made durable; raises a
        persist failure."""
        try:
            if self._open is not None:
                self._complete_open(refresh=True)
            self.persist.close()
            self.persist.raise_if_failed()
        finally:
            self.snapshotter.close()


def _new_persister(seams: EngineSeams, store: CheckpointStore,
                   on_persisted: Callable[[PersistResult], None], sharded: ShardedMode | None) -> Persister:
    if not seams.takes_snapshots:
        return NullPersister()
    if seams.persister is not None:
        return seams.persister(store, on_persisted)
    if sharded is not None:
        return ShardedPersistWorker(store, rank=sharded.rank, world_size=sharded.world_size,
                                    commit_wait_s=sharded.commit_wait_s, on_done=on_persisted,
                                    seal=seams.seal_snapshot)
    return PersistWorker(store, on_done=on_persisted)


def _merge_model(state: dict, live: Mapping[str, Any]) -> dict:
    """Put parameters and buffers back into one model state dict, in the model's order."""
    merged = {**state.pop("model_params"), **state.pop("model_buffers")}
    model = OrderedDict((key, merged[key]) for key in live)
    metadata = getattr(live, "_metadata", None)
    if metadata is not None:
        model._metadata = {k: dict(v) for k, v in metadata.items()}  # type: ignore[attr-defined]
    state["model"] = model
    return state


def _learning_rates(optimizer: torch.optim.Optimizer) -> list[float | None]:
    """Each group's lr when it is a number (a tensor lr is not read: that could sync a device)."""
    return [lr if isinstance(lr := group.get("lr"), (int, float)) else None for group in optimizer.param_groups]
