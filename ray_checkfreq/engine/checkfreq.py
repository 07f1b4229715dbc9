"""CheckFreq: two-phase checkpoints every k iterations, k chosen and adapted at run time.

    cf = CheckFreq(model=model, optimizer=opt, storage="s3://bucket/run1", data=loader,
                   extra_state={"sched": scheduler}, overhead=0.035, epoch_len=len(loader))
    start = cf.restore()
    for it in range(start, total):
        ...; loss.backward(); opt.step()   # waits for an in-flight snapshot by itself
        cf.step()
    cf.close()

A checkpoint of iteration i holds the state as iteration i + 1 starts: when ``data`` has
fetch hooks (a ``resumable()`` iterator), the snapshot taken at ``step()`` stays open until
the next batch is asked for, and the RNG states, ``extra_state`` and the optimizer's
hyper-parameters are copied again then. Whatever runs in between (an evaluation drawing
the global RNG, ``scheduler.step()`` after ``cf.step()``, logging) is therefore in the
checkpoint, and a resumed run sets the same parts again at its first fetch, undoing what
its own code drew or stepped before it (the top of the epoch loop, run again after a
mid-epoch resume). Without fetch hooks they are as at ``step()``.

Each ``step()`` the planning rank plans what to do right after iteration now + lookahead
(an ``Action``) and every rank applies the action due now (``EngineSeams``): alone, the
engine plans and applies in the same step; under Ray, rank 0 plans one iteration ahead.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ray_checkfreq.engine.adaptive import AdaptiveConfig, AdaptiveRate
from ray_checkfreq.engine.measured import RunOverhead
from ray_checkfreq.engine.persist import PersistResult, PersistWorker
from ray_checkfreq.engine.policy import (
    Decision,
    Profile,
    choose_codec,
    choose_interval,
    compression_could_pay,
    interval_overhead,
    lost_work_cap,
)
from ray_checkfreq.engine.profiling import (
    WARMUP_ITERS,
    CodecTrial,
    ProfilingWindow,
    cached_profile,
    fingerprint,
    fingerprint_changes,
)
from ray_checkfreq.engine.restore import check_model_state, check_optimizer_state
from ray_checkfreq.engine.seams import Action, EngineSeams, NullPersister, Persister
from ray_checkfreq.engine.snapshot import Snapshot, Snapshotter, tensors_in
from ray_checkfreq.storage import CheckpointStore

logger = logging.getLogger("ray_checkfreq.engine")

PROFILE_NAME = "checkfreq-profile.json"
_ASYNC_PARTS = {"model_params", "optimizer"}
_Planned = tuple[bool, str]  # a planned checkpoint: (epoch boundary, codec)
# Why the planner asked for a checkpoint: its k, an epoch end, profiling's measurements, a stop.
CHECKPOINT_CAUSES = ("interval", "epoch_end", "profiling", "stop")


@dataclass(frozen=True, kw_only=True)
class CheckFreqConfig:
    """How often to checkpoint. ``every`` fixes k; otherwise the policy picks it from p.

    ``compress``: None measures whether the codec pays (with ``every`` too); True or
    False forces it.

    ``max_lost_fraction``: with ``epoch_len`` known and the policy choosing k, k is at most
    this fraction of an epoch (the work a failure can lose between checkpoints), even where
    p would ask for more, unless that is under ``lost_work_floor_s`` seconds of iterations
    (fast iterations: losing that little costs less than checkpointing more often would).
    None: no bound. ``every`` is not bounded.
    """

    overhead: float = 0.035
    every: int | None = None
    epoch_len: int | None = None
    profile_iters: int | None = None
    mtbf_s: float | None = None
    adaptive: bool = True
    adaptive_config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    checkpoint_epoch_end: bool = True
    reuse_profile: bool = True
    compress: bool | None = None
    max_lost_fraction: float | None = 0.25
    lost_work_floor_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.overhead < 1:
            raise ValueError(f"overhead={self.overhead!r}: must be a fraction in (0, 1), e.g. 0.035")
        for name in ("every", "epoch_len", "profile_iters"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if self.profile_iters is not None and self.profile_iters < 2:
            raise ValueError(f"profile_iters={self.profile_iters}: need at least 2 iterations to time one")
        if self.mtbf_s is not None and not self.mtbf_s > 0:
            raise ValueError(f"mtbf_s={self.mtbf_s!r}: must be > 0 seconds")
        if self.compress not in (None, True, False):
            raise ValueError(f"compress={self.compress!r}: must be None (measure), True or False")
        fraction = self.max_lost_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ValueError(f"max_lost_fraction={fraction!r}: must be None or a fraction of an epoch in (0, 1]")
        if isinstance(self.lost_work_floor_s, bool) or not self.lost_work_floor_s >= 0:
            raise ValueError(f"lost_work_floor_s={self.lost_work_floor_s!r}: must be seconds >= 0")

    def k_cap(self, iter_s: float = 0.0) -> int | None:
        """The lost-work bound on the policy's k at iterations of ``iter_s`` (None: none)."""
        return lost_work_cap(self.epoch_len, self.max_lost_fraction, iter_s=iter_s, floor_s=self.lost_work_floor_s)

    def profiling_window(self) -> int:
        """min(1 % of an epoch, 50) iterations (at least 2, to time one iteration)."""
        if self.profile_iters is not None:
            return self.profile_iters
        if self.epoch_len is None:
            return 50
        return max(2, min(math.ceil(0.01 * self.epoch_len), 50))


