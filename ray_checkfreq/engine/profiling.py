"""The profiling window and the compression trial, as small state machines over timings.

Profiling (policy mode): quiet iterations first (no checkpoint work: Ti and Tw), then
real, committed checkpoints per codec tried (the first, cold one only warms buffers and
files, then ``WARM_SAMPLES`` warm ones), each persist running beside at least
``MEASURE_ITERS`` training iterations. What those iterations lost against quiet ones,
stalls included, is the checkpoint's cost as training feels it; the policy takes the
median over the warm checkpoints.

Compression trial (``every=k``): the first checkpoint is written raw; compression is
tried on the next one only where the raw persist outlasted the interval.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from ray_checkfreq.engine.policy import (
    Decision,
    Profile,
    choose_interval,
    fixed_interval_codec,
    interference_s,
    iteration_time_s,
)
from ray_checkfreq.engine.snapshot import tensors_in

WARMUP_ITERS = 2
MIN_TI_SAMPLES = 5
MEASURE_ITERS = 10
REFERENCE_ITERS = 10
# One warm sample is at the mercy of the machine's noise: in `bench ray` (2 busy cores,
# 200 ms iterations) single samples put the first k anywhere from 6 to 68. The median of
# three is robust to one outlier.
WARM_SAMPLES = 3


@dataclass(frozen=True)
class Measured:
    """One profiling checkpoint: its persist timings and the training time it cost."""

    codec: str
    copy_s: float
    persist_s: float
    size_bytes: int
    interference_s: float


@dataclass
class ProfilingWindow:
    """Collects quiet iterations, then the busy iterations of each measured checkpoint."""

    quiet_iters: int
    quiet: list[float] = field(default_factory=list)
    updates: list[float] = field(default_factory=list)
    busy: list[float] | None = None
    codec: str | None = None
    measured: dict[str, Measured] = field(default_factory=dict)
    samples: dict[str, list[Measured]] = field(default_factory=dict)  # warm ones, per codec
    cold: set[str] = field(default_factory=set)  # codecs whose first (cold) checkpoint was discarded

    def __post_init__(self) -> None:
        self.quiet_iters = max(self.quiet_iters, WARMUP_ITERS + MIN_TI_SAMPLES)

    @property
    def measuring(self) -> bool:
        return self.codec is not None

    def record_quiet(self, iter_s: float) -> bool:
        """True once enough quiet iterations are in to start measuring a checkpoint."""
        self.quiet.append(iter_s)
        return len(self.quiet) >= self.quiet_iters

    def start_measuring(self, codec: str) -> None:
        self.codec = codec
        self.busy = []

    def record_busy(self, iter_s: float, persist_busy: bool) -> bool:
        """True once the persist is done and at least MEASURE_ITERS iterations ran beside it."""
        assert self.busy is not None
        self.busy.append(iter_s)
        return not persist_busy and len(self.busy) >= MEASURE_ITERS

    def needs_warm_measurement(self) -> bool:
        """True when the checkpoint just measured was this codec's first (a cold one).

        A codec's first checkpoint pays one-off costs that later ones do not: the snapshot
        buffers are allocated and faulted in, the store's files and the page cache are
        new. Measured here at 100 MB, that made the cold cost ~10x the steady one and the
        first k far above where the adaptive rate settled, so the policy decides from a
        second, warm checkpoint of the same codec.
        """
        assert self.codec is not None
        return self.codec not in self.cold

    def discard_cold(self) -> None:
        assert self.codec is not None
        self.cold.add(self.codec)
        self.codec, self.busy = None, None

    def finish_measuring(self, copy_s: float, persist_s: float, size_bytes: int) -> Measured | None:
        """Record this warm checkpoint; once the codec has ``WARM_SAMPLES`` of them, its
        median figures (None before: measure another)."""
        assert self.codec is not None and self.busy is not None
        # The quiet iterations right before the checkpoint are the reference: on a shared
        # machine the iteration time drifts by more than a checkpoint costs over a window.
        reference = self.quiet[WARMUP_ITERS:][-REFERENCE_ITERS:]
        codec, samples = self.codec, self.samples.setdefault(self.codec, [])
        samples.append(Measured(codec=codec, copy_s=copy_s, persist_s=persist_s, size_bytes=size_bytes,
                                interference_s=interference_s(reference, self.busy)))
        self.codec, self.busy = None, None
        if len(samples) < WARM_SAMPLES:
            return None
        self.measured[codec] = _median_measurement(samples)
        return self.measured[codec]

    def iter_s(self) -> float:
        return iteration_time_s(self.quiet, warmup=WARMUP_ITERS)

    def update_s(self) -> float:
        kept = sorted(self.updates[WARMUP_ITERS:] or self.updates)
        return kept[len(kept) // 2] if kept else 0.0

    def profile(self, measured: Measured, gpu: dict[str, Any]) -> Profile:
        return Profile(iter_s=self.iter_s(), update_s=self.update_s(), cpu_copy_s=measured.copy_s,
                       persist_s=measured.persist_s, size_bytes=measured.size_bytes,
                       compress=measured.codec == "rcfz", interference_s=measured.interference_s, **gpu)

    def decide(self, measured: Measured, gpu: dict[str, Any], overhead: float,
               mtbf_s: float | None) -> tuple[Profile, Decision]:
        profile = self.profile(measured, gpu)
        return profile, choose_interval(profile, overhead=overhead, mtbf_s=mtbf_s)


def _median_measurement(samples: list[Measured]) -> Measured:
    def median(name: str) -> float:
        return statistics.median(getattr(sample, name) for sample in samples)

    return Measured(codec=samples[0].codec, copy_s=median("copy_s"), persist_s=median("persist_s"),
                    size_bytes=samples[-1].size_bytes, interference_s=median("interference_s"))


@dataclass
class CodecTrial:
    """With a fixed k: raw first; compressed once, only if the raw persist outlasted k * Ti."""

    decided: str | None = None
    persist_s: dict[str, float] = field(default_factory=dict)

    def next_codec(self) -> str:
        if self.decided is not None:
            return self.decided
        return "rcfz" if "raw" in self.persist_s else "raw"

    def record(self, codec: str, persist_s: float, interval_s: float) -> None:
        if self.decided is not None:
            return
        self.persist_s[codec] = persist_s
        if codec == "raw" and persist_s <= interval_s:
            self.decided = "raw"
        elif len(self.persist_s) == 2:
            self.decided = fixed_interval_codec(self.persist_s, interval_s)


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, store_codec: dict) -> dict:
    """What a cached profile depends on: re-profile when any of it changed."""
    tensors = list(model.state_dict().values()) + tensors_in(optimizer.state_dict()["state"])
    return {
        "state_bytes": sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)),
        "device": _device_name(model),
        "world_size": _world_size(),
        "codec": store_codec,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def fingerprint_changes(cached: Any, current: dict) -> list[str]:
    """Names of the fields that differ (all of them when there is no usable cached one)."""
    if not isinstance(cached, dict):
        return sorted(current)
    return sorted(k for k in current if cached.get(k) != current[k])


def _device_name(model: torch.nn.Module) -> str:
    param = next(iter(model.parameters()), None)
    if param is None or param.device.type != "cuda":
        return "cpu" if param is None else param.device.type
    return f"cuda:{torch.cuda.get_device_name(param.device)}"


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1
