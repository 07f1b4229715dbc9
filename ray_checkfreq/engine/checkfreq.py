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

``CheckFreq`` is a facade over three parts: the ``Planner`` (planner.py) decides each
``Action`` from what was measured, the ``Executor`` (executor.py) applies it (snapshot,
persist, fence, open checkpoint) and ``EngineStats`` (stats.py) keeps the figures.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Generic, TypeVar, overload

import torch

from ray_checkfreq.engine.adaptive import AdaptiveRate
from ray_checkfreq.engine.agreement import RankAgreement
from ray_checkfreq.engine.config import CheckFreqConfig, config_from
from ray_checkfreq.engine.executor import Executor, ShardedMode, TrainingState, is_plain
from ray_checkfreq.engine.persist import PersistResult
from ray_checkfreq.engine.planner import Planner
from ray_checkfreq.engine.policy import Decision, Profile
from ray_checkfreq.engine.profile_cache import PROFILE_NAME, ProfileCache
from ray_checkfreq.engine.restore import exact_checkpoints
from ray_checkfreq.engine.rng import set_own_rng
from ray_checkfreq.engine.seams import EngineSeams, LocalDecisions, set_local_rng_state
from ray_checkfreq.engine.snapshot import Snapshotter, tensors_in
from ray_checkfreq.engine.state import state_adapter
from ray_checkfreq.engine.stats import CHECKPOINT_CAUSES, EngineStats, PolicyNow, report
from ray_checkfreq.errors import CheckpointNotFoundError, CorruptCheckpointError
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.store import as_store

__all__ = ["CHECKPOINT_CAUSES", "PROFILE_NAME", "CheckFreq", "CheckFreqConfig"]

logger = logging.getLogger("ray_checkfreq.engine")

T = TypeVar("T")


class _Forward(Generic[T]):
    """An attribute of ``CheckFreq`` that belongs to one of its parts (``writable``: settable too)."""

    def __init__(self, part: str, name: str, doc: str, *, writable: bool = False) -> None:
        self.part, self.name, self.writable = part, name, writable
        self.__doc__ = doc

    @overload
    def __get__(self, obj: None, owner: type) -> _Forward[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object, owner: type | None = None) -> T | _Forward[T]:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: object, value: T) -> None:
        if not self.writable:
            raise AttributeError(f"CheckFreq.{self.name} is read-only")
        setattr(getattr(obj, self.part), self.name, value)