class CheckFreq:
    """Checkpoints model, optimizer, extra state, data position and RNGs every k iterations."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        storage: str | CheckpointStore,
        data: Any = None,
        extra_state: Mapping[str, Any] | None = None,
        overhead: float | None = None,
        every: int | None = None,
        epoch_len: int | None = None,
        mtbf_s: float | None = None,
        adaptive: bool | None = None,
        profile_iters: int | None = None,
        compress: bool | None = None,
        max_lost_fraction: float | None | str = "default",
        config: CheckFreqConfig | None = None,
        seams: EngineSeams | None = None,
    ) -> None:
        """``seams`` is the Ray layer's hook (who plans, where snapshots go, who persists);
        not for users. ``max_lost_fraction``: "default" keeps the config's (0.25); None
        removes the lost-work bound."""
        lost = {} if max_lost_fraction == "default" else {"max_lost_fraction": max_lost_fraction}
        self.config = _config_from(config, overhead=overhead, every=every, epoch_len=epoch_len, mtbf_s=mtbf_s,
                                   adaptive=adaptive, profile_iters=profile_iters, compress=compress, **lost)
        _check_stateful("data", data)
        for name, obj in (extra_state or {}).items():
            _check_stateful(f"extra_state[{name!r}]", obj)
        self.model = model
        self.optimizer = optimizer
        self.data = data
        self.extra_state = dict(extra_state or {})
        self.store = storage if isinstance(storage, CheckpointStore) else CheckpointStore(storage)
        self.iteration = 0
        self.decision: Decision | None = None
        self.profile: Profile | None = None
        self.stop_requested = False  # an applied action asked the run to stop (a preemption)
        # Planner only: checkpoint at this iteration (or the first one planned after it) and stop.
        self.stop_at: int | None = None
        self._stop_planned = False
        self._seams = seams if seams is not None else EngineSeams()
        self._clock = self._seams.clock
        self._decisions = self._seams.decisions
        self._observer = self._seams.observe
        self._snapshotter = Snapshotter("cpu", host_memory=self._seams.host_memory)
        self._persist = self._new_persister()
        self._fence_handle: Any = None
        self._adaptive: AdaptiveRate | None = None
        self._k: int | None = self.config.every  # the planner's k
        self._k_applied: int | None = self.config.every  # the k of the actions applied so far
        self._planned_k: int | None = self.config.every  # the k the last planned action carried
        self._begun = False
        self._next_checkpoint: int | None = None
        self._profiling: ProfilingWindow | None = None
        self._cached: dict | None = None
        self._codec_trial = CodecTrial(decided=_forced_codec(self.config.compress, self.store))
        self._last_result: PersistResult | None = None
        self._quiet_done = False  # set by _observe, acted on in step()
        self._measure_done = False
        self._last_checkpoint_iteration = -1
        self._measure_from = 0  # the measured checkpoint's iteration: busy iterations are those after it
        self._early_wait_s = 0.0  # waited for the persist in flight while planning this step's checkpoint
        self._measured_result: PersistResult | None = None
        self._started = False
        self._busy_after_step = False
        self._measured_before = False
        self._last_step_t: float | None = None
        self._update_started = 0.0
        self._pending_stall = 0.0
        self._stats = _Stats()
        self._hooks = [
            optimizer.register_step_pre_hook(self._before_update),
            optimizer.register_step_post_hook(self._after_update),
        ]
        add_fetch_hook = getattr(data, "add_fetch_hook", None)
        self._sees_next_iteration = callable(add_fetch_hook)
        if callable(add_fetch_hook):
            self._hooks.append(add_fetch_hook(self._next_iteration_starts))
        self._open: _OpenCheckpoint | None = None  # taken at step(), completed as the next iteration starts
        self._reapply: _Restored | None = None  # set again at the first fetch after a restore
        self._warned_unseen = False
        self._warned_lr = False
        self._lrs_at_step: list[float | None] | None = None  # without fetch hooks: to notice a later scheduler step
        self._closed = False

    def _new_persister(self) -> Persister:
        if not self._seams.takes_snapshots:
            return NullPersister()
        if self._seams.persister is not None:
            return self._seams.persister(self.store, self._persist_done)
        return PersistWorker(self.store, on_done=self._persist_done)

    # ----------------------------------------------------------------- restore
    def restore(self) -> int:
        """Load the newest valid checkpoint into everything; returns the iteration to resume at.

        Takes this run's writer generation first: a process of an earlier run that is still
        writing to the same storage (an old rank 0 after a restart) can no longer commit, so
        the checkpoint read here stays the newest one until this run saves its own.
        """
        self.store.acquire_writer()
        self.load_cached_profile()
        if not self.store.list():
            self._begin(0)
            return 0
        # Falls back past corrupt checkpoints; raises if there are checkpoints but none loads,
        # rather than silently starting over.
        iteration = self.apply_state(self.store.load())
        logger.info("restored iteration %d from %s", iteration, self.store.uri)
        return iteration

    def apply_state(self, state: Mapping[str, Any]) -> int:
        """Load a checkpoint's state (as ``store.load()`` returns it) into model, optimizer,
        extra state, data and RNGs, and resume counting from it; returns its iteration."""
        check_model_state(self.model, state["model"])
        check_optimizer_state(self.optimizer, state["optimizer"], state["checkfreq"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in self.extra_state.items():
            obj.load_state_dict(state["extra"][name])
        if self.data is not None and state.get("data") is not None:
            self.data.load_state_dict(state["data"])
        self._seams.set_rng_state(state["rng"])
        if self._sees_next_iteration:
            self._reapply = _Restored(
                rng=state["rng"], extra={name: obj.state_dict() for name, obj in self.extra_state.items()},
                groups=[{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups])
        iteration = int(state["checkfreq"]["iteration"])
        self._begin(iteration)
        return iteration

    def _begin(self, iteration: int) -> None:
        self.iteration = iteration
        self._begun = True
        self._stats.first_iteration = iteration
        if self._k is not None:
            self._next_checkpoint = iteration + self._k
        elif self._decisions.is_planner:  # others take k from the actions they apply
            self._profiling = ProfilingWindow(quiet_iters=self.config.profiling_window())

    def load_cached_profile(self) -> None:
        """Read the cached profile; it is applied at the first step, once the optimizer
        state exists and its fingerprint can be compared. ``restore()`` calls it; a caller
        that restores with ``apply_state`` calls it itself."""
        if self.config.every is not None or not self.config.reuse_profile or not self._decisions.is_planner:
            return
        cached = self.store.read_metadata(PROFILE_NAME)
        if not cached:
            return
        try:
            profile, cached_fingerprint = cached_profile(cached)
        except (KeyError, TypeError, ValueError) as err:
            logger.warning("ignoring cached profile %s: %s", self.store.backend.uri(PROFILE_NAME), err)
            return
        self._cached = {"profile": profile, "fingerprint": cached_fingerprint}

    def _use_cached_profile(self) -> None:
        cached, self._cached = self._cached, None
        if cached is None or self._profiling is None:
            return
        changed = fingerprint_changes(cached["fingerprint"], self._fingerprint())
        if changed:
            logger.info("re-profiling: %s changed since the cached profile", ", ".join(changed))
            return
        self._profiling = None
        self._apply_profile(cached["profile"], first_checkpoint=self.iteration)

    def _fingerprint(self) -> dict:
        config = self.store.config
        codec = {"codec": config.codec, "level": config.codec_level, "threads": config.codec_threads,
                 "compress": self.config.compress}
        return fingerprint(self.model, self.optimizer, codec)

    # -------------------------------------------------------------- each step
    def step(self) -> None:
        """Call once at the end of every iteration, after ``optimizer.step()``."""
        if self._closed:
            raise RuntimeError("CheckFreq is closed")
        self._reapply = None
        self._complete_unseen()
        if not self._started:
            self._started = True
            if not self._begun:
                self._begin(self.iteration)  # restore() was not called: start from 0
            self._use_cached_profile()
        now = self._clock()
        # Counted before anything can raise: the optimizer has stepped, so has the iteration.
        self.iteration += 1
        busy = self._busy_after_step or self._persist.busy  # persist ran during some of it
        if self._last_step_t is not None:
            self._observe(now - self._last_step_t, self._pending_stall, busy)
        self._last_step_t = now  # an iteration runs from step() to step(): this step's own work counts
        self._pending_stall = 0.0
        self._persist.raise_if_failed()
        self._plan_and_apply()
        self._busy_after_step = self._persist.busy
        self._measured_before = self._measured_result is not None  # done before the next iteration began
        if not self._sees_next_iteration and not self._warned_lr:
            self._lrs_at_step = _learning_rates(self.optimizer)

    def _observe(self, iter_s: float, stall_s: float, busy: bool) -> None:
        self._stats.record_iteration(iter_s, stall_s, busy, warm=self._since_start() > WARMUP_ITERS)
        if self._observer is not None:
            self._observer(self.iteration, iter_s, stall_s, busy)
        profiling = self._profiling
        if profiling is not None:
            if profiling.measuring:  # until the measured persist is done (not a later epoch-end one)
                if self.iteration > self._measure_from:  # planned ahead: only once it was taken
                    self._measure_done = profiling.record_busy(iter_s, persist_busy=not self._measured_before,
                                                             stall_s=stall_s)
            elif not busy and stall_s == 0:  # after an epoch-end checkpoint, wait for quiet again
                self._quiet_done = profiling.record_quiet(iter_s)
            elif profiling.cold:  # between warm checkpoints, bounded (not in the first window)
                self._quiet_done = profiling.record_waiting()
        elif self._adaptive is not None:
            new_k = self._adaptive.record(iter_s, stall_s, busy)
            if new_k is not None:
                overhead, error = self._adaptive.pooled_overhead or 0.0, self._adaptive.pooled_error or 0.0
                logger.info("adaptive rate: k %d -> %d (measured overhead %.2f%% +- %.2f)", self._k, new_k,
                            100 * overhead, 100 * error)
                self._stats.note_k(self.iteration, new_k, f"measured overhead {overhead:.2%} +- {error:.2%}")
                self._k = new_k  # recorded in k_changes when the action carrying it is applied

    def _since_start(self) -> int:
        return self.iteration - self._stats.first_iteration if self._stats.first_iteration is not None else 0

    # ------------------------------------------------------- plan, then apply
    def _plan_and_apply(self) -> None:
        """The planner plans iteration now + lookahead; every rank applies what is due now."""
        decisions = self._decisions
        planned = self._plan(self.iteration + decisions.lookahead) if decisions.is_planner else None
        action = decisions.exchange(planned)
        if action is None:
            return
        if action.iteration != self.iteration:
            raise RuntimeError(f"the decision channel handed iteration {self.iteration} the action planned "
                               f"for iteration {action.iteration}")
        self._execute(action)

    def _plan(self, at: int) -> Action | None:
        """What to do right after iteration ``at``. Its bookkeeping happens here, once, so
        the same checkpoint is never planned twice; None when nothing is to be done."""
        if self._stop_planned:
            return None
        if self.stop_at is not None and at >= self.stop_at:
            self._stop_planned = True
            self._stats.count_checkpoint("stop")
            epoch_boundary, codec = self._plan_checkpoint(at, self._is_epoch_end(at))
            return Action(iteration=at, checkpoint=True, epoch_boundary=epoch_boundary, codec=codec, k=self._k,
                          stop=True)
        checkpoint = self._advance_profiling(at) if self._profiling is not None else self._plan_due(at)
        if checkpoint is None and self._k == self._planned_k:
            return None
        self._planned_k = self._k
        if checkpoint is None:
            return Action(iteration=at, k=self._k)
        epoch_boundary, codec = checkpoint
        return Action(iteration=at, checkpoint=True, epoch_boundary=epoch_boundary, codec=codec, k=self._k)

    def _plan_due(self, at: int) -> _Planned | None:
        if self._next_checkpoint is None:
            return None
        if at >= self._next_checkpoint or self._epoch_end_checkpoint(at):
            self._stats.count_checkpoint("interval" if at >= self._next_checkpoint else "epoch_end")
            return self._plan_checkpoint(at, self._is_epoch_end(at))
        return None

    def _epoch_end_checkpoint(self, at: int) -> bool:
        return self.config.checkpoint_epoch_end and self._is_epoch_end(at)

    def _is_epoch_end(self, at: int) -> bool:
        epoch_len = self.config.epoch_len
        return epoch_len is not None and at % epoch_len == 0

    def _plan_checkpoint(self, at: int, epoch_boundary: bool, codec: str | None = None) -> _Planned:
        if codec is None:
            codec = self._fixed_interval_codec(at)
        if self._k is not None:
            self._next_checkpoint = at + self._k
        return epoch_boundary, codec

    def _fixed_interval_codec(self, at: int) -> str:
        """The policy's codec, or with ``every``: raw until measurement says otherwise."""
        if self.profile is not None:
            return "rcfz" if self.profile.compress else "raw"
        if at == self.iteration and self._codec_trial.decided is None:
            # Applied in this step, whose checkpoint waits for the persist in flight anyway:
            # wait now, so the trial sees that persist's time.
            self._early_wait_s += self._persist.wait_idle()
        result = self._last_result
        if result is not None and self._k is not None:
            self._codec_trial.record(result.codec, result.seconds, self._k * self._stats.iteration_s())
        return self._codec_trial.next_codec()

    def _execute(self, action: Action) -> None:
        self._apply_k(action)
        if action.stop:
            self.stop_requested = True
        if action.checkpoint:
            self._checkpoint(action)

    def _apply_k(self, action: Action) -> None:
        """Every rank records the same k history: the k each applied action carries."""
        k = action.k
        if k is None or k == self._k_applied:
            return
        if self._k_applied is not None:
            self._stats.k_changes.append((action.iteration, k))
        self._k_applied = k

    def _checkpoint(self, action: Action) -> None:
        started = self._clock()
        rng = self._seams.rng_state()  # on every rank, once per checkpoint: it may be a collective
        # A stop blocks the run in this step(): no next iteration completes that checkpoint.
        stays_open = self._sees_next_iteration and not action.stop
        if not self._seams.takes_snapshots:
            self._open = _OpenCheckpoint(None) if stays_open else None
            return
        early_wait, self._early_wait_s = self._early_wait_s, 0.0
        waited = early_wait + self._persist.wait_idle()  # one in flight: this wait is stall
        self._persist.raise_if_failed()
        snapshot = self._take_snapshot(action.epoch_boundary, rng)
        if stays_open:
            snapshot.copies.hold()
            self._open = _OpenCheckpoint(snapshot)
        self._fence_handle = snapshot.copies
        self._persist.submit(snapshot, **({} if action.codec is None else {"codec": action.codec}))
        self._stats.checkpoints_started += 1
        self._stats.persist_wait_s += waited
        spent = self._clock() - started + early_wait
        self._pending_stall += spent
        self._stats.add_checkpoint_stall(spent)

    def _take_snapshot(self, epoch_boundary: bool, rng: Any) -> Snapshot:
        param_ptrs = {p.data_ptr() for p in self.model.parameters()}
        model_state = self.model.state_dict()
        live_params = {k: v for k, v in model_state.items() if v.data_ptr() in param_ptrs}
        live = {
            "model_params": live_params,
            "model_buffers": {k: v for k, v in model_state.items() if k not in live_params},
            "optimizer": self.optimizer.state_dict(),
            "extra": {name: obj.state_dict() for name, obj in self.extra_state.items()},
            "data": self.data.state_dict() if self.data is not None else None,
            "rng": rng,
            "checkfreq": {
                "iteration": self.iteration,
                "optimizer_class": type(self.optimizer).__qualname__,
                "k": self._k_applied,
            },
        }
        snapshot = self._snapshotter.take(self.iteration, live, _ASYNC_PARTS, epoch_boundary=epoch_boundary)
        snapshot.state = _merge_model(snapshot.state, model_state)
        return snapshot

    # ----------------------------------------------- the next iteration starts
    def _next_iteration_starts(self) -> None:
        """A fetch hook of ``data``: the next batch is asked for, nothing of it has run yet."""
        restored, self._reapply = self._reapply, None
        if restored is not None:
            self._seams.set_rng_state(restored.rng)
            for name, obj in self.extra_state.items():
                obj.load_state_dict(restored.extra[name])
            for group, saved in zip(self.optimizer.param_groups, restored.groups):
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
                parts = {("rng",): rng, ("extra",): {name: obj.state_dict() for name, obj in self.extra_state.items()},
                         ("optimizer", "param_groups"): self.optimizer.state_dict()["param_groups"]}
                try:
                    self._snapshotter.refresh(snapshot, parts)
                except ValueError as err:
                    logger.warning("the checkpoint of iteration %d keeps its RNG, extra state and optimizer "
                                   "hyper-parameters as they were at cf.step(): %s", snapshot.step, err)
        finally:
            if snapshot is not None:
                snapshot.copies.release()
        spent = time.perf_counter() - started
        self._pending_stall += spent
        self._stats.add_checkpoint_stall(spent, same_checkpoint=True)

    def _complete_unseen(self) -> None:
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
        if before is None or before == _learning_rates(self.optimizer) or self._warned_lr:
            return
        self._warned_lr = True
        logger.warning("the learning rate changed between cf.step() and the next optimizer.step() (iteration %d): "
                       "a scheduler stepped after cf.step()? Checkpoints then hold it one step behind. Step it "
                       "before cf.step(), or pass a resumable() iterator as data= (then the order does not matter)",
                       self.iteration + 1)

    # ------------------------------------------------------------------ fence
    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._complete_unseen()
        self._check_lr_unchanged()
        handle = self._fence_handle
        if handle is not None:
            start = self._clock()
            handle.fence()
            waited = self._clock() - start
            self._pending_stall += waited
            self._stats.fence_wait_s += waited
            self._stats.add_checkpoint_stall(waited, same_checkpoint=True)
            self._fence_handle = None
        self._update_started = self._clock()

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._profiling is not None and not self._profiling.measuring:
            self._profiling.updates.append(self._clock() - self._update_started)

    # -------------------------------------------------------------- profiling
    def _advance_profiling(self, at: int) -> _Planned | None:
        """Quiet iterations, then measured checkpoints per codec worth trying, then k; an
        epoch end checkpoints whatever profiling is doing."""
        profiling = self._profiling
        assert profiling is not None
        if profiling.measuring and self._measure_done:
            self._measure_done = False
            result = self._measured_result
            if result is None:  # that persist failed (raised at a step): measure another
                codec = profiling.codec
                assert codec is not None
                return self._start_measuring(at, codec)
            self._finish_measuring(profiling, result)
        elif not profiling.measuring and self._quiet_done:
            self._quiet_done = False
            return self._start_measuring(at, profiling.next_codec or self._codec_trial.decided or "raw")
        if not self._epoch_end_checkpoint(at):
            return None
        self._stats.count_checkpoint("epoch_end")
        return self._plan_checkpoint(at, True, codec=self._profiling_codec())

    def _profiling_codec(self) -> str | None:
        """The codec of a checkpoint profiling did not ask for (an epoch end's)."""
        profiling = self._profiling
        if profiling is None:  # just decided: the policy's codec
            return None
        return profiling.codec if profiling.measuring else self._codec_trial.decided or "raw"

    def _finish_measuring(self, profiling: ProfilingWindow, result: PersistResult) -> None:
        """Decide from what was measured, or measure another checkpoint first (each after
        fresh quiet iterations): a warm one after the cold one, the next warm sample, or
        the compressed codec."""
        if profiling.needs_warm_measurement():
            profiling.discard_cold()
            return
        measured = profiling.finish_measuring(result.copy_s, result.seconds - result.copy_s, result.raw_bytes)
        if measured is None:  # fewer than WARM_SAMPLES yet
            return
        self._stats.profiling_s += sum(sample.interference_s for sample in profiling.samples[measured.codec])
        gpu = _gpu_measurements(self._live_tensors(), measured.size_bytes)
        k_cap = self.config.k_cap(profiling.iter_s())
        decisions = {codec: profiling.decide(m, gpu, self.config.overhead, self.config.mtbf_s, k_cap)
                     for codec, m in profiling.measured.items()}
        if (measured.codec == "raw" and self._codec_trial.decided is None
                and compression_could_pay(decisions["raw"][1], measured.size_bytes)):
            profiling.measure_next("rcfz")
            return
        codec = choose_codec({c: d for c, (_, d) in decisions.items()}) if "raw" in decisions else measured.codec
        self._stats.profiling = profiling.summary()
        self._profiling = None
        self._apply_profile(decisions[codec][0], first_checkpoint=self._last_checkpoint_iteration)
        self.store.write_metadata(PROFILE_NAME, {"profile": decisions[codec][0].to_json(),
                                                 "decision": vars(self.decision), "fingerprint": self._fingerprint()})

    def _start_measuring(self, at: int, codec: str) -> _Planned:
        assert self._profiling is not None
        self._profiling.start_measuring(codec)
        self._measured_result = None
        self._last_checkpoint_iteration = at  # before the persist can report
        self._measure_from = at
        self._profiling.checkpoints.append(at)
        self._stats.count_checkpoint("profiling")
        return self._plan_checkpoint(at, self._is_epoch_end(at), codec=codec)

    @property
    def policy_ready(self) -> bool:
        """Whether the policy decided k (profiling done, or a cached profile applied)."""
        return self.decision is not None and self._profiling is None

    @property
    def planned_k(self) -> int | None:
        """The k the planner plans with now (it reaches every rank with the next action)."""
        return self._k

    @property
    def applied_k(self) -> int | None:
        """The k of the actions applied so far on this rank (None before the policy decided)."""
        return self._k_applied

    def set_k(self, k: int) -> None:
        """Planner only: a k decided elsewhere (a policy shared by all ranks). The next planned
        action carries it, so every rank switches at the same iteration; the next checkpoint
        moves to the last one + k."""
        if not self._decisions.is_planner:
            raise RuntimeError("set_k() is for the rank that plans")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k={k!r}: must be an int >= 1")
        if not self.policy_ready or self._k is None or k == self._k:
            return
        if self._next_checkpoint is not None:
            self._next_checkpoint += k - self._k
        self._k = k
        self._stats.note_k(self.iteration, k, "shared policy")
        if self._adaptive is not None:
            self._adaptive.restart_at(k)

    def _live_tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + tensors_in(self.optimizer.state_dict()["state"])

    def _apply_profile(self, profile: Profile, *, first_checkpoint: int) -> None:
        self.profile = profile
        k_cap = self.config.k_cap(profile.iter_s)
        self.decision = choose_interval(profile, overhead=self.config.overhead, mtbf_s=self.config.mtbf_s,
                                        k_cap=k_cap)
        self._snapshotter.set_mode(self.decision.mode)
        self._k = self.decision.k
        self._next_checkpoint = first_checkpoint + self._k
        self._stats.run_overhead.fallback_ref_s = self._stats.run_overhead.fallback_ref_s or profile.iter_s
        self._stats.note_k(self.iteration, self._k, "profile")
        if self.decision.capped:
            logger.warning("k = %d, not the %d that p = %.1f%% asks for: at most max_lost_fraction = %s of a "
                           "%s-iteration epoch may be lost to a failure; the model expects %.1f%% overhead "
                           "here. Raise max_lost_fraction (None: no bound) to keep p, or fix k with every=.",
                           self._k, self.decision.k_uncapped, 100 * self.config.overhead,
                           self.config.max_lost_fraction, self.config.epoch_len,
                           100 * self.decision.expected_overhead)
        epoch_len = self.config.epoch_len
        if epoch_len is not None and self._k > epoch_len and self.config.checkpoint_epoch_end:
            logger.warning("k = %d is longer than an epoch (%d iterations): a failure resumes at the last epoch "
                           "end, up to %.1f s of work (within lost_work_floor_s = %s s). Fix k with every= to "
                           "checkpoint within epochs.", self._k, epoch_len, epoch_len * profile.iter_s,
                           self.config.lost_work_floor_s)
        if self.config.adaptive and self._seams.local_adaptive:
            self._adaptive = AdaptiveRate(k=self._k, k_floor=self.decision.k_floor, overhead=self.config.overhead,
                                          config=self.config.adaptive_config, reference_iter_s=profile.iter_s,
                                          k_cap=k_cap)
        logger.info("policy: mode=%s k=%d (kmin=%d, persist needs %d, measured cost %.0f ms needs %d), %s",
                    self.decision.mode, self._k, self.decision.k_min, self.decision.k_persist,
                    1e3 * self.decision.cost_s, self.decision.k_cost,
                    "compressed" if profile.compress else "raw")

    def _persist_done(self, result: PersistResult) -> None:
        self._last_result = result
        if result.step == self._last_checkpoint_iteration:
            self._measured_result = result
        self._stats.record_persist(result)

    @property
    def in_flight(self) -> bool:
        """Whether a checkpoint is being persisted right now."""
        return self._persist.busy

    # ----------------------------------------------------------------- ending
    def flush(self) -> float:
        """Block until the in-flight checkpoint is durable (say, on a preemption notice).

        Returns the seconds waited; raises a persist failure. A checkpoint still waiting
        for the next iteration to start is completed now (under Ray: on every rank).
        """
        if self._open is not None:
            self._complete_open(refresh=True)
        waited = self._persist.wait_idle()
        self._persist.raise_if_failed()
        return waited

    def close(self) -> None:
        """Make the in-flight checkpoint durable and release the hooks; raises a persist failure."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        try:
            if self._open is not None:  # the last checkpoint: what the run ended with
                self._complete_open(refresh=True)
            self._persist.close()
            self._persist.raise_if_failed()
        finally:
            self._snapshotter.close()

    def __enter__(self) -> CheckFreq:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict:
        """Mode, k, checkpoints, stall, overhead (measured and modelled), bytes written,
        compression, persist time, and what explains the number of checkpoints."""
        s = self._stats
        measured = s.run_overhead.current()
        return {
            "mode": self.decision.mode if self.decision else self._snapshotter.mode,
            "k": self._k_applied,
            "iteration": self.iteration,
            "checkpoints_committed": s.checkpoints_committed,
            "stall_s_total": s.stall_s,
            "stall_s_per_checkpoint": s.stall_s / max(s.checkpoints_started, 1),
            "stall_s_median": statistics.median(s.checkpoint_stalls) if s.checkpoint_stalls else 0.0,
            "fence_wait_s": s.fence_wait_s,
            "persist_wait_s": s.persist_wait_s,
            "profiling_s": s.profiling_s,
            "profiling": s.profiling,
            "overhead_estimate": measured.share,
            "overhead_measured": measured.overhead,
            "overhead_measured_error": measured.error,
            "overhead_lost_s": max(0.0, measured.lost_s),
            "overhead_model": self._modelled_overhead(),
            "k_history": [dict(entry) for entry in s.k_history],
            "checkpoints_by_cause": dict(s.checkpoints_by_cause),
            "profiling_checkpoints": list(s.profiling["checkpoints"]) if s.profiling else None,
            "k_cap": self.decision.k_cap if self.decision else None,
            "bytes_written": s.stored_bytes,
            "compression_ratio": (s.stored_bytes / s.raw_bytes) if s.raw_bytes else None,
            "compress": self._compress_now(),
            "last_persist_s": s.last_persist_s,
            "k_changes": list(s.k_changes),
            "expected_lost_s": self.decision.expected_lost_s if self.decision else None,
            "young_daly_k": self.decision.young_daly_k if self.decision else None,
        }

    def _modelled_overhead(self) -> float | None:
        """The policy's model of the overhead at the k in force (None before it decided)."""
        if self.profile is None or self.decision is None or self._k is None:
            return None
        return interval_overhead(self.profile, self.decision.overhead_s, self._k)

    def _compress_now(self) -> bool | None:
        """Whether checkpoints are compressed; None while that is still being measured."""
        if self.profile is not None:
            return self.profile.compress
        decided = self._codec_trial.decided
        return None if decided is None else decided == "rcfz"


