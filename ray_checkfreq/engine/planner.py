"""The planner: what to do right after an iteration, decided from what was measured.

Pure: no I/O, no threads, no tensors. It is fed plain figures (iteration times and stalls
by ``observe``, optimizer-update times by ``record_update``, persist results by
``record_persist``, a cached profile by ``adopt_cached_profile``, a k decided elsewhere by
``set_k``) and ``plan`` returns the ``Action`` for an iteration: nothing, a new k, a
checkpoint (the interval's, an epoch end's, profiling's) or a checkpoint and stop.

Until k is known it runs the profiling window (profiling.py); then the policy
(policy.py) picks k, the adaptive rate (adaptive.py) moves it, and the lost-work bound
caps it. What it adds to the statistics (k history, checkpoints by cause) goes into the
``EngineStats`` it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ray_checkfreq.engine.adaptive import AdaptiveRate
from ray_checkfreq.engine.config import CheckFreqConfig
from ray_checkfreq.engine.persist import PersistResult
from ray_checkfreq.engine.policy import Decision, Profile, choose_codec, choose_interval, compression_could_pay
from ray_checkfreq.engine.profiling import WARMUP_ITERS, CodecTrial, ProfilingWindow
from ray_checkfreq.engine.seams import Action
from ray_checkfreq.engine.stats import EngineStats

logger = logging.getLogger("ray_checkfreq.engine")

_Planned = tuple[bool, str]  # a planned checkpoint: (epoch boundary, codec)
# Tg, M and Mmax of a checkpoint of this many bytes (empty without a GPU): the one figure
# the planner cannot take from a persist result, asked for as profiling decides.
GpuMeasurements = Callable[[int], dict]


def no_gpu(size_bytes: int) -> dict:
    return {}


@dataclass
class _ProfilingRun:
    """The profiling window and where the planner is in it."""

    window: ProfilingWindow
    quiet_done: bool = False  # enough quiet iterations: measure a checkpoint next
    measure_done: bool = False  # the measured checkpoint's busy window is complete
    measure_from: int = 0  # the measured checkpoint's iteration: busy iterations are those after it
    measured_at: int = -1  # the iteration of the checkpoint being measured
    measured_result: PersistResult | None = None
    measured_before: bool = False  # its persist was done before the iteration being timed began

    def observe(self, iteration: int, iter_s: float, stall_s: float, busy: bool) -> None:
        window = self.window
        if window.measuring:  # until the measured persist is done (not a later epoch-end one)
            if iteration > self.measure_from:  # planned ahead: only once it was taken
                self.measure_done = window.record_busy(iter_s, persist_busy=not self.measured_before,
                                                       stall_s=stall_s)
        elif not busy and stall_s == 0:  # after an epoch-end checkpoint, wait for quiet again
            self.quiet_done = window.record_quiet(iter_s)
        elif window.cold:  # between warm checkpoints, bounded (not in the first window)
            self.quiet_done = window.record_waiting()

    def start_measuring(self, at: int, codec: str) -> None:
        self.window.start_measuring(codec)
        self.measured_result = None
        self.measured_at = self.measure_from = at
        self.window.checkpoints.append(at)

    def epoch_end_codec(self, trial: CodecTrial) -> str:
        """The codec of a checkpoint profiling did not ask for (an epoch end's)."""
        if self.window.measuring:
            assert self.window.codec is not None
            return self.window.codec
        return trial.decided or "raw"


class Planner:
    """Plans every iteration's ``Action``; holds the policy (``decision``, ``profile``, ``k``)."""

    def __init__(self, config: CheckFreqConfig, *, stats: EngineStats, local_adaptive: bool = True,
                 forced_codec: str | None = None, gpu_measurements: GpuMeasurements = no_gpu) -> None:
        """``local_adaptive=False``: k adapts elsewhere (``set_k``). ``forced_codec``: the
        codec fixed by configuration (None: measure whether compression pays)."""
        self.config = config
        self.stats = stats
        self.decision: Decision | None = None
        self.profile: Profile | None = None
        self.k: int | None = config.every
        self.adaptive: AdaptiveRate | None = None
        self.codec_trial = CodecTrial(decided=forced_codec)
        self._adapts = config.adaptive and local_adaptive
        self._gpu_measurements = gpu_measurements
        self._now = 0  # the last iteration counted
        self._planned_k = config.every  # the k the last planned action carried
        self._next_checkpoint: int | None = None
        self._stop_planned = False
        self._requested_at: int | None = None  # a checkpoint asked for out of turn (a notice's)
        self._profiling: _ProfilingRun | None = None
        self._last_result: PersistResult | None = None
        self._new_profile: Profile | None = None

    def begin(self, iteration: int, *, profiles: bool = True) -> None:
        """The run starts after ``iteration``: the first checkpoint is k later, or (without k,
        ``profiles``) the profiling window starts."""
        self._now = iteration
        if self.k is not None:
            self._next_checkpoint = iteration + self.k
        elif profiles:
            self._profiling = _ProfilingRun(ProfilingWindow(quiet_iters=self.config.profiling_window()))

    @property
    def policy_ready(self) -> bool:
        """Whether the policy decided k (profiling done, or a cached profile adopted)."""
        return self.decision is not None and self._profiling is None

    @property
    def measuring_cost(self) -> bool:
        """Whether profiling is timing the iterations beside a checkpoint (its cost) now."""
        return self._profiling is not None and self._profiling.window.measuring

    # ------------------------------------------------------------- measured
    def observe(self, iteration: int, iter_s: float, stall_s: float, busy: bool) -> None:
        """Iteration ``iteration`` took ``iter_s`` seconds, ``stall_s`` of them checkpoint work;
        ``busy``: a persist ran during some of it. Counted in the statistics (after warm-up)."""
        self._now = iteration
        self.stats.record_iteration(iter_s, stall_s, busy, warm=self.stats.since_start(iteration) > WARMUP_ITERS)
        if self._profiling is not None:
            self._profiling.observe(iteration, iter_s, stall_s, busy)
        elif self.adaptive is not None:
            new_k = self.adaptive.record(iter_s, stall_s, busy)
            if new_k is not None:
                overhead, error = self.adaptive.pooled_overhead or 0.0, self.adaptive.pooled_error or 0.0
                logger.info("adaptive rate: k %s -> %d (measured overhead %.2f%% +- %.2f)", self.k, new_k,
                            100 * overhead, 100 * error)
                self.stats.note_k(iteration, new_k, f"measured overhead {overhead:.2%} +- {error:.2%}")
                self.k = new_k  # recorded in k_changes when the action carrying it is applied

    def record_update(self, seconds: float) -> None:
        """One ``optimizer.step()`` took ``seconds`` (Tw, timed in the quiet iterations)."""
        if self._profiling is not None and not self._profiling.window.measuring:
            self._profiling.window.updates.append(seconds)

    def record_persist(self, result: PersistResult) -> None:
        """A checkpoint is durable."""
        self._last_result = result
        if self.adaptive is not None:
            self.adaptive.record_persist(result.seconds)
        if self._profiling is not None and result.step == self._profiling.measured_at:
            self._profiling.measured_result = result

    def end_step(self) -> None:
        """The step is over: a measured persist reported by now was done before the next iteration."""
        if self._profiling is not None:
            self._profiling.measured_before = self._profiling.measured_result is not None

    # ----------------------------------------------------------------- plan
    def plan(self, at: int, *, now: int, stop_at: int | None = None) -> Action | None:
        """What to do right after iteration ``at`` (``now`` counted so far). Its bookkeeping
        happens here, once, so the same checkpoint is never planned twice; None: nothing.
        ``stop_at``: checkpoint at this iteration (or the first one planned after it) and stop."""
        self._now = now
        if self._stop_planned:
            return None
        if stop_at is not None and at >= stop_at:
            self._stop_planned = True
            self.stats.count_checkpoint("stop")
            epoch_boundary, codec = self._plan_checkpoint(at, self.config.is_epoch_end(at))
            return Action(iteration=at, checkpoint=True, epoch_boundary=epoch_boundary, codec=codec, k=self.k,
                          stop=True)
        if self._requested_at is not None and at >= self._requested_at:
            self._requested_at = None
            self.stats.count_checkpoint("notice")
            self._planned_k = self.k
            epoch_boundary, codec = self._plan_checkpoint(at, self.config.is_epoch_end(at))
            return Action(iteration=at, checkpoint=True, epoch_boundary=epoch_boundary, codec=codec, k=self.k)
        checkpoint = self._advance_profiling(at) if self._profiling is not None else self._plan_due(at)
        if checkpoint is None and self.k == self._planned_k:
            return None
        self._planned_k = self.k
        if checkpoint is None:
            return Action(iteration=at, k=self.k)
        epoch_boundary, codec = checkpoint
        return Action(iteration=at, checkpoint=True, epoch_boundary=epoch_boundary, codec=codec, k=self.k)

    def request_checkpoint(self, at: int) -> None:
        """Checkpoint at iteration ``at`` (or the first one planned after it), once, whatever
        the interval says; the interval then counts from it."""
        if at < 0:
            raise ValueError(f"at={at!r}: must be >= 0")
        self._requested_at = at if self._requested_at is None else min(self._requested_at, at)

    def needs_settled_persist(self, at: int, *, now: int, stop_at: int | None = None) -> bool:
        """Whether planning ``at`` runs the compression trial on a checkpoint applied in this
        very step: that checkpoint waits for the persist in flight anyway, so the caller
        waits first and reports it (``record_persist``), for the trial to see its time."""
        if at != now or self.profile is not None or self.codec_trial.decided is not None or self._stop_planned:
            return False
        if stop_at is not None and at >= stop_at:
            return True
        return self._profiling is None and self._due(at)

    def take_new_profile(self) -> Profile | None:
        """The profile profiling just decided from (once), for the caller to cache."""
        profile, self._new_profile = self._new_profile, None
        return profile

    def _due(self, at: int) -> bool:
        if self._next_checkpoint is None:
            return False
        return at >= self._next_checkpoint or self.config.checkpoints_epoch_end(at)

    def _plan_due(self, at: int) -> _Planned | None:
        if not self._due(at):
            return None
        assert self._next_checkpoint is not None
        self.stats.count_checkpoint("interval" if at >= self._next_checkpoint else "epoch_end")
        return self._plan_checkpoint(at, self.config.is_epoch_end(at))

    def _plan_checkpoint(self, at: int, epoch_boundary: bool, codec: str | None = None) -> _Planned:
        if codec is None:
            codec = self._fixed_interval_codec()
        if self.k is not None:
            self._next_checkpoint = at + self.k
        return epoch_boundary, codec

    def _fixed_interval_codec(self) -> str:
        """The policy's codec, or with ``every``: raw until measurement says otherwise."""
        if self.profile is not None:
            return "rcfz" if self.profile.compress else "raw"
        result = self._last_result
        if result is not None and self.k is not None:
            self.codec_trial.record(result.codec, result.seconds, self.k * self.stats.iteration_s())
        return self.codec_trial.next_codec()

    # ------------------------------------------------------------ profiling
    def _advance_profiling(self, at: int) -> _Planned | None:
        """Quiet iterations, then measured checkpoints per codec worth trying, then k; an
        epoch end checkpoints whatever profiling is doing."""
        run = self._profiling
        assert run is not None
        window = run.window
        if window.measuring and run.measure_done:
            run.measure_done = False
            if run.measured_result is None:  # that persist failed (raised at a step): measure another
                assert window.codec is not None
                return self._start_measuring(run, at, window.codec)
            self._finish_measuring(run, run.measured_result)
        elif not window.measuring and run.quiet_done:
            run.quiet_done = False
            return self._start_measuring(run, at, window.next_codec or self.codec_trial.decided or "raw")
        if not self.config.checkpoints_epoch_end(at):
            return None
        self.stats.count_checkpoint("epoch_end")
        # Just decided: the policy's codec.
        codec = None if self._profiling is None else run.epoch_end_codec(self.codec_trial)
        return self._plan_checkpoint(at, True, codec=codec)

    def _start_measuring(self, run: _ProfilingRun, at: int, codec: str) -> _Planned:
        run.start_measuring(at, codec)
        self.stats.count_checkpoint("profiling")
        return self._plan_checkpoint(at, self.config.is_epoch_end(at), codec=codec)

    def _finish_measuring(self, run: _ProfilingRun, result: PersistResult) -> None:
        """Decide from what was measured, or measure another checkpoint first (each after
        fresh quiet iterations): a warm one after the cold one, the next warm sample, or
        the compressed codec."""
        window = run.window
        if window.needs_warm_measurement():
            window.discard_cold()
            return
        measured = window.finish_measuring(result.copy_s, result.seconds - result.copy_s, result.raw_bytes)
        if measured is None:  # fewer than WARM_SAMPLES yet
            return
        self.stats.profiling_s += sum(sample.interference_s for sample in window.samples[measured.codec])
        gpu = self._gpu_measurements(measured.size_bytes)
        k_cap = self.config.k_cap(window.iter_s())
        decisions = {codec: window.decide(m, gpu, self.config.overhead, self.config.interval_options(), k_cap)
                     for codec, m in window.measured.items()}
        if (measured.codec == "raw" and self.codec_trial.decided is None
                and compression_could_pay(decisions["raw"][1], measured.size_bytes)):
            window.measure_next("rcfz")
            return
        codec = choose_codec({c: d for c, (_, d) in decisions.items()}) if "raw" in decisions else measured.codec
        self.stats.profiling = window.summary()
        self._profiling = None
        self._adopt(decisions[codec][0], first_checkpoint=run.measured_at)
        self._new_profile = decisions[codec][0]

    # ---------------------------------------------------------------- policy
    def adopt_cached_profile(self, profile: Profile, *, now: int) -> None:
        """A cached profile still fits (its fingerprint unchanged): skip profiling."""
        if self._profiling is None:
            return
        self._now = now
        self._profiling = None
        self._adopt(profile, first_checkpoint=self._now)

    def set_k(self, k: int, *, now: int) -> None:
        """A k decided elsewhere (a policy shared by all ranks). The next planned action
        carries it, so every rank switches at the same iteration; the next checkpoint moves
        to the last one + k. Ignored before the policy decided."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k={k!r}: must be an int >= 1")
        if not self.policy_ready or self.k is None or k == self.k:
            return
        if self._next_checkpoint is not None:
            self._next_checkpoint += k - self.k
        self.k = k
        self.stats.note_k(now, k, "shared policy")
        if self.adaptive is not None:
            self.adaptive.restart_at(k)

    def _adopt(self, profile: Profile, *, first_checkpoint: int) -> None:
        self.profile = profile
        k_cap = self.config.k_cap(profile.iter_s)
        self.decision = decision = choose_interval(profile, overhead=self.config.overhead, k_cap=k_cap,
                                                   **self.config.interval_options())
        self.k = decision.k
        self._next_checkpoint = first_checkpoint + decision.k
        self.stats.run_overhead.fallback_ref_s = self.stats.run_overhead.fallback_ref_s or profile.iter_s
        self.stats.note_k(self._now, decision.k, "profile")
        _log_policy(self.config, profile, decision)
        if self._adapts:
            self.adaptive = AdaptiveRate(k=decision.k, k_floor=decision.k_floor,
                                         overhead=max(self.config.overhead, decision.target_overhead),
                                         config=self.config.adaptive_config, reference_iter_s=profile.iter_s,
                                         k_cap=k_cap)
            if self._last_result is not None:  # profiling's last persist: the floor from the start
                self.adaptive.record_persist(self._last_result.seconds)


def _log_policy(config: CheckFreqConfig, profile: Profile, decision: Decision) -> None:
    k = decision.k
    if decision.bound in ("goodput", "cap"):
        logger.info("k = %d set by %s: the loss rate (mtbf_s = %s s) makes it worth %.1f%% overhead (p = %.1f%%, "
                    "max_overhead = %.1f%%)", k, decision.bound, config.mtbf_s, 100 * decision.expected_overhead,
                    100 * config.overhead, 100 * config.max_overhead)
    if decision.capped:
        logger.warning("k = %d, not the %d that p = %.1f%% asks for: at most max_lost_fraction = %s of a "
                       "%s-iteration epoch may be lost to a failure; the model expects %.1f%% overhead "
                       "here. Raise max_lost_fraction (None: no bound) to keep p, or fix k with every=.",
                       k, decision.k_uncapped, 100 * config.overhead, config.max_lost_fraction,
                       config.epoch_len, 100 * decision.expected_overhead)
    epoch_len = config.epoch_len
    if epoch_len is not None and k > epoch_len and config.checkpoint_epoch_end:
        logger.warning("k = %d is longer than an epoch (%d iterations): a failure resumes at the last epoch "
                       "end, up to %.1f s of work (within lost_work_floor_s = %s s). Fix k with every= to "
                       "checkpoint within epochs.", k, epoch_len, epoch_len * profile.iter_s,
                       config.lost_work_floor_s)
    logger.info("policy: mode=%s k=%d (kmin=%d, persist needs %d, measured cost %.0f ms needs %d), %s",
                decision.mode, k, decision.k_min, decision.k_persist, 1e3 * decision.cost_s, decision.k_cost,
                "compressed" if profile.compress else "raw")