class CheckFreq:
    """Checkpoints model, optimizer, extra state, data position and RNGs every k iterations."""

    iteration = _Forward[int]("_executor", "iteration", "The iterations step() counted.", writable=True)
    stop_requested = _Forward[bool]("_executor", "stop_requested",
                                    "An applied action asked the run to stop (a preemption).")
    decision = _Forward[Decision | None]("_planner", "decision",
                                         "The policy's decision (None before it decided, or off the planning rank).")
    profile = _Forward[Profile | None]("_planner", "profile", "What the policy decided from.")
    policy_ready = _Forward[bool]("_planner", "policy_ready",
                                  "Whether the policy decided k (profiling done, or a cached profile applied).")
    planned_k = _Forward[int | None]("_planner", "k",
                                     "The k the planner plans with now (it reaches every rank with the next action).")
    applied_k = _Forward[int | None]("_executor", "k_applied",
                                     "The k of the actions applied so far on this rank (None before the policy "
                                     "decided).")
    in_flight = _Forward[bool]("_executor", "busy", "Whether a checkpoint is being persisted right now.")
    measuring_cost = _Forward[bool]("_planner", "measuring_cost",
                                    "Whether profiling is timing the iterations beside a checkpoint (its cost) now.")
    # The names these parts had inside CheckFreq before it was split, still reached for by callers.
    _snapshotter = _Forward[Snapshotter]("_executor", "snapshotter", "The executor's snapshotter.", writable=True)
    _k = _Forward[int | None]("_planner", "k", "The planner's k.", writable=True)
    _adaptive = _Forward[AdaptiveRate | None]("_planner", "adaptive", "The planner's adaptive rate.")

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
        self.config = config_from(config, overhead=overhead, every=every, epoch_len=epoch_len, mtbf_s=mtbf_s,
                                  adaptive=adaptive, profile_iters=profile_iters, compress=compress, **lost)
        self.model, self.optimizer, self.data = model, optimizer, data
        self.extra_state = dict(extra_state or {})
        _check_stateful(data, self.extra_state)
        self._sharded = _sharded_mode(model, optimizer, storage, seams, self.config)
        self.store: CheckpointStore = _store_for(storage)
        self.stop_at: int | None = None  # planner only: checkpoint at this iteration (or the next planned) and stop
        self._seams = _seams_for(seams, self._sharded)
        self._decisions = self._seams.decisions
        self._stats = EngineStats()
        self._planner, self._executor = self._parts(model, optimizer, data)
        self._profile_cache = ProfileCache(self.store, model, optimizer, compress=self.config.compress)
        self._cached: tuple[Profile, Any] | None = None  # read by load_cached_profile, used at the first step
        self._persisted: deque[PersistResult] = deque()  # from the persist thread, not yet told to the planner
        self._mode_of: Decision | None = None  # the decision whose snapshot mode is set
        self._begun = self._started = self._closed = False
        self._last_step_t: float | None = None
        self._restore_group: Any = None  # sharded, several ranks: made by the first restore (``_agreement``)
        self._busy_after_step = False
        self._hooks = [optimizer.register_step_pre_hook(self._executor.before_update),
                       optimizer.register_step_post_hook(self._after_update)]
        if self._executor.sees_next_iteration:
            self._hooks.append(data.add_fetch_hook(self._executor.next_iteration_starts))

    def _parts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Any) -> tuple[Planner, Executor]:
        planner = Planner(self.config, stats=self._stats, local_adaptive=self._seams.local_adaptive,
                          forced_codec=_forced_codec(self.config.compress, self.store),
                          gpu_measurements=lambda size: _gpu_measurements(model, optimizer, size))
        live = TrainingState(model=model, optimizer=optimizer, data=data, extra_state=self.extra_state)
        executor = Executor(live, store=self.store, seams=self._seams, stats=self._stats, k=self.config.every,
                            on_persisted=self._persist_done, sharded=self._sharded)
        return planner, executor

    # ----------------------------------------------------------------- restore
    def restore(self) -> int:
        """Load the newest valid checkpoint into everything; returns the iteration to resume at.

        Takes this run's writer generation first: a process of an earlier run that is still
        writing to the same storage (an old rank 0 after a restart) can no longer commit, so
        the checkpoint read here stays the newest one until this run saves its own.

        Either placement loads into either: a plain model takes a sharded checkpoint
        gathered whole, a sharded one reads its boxes of a replicated checkpoint. The
        optimizer's state is matched by the place of each parameter in its groups.

        Sharded mode (a model with DTensor parameters): every rank calls ``restore()``
        (a collective, over a gloo group of every rank: ``EngineSeams.restore_group``, or
        one the engine makes). Rank 0 takes the writer generation, commits a step whose
        parts were all written (``salvage()``) and lists the committed steps; every rank
        adopts that generation and loads the newest step that EVERY rank can read: each
        rank checks its own part first, and when any rank's part is damaged all of them
        fall back to the next older step together, so no two ranks ever resume at
        different steps and none waits for another that gave up.
        """
        if self._sharded is not None:
            return self._restore_sharded(self._sharded)
        self.store.acquire_writer()
        self.load_cached_profile()
        if not self.store.list():
            self._begin(0)
            return 0
        iteration = self.apply_state(self.store.load())
        logger.info("restored iteration %d from %s", iteration, self.store.uri)
        return iteration

    def _restore_sharded(self, mode: ShardedMode) -> int:
        store, agreement = self.store, self._agreement(mode)

        def choose() -> list[int]:  # rank 0: the generation, then every committed step
            generation = store.acquire_writer()
            store.salvage()
            return [generation, *sorted({ref.step for ref in exact_checkpoints(store)})]  # a replicated one loads too

        chosen = agreement.from_rank0(choose, where=f"choosing the step to restore from {store.uri}")
        if mode.rank != 0:
            store.adopt_generation(chosen[0])
        self.load_cached_profile()
        steps = chosen[1:]
        if not steps:
            self._begin(0)
            return 0
        return self._load_newest_readable(steps, agreement)

    def _load_newest_readable(self, steps: list[int], agreement: RankAgreement) -> int:
        """The newest of ``steps`` (the same list on every rank) that every rank reads:
        a damaged part raises CorruptCheckpointError on every rank at once (agreement.py),
        so every rank moves to the same older step; never silently to 0."""
        failure: Exception | None = None
        for step in reversed(steps):
            try:
                return self._load_sharded_step(step, agreement)
            except CorruptCheckpointError as err:
                logger.warning("rank %d: sharded step %d does not load on every rank, trying an older one: %s",
                               agreement.rank, step, err)
                failure = err
        assert failure is not None
        raise failure

    def load_sharded(self, step: int, *, fall_back: bool = False) -> int:
        """Sharded mode: load committed ``step`` (either placement, any saved world size)
        into this rank's shards of model and optimizer, its extra state, data and RNG states, and
        resume counting from it; returns its iteration. Every rank calls it with the same
        step: it is a collective. Every rank checks its own part before any loads: when
        some rank's part is damaged, every rank raises CorruptCheckpointError (nothing is
        loaded); ``fall_back=True`` then loads the newest older committed step (rank 0's
        listing) that every rank reads instead. ``restore()`` chooses the step itself."""
        mode = self._sharded
        if mode is None:
            raise RuntimeError("load_sharded() is for a sharded model (DTensor parameters); use restore()")
        agreement = self._agreement(mode)
        if not fall_back:
            return self._load_sharded_step(step, agreement)

        def listed() -> list[int]:
            return sorted({ref.step for ref in exact_checkpoints(self.store) if ref.step <= step})

        steps = agreement.from_rank0(listed, where=f"listing the steps up to {step} in {self.store.uri}")
        if not steps:
            raise CheckpointNotFoundError(f"no complete checkpoint of step {step} or older in {self.store.uri}")
        return self._load_newest_readable(steps, agreement)

    def _load_sharded_step(self, step: int, agreement: RankAgreement) -> int:
        assert self._sharded is not None
        iteration = self._executor.load_sharded(self.store, step, agreement)
        self._begin(iteration)
        logger.info("rank %d restored iteration %d (step %d) from %s", self._sharded.rank, iteration, step,
                    self.store.uri)
        return iteration

    def _agreement(self, mode: ShardedMode) -> RankAgreement:
        """The ranks' agreement for a restore; its gloo group made at the first restore when
        the seams gave none (every rank restores at once, so every rank makes it then)."""
        if mode.world_size == 1:
            return RankAgreement(mode.rank, 1)
        if self._restore_group is None:
            import torch.distributed as dist

            self._restore_group = self._seams.restore_group or dist.new_group(backend="gloo")
        return RankAgreement(mode.rank, mode.world_size, self._restore_group)

    def rank_snapshot_mismatch(self, state: Mapping[str, Any]) -> str | None:
        """Sharded mode: why ``state``, this rank's own snapshot as a RAM copy of it holds it
        (``sharded_restore.sharding_record`` under ``"sharding"``), cannot be loaded into
        its shards now (another rank, world size or sharding); None when it can."""
        return self._executor.rank_snapshot_mismatch(state)

    def load_rank_snapshot(self, state: Mapping[str, Any]) -> int:
        """Sharded mode: load this rank's own snapshot (``rank_snapshot_mismatch`` passed it
        on every rank) and resume counting from it; returns its iteration. A collective."""
        iteration = self._executor.load_rank_snapshot(state)
        self._begin(iteration)
        return iteration

    def persist_rank_snapshot(self, state: Mapping[str, Any]) -> None:
        """Sharded mode: write this rank's own snapshot, loaded from RAM with
        ``load_rank_snapshot`` and newer than the newest commit, as its part of that step
        (every rank does, so the step commits; in the persist thread, not awaited)."""
        self._executor.persist_rank_snapshot(state)

    def apply_state(self, state: Mapping[str, Any]) -> int:
        """Load a checkpoint's state (as ``store.load()`` returns it) into model, optimizer,
        extra state, data and RNGs, and resume counting from it; returns its iteration."""
        iteration = self._executor.load_state(state)
        self._begin(iteration)
        return iteration

    def begin_at(self, iteration: int) -> None:
        """Count on from ``iteration`` without loading anything: a writer taking over a live
        run whose state is already in memory (in-place recovery). Before the first ``step()``."""
        if self._started or self._begun:
            raise RuntimeError(f"begin_at({iteration}) after the engine began (at iteration {self.iteration})")
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"begin_at: iteration must be an integer >= 0, got {iteration!r}")
        self._begin(iteration)

    def _begin(self, iteration: int) -> None:
        self.iteration = iteration
        self._begun = True
        self._stats.first_iteration = iteration
        self._planner.begin(iteration, profiles=self._decisions.is_planner)  # others take k from the actions

    def load_cached_profile(self) -> None:
        """Read the cached profile; it is applied at the first step, once the optimizer
        state exists and its fingerprint can be compared. ``restore()`` calls it; a caller
        that restores with ``apply_state`` calls it itself."""
        if self.config.every is not None or not self.config.reuse_profile or not self._decisions.is_planner:
            return
        self._cached = self._profile_cache.read()

    def _check_writer(self) -> None:
        """Sharded mode: a store without a writer generation takes one when alone; with more
        ranks each must have been handed rank 0's (else no part could be written)."""
        store, mode = self.store, self._sharded
        if mode is None or store.writer_generation is not None:
            return
        if mode.world_size == 1:
            store.acquire_writer()
            return
        raise RuntimeError(f"rank {mode.rank}: {store!r} has no writer generation; rank 0 takes one "
                           "(store.acquire_writer()) and hands it to every rank (store.adopt_generation(g)) "
                           "before the first step")

    def _use_cached_profile(self) -> None:
        cached, self._cached = self._cached, None
        if cached is None:
            return
        profile, cached_fingerprint = cached
        changed = self._profile_cache.changes(cached_fingerprint)
        if changed:
            logger.info("re-profiling: %s changed since the cached profile", ", ".join(changed))
            return
        self._planner.adopt_cached_profile(profile, now=self.iteration)
        self._follow_policy()

    # -------------------------------------------------------------- each step
    def step(self) -> None:
        """Call once at the end of every iteration, after ``optimizer.step()``."""
        if self._closed:
            raise RuntimeError("CheckFreq is closed")
        self._executor.step_begins()
        if not self._started:
            self._started = True
            if not self._begun:
                self._begin(self.iteration)  # restore() was not called: start from 0
            self._check_writer()
            self._use_cached_profile()
        now = self._seams.clock()
        # Counted before anything can raise: the optimizer has stepped, so has the iteration.
        self.iteration += 1
        busy = self._busy_after_step or self._executor.busy  # persist ran during some of it
        stall = self._executor.take_stall()
        if self._last_step_t is not None:
            self._observe(now - self._last_step_t, stall, busy)
        self._last_step_t = now  # an iteration runs from step() to step(): this step's own work counts
        self._executor.persist.raise_if_failed()
        self._plan_and_apply()
        self._busy_after_step = self._executor.busy
        self._tell_planner()
        self._planner.end_step()
        self._executor.step_ends()

    def _observe(self, iter_s: float, stall_s: float, busy: bool) -> None:
        if self._seams.observe is not None:
            self._seams.observe(self.iteration, iter_s, stall_s, busy)
        self._planner.observe(self.iteration, iter_s, stall_s, busy)

    def _plan_and_apply(self) -> None:
        """The planner plans iteration now + lookahead; every rank applies what is due now."""
        planned = None
        if self._decisions.is_planner:
            at, now, planner = self.iteration + self._decisions.lookahead, self.iteration, self._planner
            if planner.needs_settled_persist(at, now=now, stop_at=self.stop_at):
                self._executor.settle_persist()
            self._tell_planner()
            planned = planner.plan(at, now=now, stop_at=self.stop_at)
            self._follow_policy()
        action = self._decisions.exchange(planned)
        if action is not None:
            try:
                self._executor.apply(action)
            finally:
                hand_over = getattr(self._decisions, "hand_over", None)
                if hand_over is not None:
                    hand_over()

    def _follow_policy(self) -> None:
        """The planner's policy reaches the snapshotter (its mode) and the profile cache."""
        decision = self._planner.decision
        if decision is not None and decision is not self._mode_of:
            self._mode_of = decision
            self._executor.snapshotter.set_mode(decision.mode)
        measured = self._planner.take_new_profile()
        if measured is not None and decision is not None:
            self._profile_cache.write(measured, decision)

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._executor.loading:
            return
        self._planner.record_update(self._seams.clock() - self._executor.update_started)

    def _persist_done(self, result: PersistResult) -> None:
        """The persister's report (from its thread): counted now, told to the planner at the next step."""
        self._stats.record_persist(result)
        self._persisted.append(result)
        if self._seams.on_persisted is not None:
            self._seams.on_persisted(result)

    def _tell_planner(self) -> None:
        while self._persisted:
            self._planner.record_persist(self._persisted.popleft())

    def request_checkpoint(self, at: int) -> None:
        """Planner only: checkpoint at iteration ``at`` (or the first one planned after it),
        once, out of turn (a preemption notice's); the interval counts on from it."""
        if not self._decisions.is_planner:
            raise RuntimeError("request_checkpoint() is for the rank that plans")
        self._planner.request_checkpoint(at)

    def set_k(self, k: int) -> None:
        """Planner only: a k decided elsewhere (a policy shared by all ranks). The next planned
        action carries it, so every rank switches at the same iteration; the next checkpoint
        moves to the last one + k."""
        if not self._decisions.is_planner:
            raise RuntimeError("set_k() is for the rank that plans")
        self._planner.set_k(k, now=self.iteration)

    # ----------------------------------------------------------------- ending
    def flush(self) -> float:
        """Block until the in-flight checkpoint is durable (say, on a preemption notice).

        Returns the seconds waited; raises a persist failure. A checkpoint still waiting
        for the next iteration to start is completed now (under Ray: on every rank).
        """
        return self._executor.flush()

    def close(self, *, wait: bool = True) -> None:
        """Make the in-flight checkpoint durable and release the hooks; raises a persist failure.

        ``wait=False`` (a writer handing over to another, in-place recovery): the hooks go and
        the snapshot's copies land now, so training may move on at once; the persist in flight
        ends in a background thread, and a failure there (a newer writer's fence) is logged.
        """
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        if wait:
            self._executor.close()
            return
        self._executor.before_update(self.optimizer, (), {})  # the fence: copies land before the next update
        threading.Thread(target=self._close_quietly, name="rcf-close", daemon=True).start()

    def _close_quietly(self) -> None:
        try:
            self._executor.close()
        except Exception as err:  # nobody waits for this thread: the failure is told, not lost
            logger.warning("the last checkpoint of a closed writer was not kept: %s", err)

    def __enter__(self) -> CheckFreq:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict:
        """Mode, k, checkpoints, stall, overhead (measured and modelled), bytes written,
        compression, persist time, and what explains the number of checkpoints."""
        planner = self._planner
        policy = PolicyNow(decision=planner.decision, profile=planner.profile, k=planner.k,
                           codec_decided=planner.codec_trial.decided)
        return report(self._stats, policy, iteration=self.iteration, k_applied=self._executor.k_applied,
                      mode=self._executor.snapshotter.mode)