@dataclass(frozen=True)
class _OpenCheckpoint:
    """A checkpoint taken at ``step()`` that the next iteration's start completes
    (``snapshot`` None on a rank that takes no snapshots)."""

    snapshot: Snapshot | None


@dataclass(frozen=True)
class _Restored:
    """What ``apply_state`` loaded that the first fetch after it sets again."""

    rng: Any
    extra: dict[str, Any]
    groups: list[dict[str, Any]]


@dataclass
class _Stats:
    checkpoints_started: int = 0
    checkpoints_committed: int = 0
    fence_wait_s: float = 0.0
    persist_wait_s: float = 0.0
    profiling_s: float = 0.0  # training time the profiling checkpoints cost (measured)
    profiling: dict | None = None  # what the profiling window measured (ProfilingWindow.summary)
    stall_s: float = 0.0  # checkpoint work on the critical path: in step() and at the fence
    first_iteration: int | None = None
    iterations: int = 0  # after warm-up
    iter_time_s: float = 0.0
    iter_stall_s: float = 0.0
    quiet_iterations: int = 0
    quiet_time_s: float = 0.0
    raw_bytes: int = 0
    stored_bytes: int = 0
    last_persist_s: float | None = None
    k_changes: list = field(default_factory=list)
    checkpoint_stalls: deque = field(default_factory=lambda: deque(maxlen=1024))
    run_overhead: RunOverhead = field(default_factory=RunOverhead)  # the measured overhead, since warm-up
    k_history: list = field(default_factory=list)  # the planner's k: {"iteration", "k", "reason"} per change
    checkpoints_by_cause: dict = field(default_factory=lambda: dict.fromkeys(CHECKPOINT_CAUSES, 0))

    def note_k(self, iteration: int, k: int, reason: str) -> None:
        self.k_history.append({"iteration": iteration, "k": k, "reason": reason})

    def count_checkpoint(self, cause: str) -> None:
        self.checkpoints_by_cause[cause] += 1

    def record_iteration(self, iter_s: float, stall_s: float, busy: bool, *, warm: bool) -> None:
        if not warm:
            return
        self.run_overhead.record(iter_s, stall_s, busy)
        self.iterations += 1
        self.iter_time_s += iter_s
        self.iter_stall_s += stall_s
        if not busy and stall_s == 0:
            self.quiet_iterations += 1
            self.quiet_time_s += iter_s

    def add_checkpoint_stall(self, seconds: float, same_checkpoint: bool = False) -> None:
        self.stall_s += seconds
        if same_checkpoint and self.checkpoint_stalls:
            self.checkpoint_stalls[-1] += seconds
        else:
            self.checkpoint_stalls.append(seconds)

    def iteration_s(self) -> float:
        """The mean quiet iteration (all iterations while fewer than 5 were quiet)."""
        if self.quiet_iterations >= 5:
            return self.quiet_time_s / self.quiet_iterations
        return self.iter_time_s / self.iterations if self.iterations else 0.0

    def record_persist(self, result: PersistResult) -> None:
        self.checkpoints_committed += 1
        self.raw_bytes += result.raw_bytes
        self.stored_bytes += result.stored_bytes
        self.last_persist_s = result.seconds


