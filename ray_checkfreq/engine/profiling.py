"""The profiling window and the compression trial, as small state machines over timings.

Profiling (policy mode): quiet iterations first (no checkpoint work: Ti and Tw), then
real, committed checkpoints per codec tried (the first, cold one only warms buffers and
files, then ``WARM_SAMPLES`` warm ones), each timed over the training iterations that ran
beside its persist (at least ``MEASURE_ITERS``). Before each warm checkpoint, ``REFERENCE_ITERS``
fresh quiet iterations are its reference: what the busy iterations lost against them,
stalls included, is the checkpoint's cost as training feels it; the policy takes the
median over the warm checkpoints. Where they disagree wildly (a noisy machine: no
majority of them within 2x of their median cost or persist time, or half an
iteration), profiling measures more of them, up to ``MAX_WARM_SAMPLES``; if they still
disagree, it takes the largest of each figure: the larger, conservative k. Where a
majority agrees but the others cost more, the median can still hide what profiling's own
checkpoints measurably cost: where their mean cost would put the k chosen from the median
above p, k is chosen from the mean instead (``conservative`` in ``stats()["profiling"]``).
Either conservative figure is at most ``CONSERVATIVE_MAX_FACTOR`` x its median
(``bounded``): the adaptive rate raises k further within a window where the load stays.

So profiling takes, per codec it measures, 1 cold + 3 to 5 warm checkpoints (4 to 6);
a second codec (compression, only where it could pay) doubles that.

Compression trial (``every=k``): the first checkpoint is written raw; compression is
tried on the next one only where the raw persist outlasted the interval.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ray_checkfreq.engine.policy import (
    Decision,
    Profile,
    choose_interval,
    fixed_interval_codec,
    interference_s,
    interval_overhead,
    iteration_time_s,
    quiet_reference_s,
)
from ray_checkfreq.engine.snapshot import tensors_in
from ray_checkfreq.storage.stored_json import is_number

WARMUP_ITERS = 2
MIN_TI_SAMPLES = 5
# The busy window ends once the persist is done (and not before this many iterations):
# iterations after it carry no cost, only noise. With 10 fixed iterations against a
# ~0.6 s persist at 0.2 s iterations (`bench ray`), one sample's noise was as large as the
# cost it measured (0 to 0.2 s for the same checkpoint).
MEASURE_ITERS = 4
# A reference from the start of the window misled the policy: in `bench ray` the first
# quiet iterations after a start ran at 0.23-0.44 s (other processes still starting)
# against 0.2 s later, so every busy window looked free and k came out 5 where ~60 was
# needed. Each warm checkpoint is compared with the quiet iterations right before it.
REFERENCE_ITERS = 8
# Where checkpoint work never stops (epoch ends closer together than a persist takes), a
# warm checkpoint waits at most this many iterations for fresh quiet ones, then is
# compared with the newest quiet iterations there are.
REFERENCE_WAIT_ITERS = 2 * REFERENCE_ITERS
# One warm sample is at the mercy of the machine's noise: in `bench ray` (2 busy cores,
# 200 ms iterations) single samples put the first k anywhere from 6 to 68. The median of
# three is robust to one outlier.
WARM_SAMPLES = 3
MAX_WARM_SAMPLES = 5
DISAGREE_RATIO = 2.0  # a sample agrees with the median within this factor ...
DISAGREE_ITERS = 0.5  # ... or within this many iterations
# A conservative figure (the largest sample, or the mean cost) is at most this many times
# the median's (or half an iteration, if more): one sample that caught a neighbour's burst
# otherwise set k hundreds of iterations high, where no adaptation window closes within a
# run (bench overhead --noisy: k 407 for 900 iterations, p asked 1805). Where the load
# stays, the adaptive rate's proportional raise (up to 3x after one window) goes further.
CONSERVATIVE_MAX_FACTOR = 4.0


@dataclass(frozen=True)
class Measured:
    """One profiling checkpoint: its persist timings and the training time it cost."""

    codec: str
    copy_s: float
    persist_s: float
    size_bytes: int
    interference_s: float
    busy_iters: int = 0
    busy_s: float = 0.0
    reference_s: float = 0.0  # the mean quiet iteration it was compared with
    bound_s: float | None = None  # the most it could have cost: stalls + the persist's wall time
    inflation_s: float | None = None  # what the busy iterations lost, before the bound


@dataclass
class ProfilingWindow:
    """Collects quiet iterations, then the busy iterations of each measured checkpoint."""

    quiet_iters: int
    quiet: list[float] = field(default_factory=list)  # every quiet iteration (Ti)
    reference: list[float] = field(default_factory=list)  # the quiet ones since the last measured checkpoint
    next_codec: str | None = None  # measured once the reference is in (None: the first codec)
    waited: int = 0  # iterations since the last measured checkpoint, quiet or not
    updates: list[float] = field(default_factory=list)
    busy: list[float] | None = None
    busy_stall_s: float = 0.0  # the stalls within ``busy``
    codec: str | None = None
    measured: dict[str, Measured] = field(default_factory=dict)
    samples: dict[str, list[Measured]] = field(default_factory=dict)  # warm ones, per codec
    cold: set[str] = field(default_factory=set)  # codecs whose first (cold) checkpoint was discarded
    checkpoints: list[int] = field(default_factory=list)  # iterations of the checkpoints profiling asked for
    disagreed: dict[str, bool] = field(default_factory=dict)  # per codec: its warm samples still disagreed
    conservative: dict[str, bool] = field(default_factory=dict)  # per codec: k from the mean cost, not the median
    bounded: dict[str, bool] = field(default_factory=dict)  # per codec: a conservative figure was cut (4x median)

    def __post_init__(self) -> None:
        self.quiet_iters = max(self.quiet_iters, WARMUP_ITERS + MIN_TI_SAMPLES)

    @property
    def measuring(self) -> bool:
        return self.codec is not None

    def record_quiet(self, iter_s: float) -> bool:
        """True once enough quiet iterations are in to start measuring a checkpoint: the
        whole first window, then ``REFERENCE_ITERS`` fresh ones before each warm one."""
        self.quiet.append(iter_s)
        self.reference.append(iter_s)
        if not self.cold:  # the first window: its quiet iterations are the reference
            return len(self.quiet) >= self.quiet_iters
        return self.record_waiting()

    def record_waiting(self) -> bool:
        """One iteration between measured checkpoints; True once the next may start."""
        self.waited += 1
        return len(self.reference) >= REFERENCE_ITERS or self.waited >= REFERENCE_WAIT_ITERS

    def start_measuring(self, codec: str) -> None:
        self.codec = codec
        self.busy, self.busy_stall_s = [], 0.0
        self.next_codec = None

    def measure_next(self, codec: str) -> None:
        """Measure ``codec`` next, after fresh quiet iterations."""
        self.codec, self.busy = None, None
        self.next_codec = codec
        self.reference, self.waited = [], 0

    def record_busy(self, iter_s: float, persist_busy: bool, stall_s: float = 0.0) -> bool:
        """True once the persist is done and at least MEASURE_ITERS iterations ran beside it."""
        assert self.busy is not None
        self.busy.append(iter_s)
        self.busy_stall_s += stall_s
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
        self.measure_next(self.codec)

    def finish_measuring(self, copy_s: float, persist_s: float, size_bytes: int) -> Measured | None:
        """Record this warm checkpoint; once the codec has ``WARM_SAMPLES`` of them, its
        median figures (None before: measure another)."""
        assert self.codec is not None and self.busy is not None
        # On a shared machine the iteration time drifts by more than a checkpoint costs
        # over a window: the reference is the quiet iterations right before this one.
        fresh = len(self.reference) >= REFERENCE_ITERS
        reference = (self.reference if fresh else self.quiet)[-REFERENCE_ITERS:]
        codec, samples = self.codec, self.samples.setdefault(self.codec, [])
        # A checkpoint costs training at most its stalls plus the time its persist ran
        # beside training: a pause in the busy window (evaluation, a data stall, another
        # job's turn) is not its cost. Uncapped, one 0.2 s pause per window took k from
        # ~25 to ~400 here (a benchmark's baseline block ran inside every busy window).
        inflation = interference_s(reference, self.busy)
        bound = self.busy_stall_s + copy_s + persist_s
        samples.append(Measured(codec=codec, copy_s=copy_s, persist_s=persist_s, size_bytes=size_bytes,
                                interference_s=min(inflation, bound), busy_iters=len(self.busy),
                                busy_s=sum(self.busy), reference_s=quiet_reference_s(reference),
                                bound_s=bound, inflation_s=inflation))
        disagree = samples_disagree(samples, iter_s=self.iter_s())
        if len(samples) < WARM_SAMPLES or (disagree and len(samples) < MAX_WARM_SAMPLES):
            self.measure_next(codec)
            return None
        self.codec, self.busy = None, None
        self.disagreed[codec] = disagree
        if disagree:
            self.measured[codec], self.bounded[codec] = _upper_measurement(samples, iter_s=self.iter_s())
        else:
            self.measured[codec] = _median_measurement(samples)
        return self.measured[codec]

    def summary(self) -> dict:
        """What profiling measured, for ``stats()``: the quiet iterations and every warm sample."""
        return {"quiet_s": [round(t, 6) for t in self.quiet],
                "samples": {codec: [asdict(sample) for sample in samples] for codec, samples in self.samples.items()},
                "checkpoints": list(self.checkpoints), "disagreed": dict(self.disagreed),
                "conservative": dict(self.conservative), "bounded": dict(self.bounded),
                "mean_cost_s": {codec: round(self.mean_cost_s(codec), 6) for codec in self.samples}}

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
               options: Mapping[str, Any], k_cap: int | None = None) -> tuple[Profile, Decision]:
        """The profile and k from ``measured``; the conservative k where what the warm
        checkpoints cost on average would put the chosen k above p."""
        profile = self.profile(measured, gpu)
        decision = choose_interval(profile, overhead=overhead, k_cap=k_cap, **options)
        mean = self.mean_cost_s(measured.codec)
        median = statistics.median(sample.interference_s for sample in self.samples.get(measured.codec, [measured]))
        spent = min(mean, conservative_bound(median, iter_s=profile.iter_s))
        heavier = replace(profile, interference_s=max(spent, profile.interference_s))
        self.conservative[measured.codec] = interval_overhead(heavier, decision.overhead_s, decision.k) > overhead
        if not self.conservative[measured.codec]:
            return profile, decision
        self.bounded[measured.codec] = self.bounded.get(measured.codec, False) or spent < mean
        return heavier, choose_interval(heavier, overhead=overhead, k_cap=k_cap, **options)

    def mean_cost_s(self, codec: str) -> float:
        """What the warm checkpoints of ``codec`` cost training on average: the overhead
        profiling itself measured, per checkpoint (0 without samples)."""
        samples = self.samples.get(codec, [])
        return statistics.fmean(sample.interference_s for sample in samples) if samples else 0.0


def samples_disagree(samples: list[Measured], *, iter_s: float) -> bool:
    """Whether the warm samples have no majority near their median, in cost or in persist
    time (near: within ``DISAGREE_RATIO`` x the median, or ``DISAGREE_ITERS`` iterations)."""
    for name in ("interference_s", "persist_s"):
        values = [getattr(sample, name) for sample in samples]
        center = statistics.median(values)
        agreeing = sum(center / DISAGREE_RATIO <= value <= center * DISAGREE_RATIO
                       or abs(value - center) <= DISAGREE_ITERS * iter_s for value in values)
        if 2 * agreeing <= len(values):
            return True
    return False


def conservative_bound(median: float, *, iter_s: float) -> float:
    """The most a conservative figure may be: ``CONSERVATIVE_MAX_FACTOR`` x the median's,
    or x half an iteration where the median is smaller."""
    return CONSERVATIVE_MAX_FACTOR * max(median, DISAGREE_ITERS * iter_s)


def _upper_measurement(samples: list[Measured], *, iter_s: float) -> tuple[Measured, bool]:
    """The largest of each figure, each at most ``conservative_bound`` of its median: the
    conservative k when the samples disagree; True where a bound cut one."""
    cut = False

    def largest(name: str) -> float:
        nonlocal cut
        values = [getattr(sample, name) for sample in samples]
        bound = conservative_bound(statistics.median(values), iter_s=iter_s)
        cut = cut or max(values) > bound
        return min(max(values), bound)

    measured = Measured(codec=samples[0].codec, copy_s=largest("copy_s"), persist_s=largest("persist_s"),
                        size_bytes=samples[-1].size_bytes, interference_s=largest("interference_s"),
                        busy_iters=round(max(sample.busy_iters for sample in samples)),
                        busy_s=max(sample.busy_s for sample in samples),
                        reference_s=statistics.median(sample.reference_s for sample in samples))
    return measured, cut


def _median_measurement(samples: list[Measured]) -> Measured:
    def median(name: str) -> float:
        return statistics.median(getattr(sample, name) for sample in samples)

    return Measured(codec=samples[0].codec, copy_s=median("copy_s"), persist_s=median("persist_s"),
                    size_bytes=samples[-1].size_bytes, interference_s=median("interference_s"),
                    busy_iters=round(median("busy_iters")), busy_s=median("busy_s"), reference_s=median("reference_s"))


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


# The cached profile's fields and the JSON types each may hold (checked before Profile
# sees them: a string where a number belongs would fail only later, mid-training).
_PROFILE_NUMBERS = ("iter_s", "update_s", "cpu_copy_s", "persist_s", "size_bytes", "peak_memory_bytes",
                    "total_memory_bytes", "interference_s")
_MAX_SECONDS_OR_BYTES = 1e18


def cached_profile(document: Any) -> tuple[Profile, Any]:
    """(profile, fingerprint) of a cached profile document (``store.read_metadata``);
    ValueError naming the first field whose type or range is wrong."""
    if not isinstance(document, dict) or not isinstance(document.get("profile"), dict):
        raise ValueError("expected an object with a 'profile' object")
    fields = document["profile"]
    for name in _PROFILE_NUMBERS:
        value = fields.get(name, 0)
        if not is_number(value) or not 0 <= value <= _MAX_SECONDS_OR_BYTES:
            raise ValueError(f"profile field {name}={value!r:.60}: not a number in [0, {_MAX_SECONDS_OR_BYTES:g}]")
    gpu_copy_s = fields.get("gpu_copy_s")
    if gpu_copy_s is not None and (not is_number(gpu_copy_s) or not 0 <= gpu_copy_s <= _MAX_SECONDS_OR_BYTES):
        raise ValueError(f"profile field gpu_copy_s={gpu_copy_s!r:.60}: not null or a number")
    if not isinstance(fields.get("compress", True), bool):
        raise ValueError(f"profile field compress={fields.get('compress')!r:.60}: not a bool")
    return Profile.from_json(fields), document.get("fingerprint")


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