def _check_stateful(data: Any, extra_state: Mapping[str, Any]) -> None:
    for name, obj in [("data", data)] + [(f"extra_state[{name!r}]", obj) for name, obj in extra_state.items()]:
        if obj is None or (name != "data" and is_plain(obj)):
            continue
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            plain = "" if name == "data" else (" and is not a plain value (None, bool, int, float, str, or "
                                               "lists and str-keyed dicts of them)")
            raise TypeError(f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict(){plain}")


def _gpu_measurements(model: torch.nn.Module, optimizer: torch.optim.Optimizer, size_bytes: int) -> dict:
    """Tg, M and Mmax when the state lives on a GPU; empty on a CPU-only machine."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    live = list(model.parameters()) + tensors_in(optimizer.state_dict()["state"])
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


def _sharded_mode(model: torch.nn.Module, optimizer: torch.optim.Optimizer, storage: Any,
                  seams: EngineSeams | None, config: CheckFreqConfig) -> ShardedMode | None:
    """The sharded mode for a model with DTensor parameters (None: the plain engine);
    ValueError when the storage or the decision channel does not fit the model."""
    adapter = state_adapter(model, optimizer)
    if not adapter.sharded:
        return None
    rank, world_size = _rank_and_world()
    if seams is not None and not seams.takes_snapshots:
        raise ValueError(f"rank {rank}: EngineSeams(takes_snapshots=False) with a sharded model: every rank holds "
                         "a different piece of the state, so every rank snapshots and writes its own part")
    decisions = seams.decisions if seams is not None else LocalDecisions()
    if world_size > 1 and isinstance(decisions, LocalDecisions):
        raise ValueError(f"a sharded model on {world_size} ranks with LocalDecisions: every rank must checkpoint "
                         "the same iterations, so the decision channel must be shared (EngineSeams(decisions="
                         "...), e.g. ray_checkfreq.ray.decisions.BroadcastDecisions)")
    return ShardedMode(adapter=adapter, rank=rank, world_size=world_size, commit_wait_s=config.commit_wait_s)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _store_for(storage: str | CheckpointStore) -> CheckpointStore:
    return as_store(storage)


def _seams_for(seams: EngineSeams | None, sharded: ShardedMode | None) -> EngineSeams:
    """Sharded mode restores each rank's own RNG states (a new rank's seeded): the default
    setter becomes the rank-aware one (seed 0)."""
    seams = seams if seams is not None else EngineSeams()
    if sharded is None or seams.set_rng_state is not set_local_rng_state:
        return seams
    rank = sharded.rank
    return dataclasses.replace(seams, set_rng_state=lambda saved: set_own_rng(saved, rank=rank, seed=0))


def _forced_codec(compress: bool | None, store: CheckpointStore) -> str | None:
    """The codec fixed by configuration, or None to measure: a store set to raw stays raw."""
    if compress is None:
        return "raw" if store.config.codec == "raw" else None
    return "rcfz" if compress else "raw"