def _merge_model(state: dict, live: Mapping[str, Any]) -> dict:
    """Put parameters and buffers back into one model state dict, in the model's order."""
    from collections import OrderedDict

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


def _check_stateful(name: str, obj: Any) -> None:
    if obj is None:
        return
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict()")


def _gpu_measurements(live: list[torch.Tensor], size_bytes: int) -> dict:
    """Tg, M and Mmax when the state lives on a GPU; empty on a CPU-only machine."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    tensors = [t.detach() for t in live if t.is_cuda]
    if not tensors:
        return {}
    device = tensors[0].device
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    if size_bytes > free:
        return {"peak_memory_bytes": peak, "total_memory_bytes": total}
    copies = [torch.empty_like(t) for t in tensors]
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for src, dst in zip(tensors, copies):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    gpu_copy_s = time.perf_counter() - start
    del copies
    return {"gpu_copy_s": gpu_copy_s, "peak_memory_bytes": peak, "total_memory_bytes": total}


def _config_from(config: CheckFreqConfig | None, **args: Any) -> CheckFreqConfig:
    """The config, from ``config=`` or from the keyword arguments, never both."""
    given = {name: value for name, value in args.items() if value is not None or name == "max_lost_fraction"}
    if config is not None:
        if given:
            names = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ValueError(f"CheckFreq(config=..., {names}): set these in the CheckFreqConfig instead, "
                             "not beside it")
        return config
    return CheckFreqConfig(**given)


def _forced_codec(compress: bool | None, store: CheckpointStore) -> str | None:
    """The codec fixed by configuration, or None to measure: a store set to raw stays raw."""
    if compress is None:
        return "raw" if store.config.codec == "raw" else None
    return "rcfz" if compress else "raw"
