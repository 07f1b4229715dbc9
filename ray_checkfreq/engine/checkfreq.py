"""CheckFreq: two-phase checkpoints every k iterations, k chosen and adapted at run time.

    cf = CheckFreq(model=model, optimizer=opt, storage="s3://bucket/run1", data=loader,
                   extra_state={"sched": scheduler}, overhead=0.035, epoch_len=len(loader))
    start = cf.restore()
    for it in range(start, total):
        ...; loss.backward(); opt.step()   # waits for an in-flight snapshot by itself
        cf.step()
    cf.close()
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ray_checkfreq.engine.adaptive import AdaptiveConfig, AdaptiveRate
from ray_checkfreq.engine.persist import PersistResult, PersistWorker
from ray_checkfreq.engine.policy import Decision, Profile, choose_interval
from ray_checkfreq.engine.restore import check_model_state, check_optimizer_state
from ray_checkfreq.engine.snapshot import Snapshot, Snapshotter, tensors_in
from ray_checkfreq.storage import CheckpointStore

logger = logging.getLogger("ray_checkfreq.engine")

PROFILE_NAME = "checkfreq-profile.json"
_ASYNC_PARTS = {"model_params", "optimizer"}


@dataclass(frozen=True, kw_only=True)
class CheckFreqConfig:
    """How often to checkpoint. ``every`` fixes k; otherwise the policy picks it from p."""

    overhead: float = 0.035
    every: int | None = None
    epoch_len: int | None = None
    profile_iters: int | None = None
    mtbf_s: float | None = None
    adaptive: bool = True
    adaptive_config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    checkpoint_epoch_end: bool = True
    reuse_profile: bool = True

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
        overhead: float = 0.035,
        every: int | None = None,
        epoch_len: int | None = None,
        mtbf_s: float | None = None,
        adaptive: bool = True,
        profile_iters: int | None = None,
        config: CheckFreqConfig | None = None,
    ) -> None:
        self.config = config or CheckFreqConfig(
            overhead=overhead, every=every, epoch_len=epoch_len, mtbf_s=mtbf_s,
            adaptive=adaptive, profile_iters=profile_iters,
        )
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
        self._snapshotter = Snapshotter("cpu")
        self._persist = PersistWorker(self.store, on_done=self._persist_done)
        self._fence_handle: Any = None
        self._adaptive: AdaptiveRate | None = None
        self._k: int | None = self.config.every
        self._next_checkpoint: int | None = None
        self._profile_until: int | None = None
        self._compress = True
        self._last_step_t: float | None = None
        self._busy_since_last_step = False
        self._update_started = 0.0
        self._pending_stall = 0.0
        self._iter_samples: list[float] = []
        self._update_samples: list[float] = []
        self._stats = _Stats()
        self._hooks = [
            optimizer.register_step_pre_hook(self._before_update),
            optimizer.register_step_post_hook(self._after_update),
        ]
        self._closed = False

    # ----------------------------------------------------------------- restore
    def restore(self) -> int:
        """Load the newest valid checkpoint into everything; returns the iteration to resume at."""
        self._load_cached_profile()
        if not self.store.list():
            self._begin(0)
            return 0
        # Falls back past corrupt checkpoints; raises if there are checkpoints but none loads,
        # rather than silently starting over.
        state = self.store.load()
        check_model_state(self.model, state["model"])
        check_optimizer_state(self.optimizer, state["optimizer"], state["checkfreq"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in self.extra_state.items():
            obj.load_state_dict(state["extra"][name])
        if self.data is not None and state.get("data") is not None:
            self.data.load_state_dict(state["data"])
        _set_rng_state(state["rng"])
        iteration = int(state["checkfreq"]["iteration"])
        self._begin(iteration)
        logger.info("restored iteration %d from %s", iteration, self.store.uri)
        return iteration

    def _begin(self, iteration: int) -> None:
        self.iteration = iteration
        if self._k is not None:
            self._next_checkpoint = iteration + self._k
        else:
            self._profile_until = iteration + self.config.profiling_window()

    def _load_cached_profile(self) -> None:
        if self.config.every is not None or not self.config.reuse_profile:
            return
        cached = self.store.read_metadata(PROFILE_NAME)
        if not cached:
            return
        try:
            profile = Profile.from_json(cached["profile"])
        except (KeyError, TypeError, ValueError) as err:
            logger.warning("ignoring cached profile in %s: %s", self.store.uri, err)
            return
        self._apply_profile(profile)

    # -------------------------------------------------------------- each step
    def step(self) -> None:
        """Call once at the end of every iteration, after ``optimizer.step()``."""
        if self._closed:
            raise RuntimeError("CheckFreq is closed")
        if self._next_checkpoint is None and self._profile_until is None:
            self._begin(self.iteration)  # restore() was not called: start from 0
        now = time.perf_counter()
        self._persist.raise_if_failed()
        self.iteration += 1
        busy = self._busy_since_last_step or self._persist.busy
        if self._last_step_t is not None:
            self._observe(now - self._last_step_t, self._pending_stall, busy)
        self._pending_stall = 0.0
        if self._profile_until is not None and self.iteration >= self._profile_until:
            self._finish_profiling()  # a one-off cost, reported as profiling_s
        elif self._checkpoint_due():
            started = time.perf_counter()
            self._checkpoint(self._is_epoch_end())
            spent = time.perf_counter() - started
            self._pending_stall += spent
            self._stats.step_overhead_s += spent
        self._busy_since_last_step = self._persist.busy
        self._last_step_t = time.perf_counter()

    def _observe(self, iter_s: float, stall_s: float, busy: bool) -> None:
        self._stats.iter_time_total_s += iter_s
        if self._profile_until is not None:
            self._iter_samples.append(iter_s)
        elif self._adaptive is not None:
            new_k = self._adaptive.record(iter_s, stall_s, busy)
            if new_k is not None:
                logger.info("adaptive rate: k %d -> %d (overhead %.2f%%)", self._k, new_k,
                            100 * (self._adaptive.last_overhead or 0))
                self._k = new_k
                self._stats.k_changes.append((self.iteration, new_k))

    def _checkpoint_due(self) -> bool:
        if self._next_checkpoint is None:
            return False
        return self.iteration >= self._next_checkpoint or (
            self.config.checkpoint_epoch_end and self._is_epoch_end()
        )

    def _is_epoch_end(self) -> bool:
        epoch_len = self.config.epoch_len
        return epoch_len is not None and self.iteration % epoch_len == 0

    def _checkpoint(self, epoch_boundary: bool) -> None:
        waited = self._persist.wait_idle()  # one in flight: this wait is stall
        self._persist.raise_if_failed()
        snapshot = self._take_snapshot(epoch_boundary)
        self._fence_handle = snapshot.copies
        self._persist.submit(snapshot, codec="rcfz" if self._compress else "raw")
        self._stats.checkpoints_started += 1
        self._stats.persist_wait_s += waited
        assert self._k is not None
        self._next_checkpoint = self.iteration + self._k

    def _take_snapshot(self, epoch_boundary: bool) -> Snapshot:
        param_ptrs = {p.data_ptr() for p in self.model.parameters()}
        model_state = self.model.state_dict()
        live_params = {k: v for k, v in model_state.items() if v.data_ptr() in param_ptrs}
        live = {
            "model_params": live_params,
            "model_buffers": {k: v for k, v in model_state.items() if k not in live_params},
            "optimizer": self.optimizer.state_dict(),
            "extra": {name: obj.state_dict() for name, obj in self.extra_state.items()},
            "data": self.data.state_dict() if self.data is not None else None,
            "rng": _rng_state(),
            "checkfreq": {
                "iteration": self.iteration,
                "optimizer_class": type(self.optimizer).__qualname__,
                "k": self._k,
            },
        }
        snapshot = self._snapshotter.take(self.iteration, live, _ASYNC_PARTS, epoch_boundary=epoch_boundary)
        snapshot.state = _merge_model(snapshot.state, model_state)
        return snapshot

    # ------------------------------------------------------------------ fence
    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        handle = self._fence_handle
        if handle is not None:
            start = time.perf_counter()
            handle.fence()
            waited = time.perf_counter() - start
            self._pending_stall += waited
            self._stats.fence_wait_s += waited
            self._fence_handle = None
        self._update_started = time.perf_counter()

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._profile_until is not None:
            self._update_samples.append(time.perf_counter() - self._update_started)

    # -------------------------------------------------------------- profiling
    def _finish_profiling(self) -> None:
        """Measure a snapshot copy and a persist (with and without compression), then choose k."""
        start = time.perf_counter()
        self._persist.wait_idle()
        copy_start = time.perf_counter()
        snapshot = self._take_snapshot(self._is_epoch_end())
        snapshot.copies.wait()
        cpu_copy_s = time.perf_counter() - copy_start
        persist = {}
        for codec in ("raw", "rcfz"):
            self._persist.submit(snapshot, codec=codec)
            self._persist.wait_idle()
            self._persist.raise_if_failed()
            persist[codec] = self._stats.last_persist_s
        self._compress = persist["rcfz"] <= persist["raw"]
        iter_samples = self._iter_samples[1:] or self._iter_samples  # the first includes warm-up
        profile = Profile(
            iter_s=statistics.median(iter_samples) if iter_samples else 1e-3,
            update_s=statistics.median(self._update_samples) if self._update_samples else 0.0,
            cpu_copy_s=cpu_copy_s,
            persist_s=min(persist.values()),
            size_bytes=snapshot.size_bytes,
            compress=self._compress,
            **_gpu_measurements(self._live_tensors(), snapshot.size_bytes),
        )
        self._stats.profiling_s = time.perf_counter() - start
        self._stats.checkpoints_started += 2
        self._apply_profile(profile)
        self.store.write_metadata(PROFILE_NAME, {"profile": profile.to_json(), "decision": vars(self.decision)})

    def _live_tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + tensors_in(self.optimizer.state_dict()["state"])

    def _apply_profile(self, profile: Profile) -> None:
        self.profile = profile
        self.decision = choose_interval(profile, overhead=self.config.overhead, mtbf_s=self.config.mtbf_s)
        self._compress = profile.compress
        self._snapshotter.set_mode(self.decision.mode)
        self._k = self.decision.k
        self._profile_until = None
        self._next_checkpoint = self.iteration + self._k
        if self.config.adaptive:
            self._adaptive = AdaptiveRate(k=self._k, k_floor=self.decision.k, overhead=self.config.overhead,
                                          config=self.config.adaptive_config, reference_iter_s=profile.iter_s)
        logger.info("policy: mode=%s k=%d (kmin=%d, persist needs %d)", self.decision.mode, self._k,
                    self.decision.k_min, self.decision.k_persist)

    def _persist_done(self, result: PersistResult) -> None:
        self._stats.record_persist(result)

    # ----------------------------------------------------------------- ending
    def flush(self) -> float:
        """Block until the in-flight checkpoint is durable (say, on a preemption notice).

        Returns the seconds waited; raises a persist failure.
        """
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
            self._persist.close()
            self._persist.raise_if_failed()
        finally:
            self._snapshotter.close()

    def __enter__(self) -> CheckFreq:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict:
        """Mode, k, checkpoints, stall, overhead estimate, bytes written, compression, persist time."""
        s = self._stats
        committed = s.checkpoints_committed
        stall = s.fence_wait_s + s.step_overhead_s
        useful = max(s.iter_time_total_s - stall, 1e-12)
        return {
            "mode": self.decision.mode if self.decision else self._snapshotter.mode,
            "k": self._k,
            "iteration": self.iteration,
            "checkpoints_committed": committed,
            "stall_s_total": stall,
            "stall_s_per_checkpoint": stall / max(s.checkpoints_started, 1),
            "fence_wait_s": s.fence_wait_s,
            "persist_wait_s": s.persist_wait_s,
            "profiling_s": s.profiling_s,
            "overhead_estimate": (self._adaptive.last_overhead if self._adaptive and self._adaptive.last_overhead
                                  is not None else stall / useful),
            "bytes_written": s.stored_bytes,
            "compression_ratio": (s.stored_bytes / s.raw_bytes) if s.raw_bytes else None,
            "compress": self._compress,
            "last_persist_s": s.last_persist_s,
            "k_changes": list(s.k_changes),
            "expected_lost_s": self.decision.expected_lost_s if self.decision else None,
            "young_daly_k": self.decision.young_daly_k if self.decision else None,
        }


@dataclass
class _Stats:
    checkpoints_started: int = 0
    checkpoints_committed: int = 0
    fence_wait_s: float = 0.0
    persist_wait_s: float = 0.0
    profiling_s: float = 0.0
    step_overhead_s: float = 0.0  # time inside step() spent checkpointing, persist waits included
    iter_time_total_s: float = 0.0
    raw_bytes: int = 0
    stored_bytes: int = 0
    last_persist_s: float | None = None
    k_changes: list = field(default_factory=list)

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


def _check_stateful(name: str, obj: Any) -> None:
    if obj is None:
        return
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict()")


def _rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
