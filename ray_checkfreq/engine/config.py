"""How often to checkpoint: ``CheckFreqConfig``, validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ray_checkfreq.engine.adaptive import AdaptiveConfig
from ray_checkfreq.engine.policy import MAX_OVERHEAD, lost_work_cap


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
    """p, the fraction of training time checkpoints may cost."""
    every: int | None = None
    """A fixed k in iterations; None: the policy picks k from a profile and adapts it."""
    epoch_len: int | None = None
    """Iterations per epoch (checkpoint at every epoch end; sizes the profiling window)."""
    profile_iters: int | None = None
    """Quiet iterations timed before the profiling checkpoints (None: 1 % of an epoch, at least 2, at most 50; 50
    without ``epoch_len``)."""
    mtbf_s: float | None = None
    """Mean time between losses that need a checkpoint, seconds, as you know it before the run
    (spot markets publish interruption frequencies): k then maximises expected goodput, and
    overhead may exceed p up to ``max_overhead``. None: p holds until a run-wide policy
    observes losses (Ray)."""
    max_overhead: float = MAX_OVERHEAD
    """The hard cap on overhead when the loss rate asks for more checkpoints than p allows."""
    restart_s: float = 60.0
    """Seconds a restart costs, restore apart, until one is measured (goodput's k)."""
    adaptive: bool = True
    """Adapt k at run time."""
    adaptive_config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    """How k adapts (``AdaptiveConfig``)."""
    checkpoint_epoch_end: bool = True
    """Also checkpoint at every epoch end."""
    reuse_profile: bool = True
    """Reuse the profile cached in the store when its fingerprint matches."""
    compress: bool | None = None
    """None: measure whether compression pays; True / False force it."""
    max_lost_fraction: float | None = 0.25
    """With ``epoch_len``: k at most this fraction of an epoch, even over p (unless under ``lost_work_floor_s``);
    None: no bound."""
    lost_work_floor_s: float = 10.0
    """Seconds: the lost-work bound never asks for k under this much work."""
    commit_wait_s: float = 120.0
    """Sharded mode: seconds rank 0's persist waits for every rank's part before the step counts as failed."""

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
        if not 0 < self.max_overhead < 1:
            raise ValueError(f"max_overhead={self.max_overhead!r}: must be a fraction in (0, 1); p applies if larger")
        if isinstance(self.restart_s, bool) or not self.restart_s >= 0:
            raise ValueError(f"restart_s={self.restart_s!r}: must be seconds >= 0")
        if self.compress not in (None, True, False):
            raise ValueError(f"compress={self.compress!r}: must be None (measure), True or False")
        fraction = self.max_lost_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ValueError(f"max_lost_fraction={fraction!r}: must be None or a fraction of an epoch in (0, 1]")
        if isinstance(self.lost_work_floor_s, bool) or not self.lost_work_floor_s >= 0:
            raise ValueError(f"lost_work_floor_s={self.lost_work_floor_s!r}: must be seconds >= 0")
        wait = self.commit_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < float("inf"):
            raise ValueError(f"commit_wait_s={wait!r}: must be seconds > 0")

    def k_cap(self, iter_s: float = 0.0) -> int | None:
        """The lost-work bound on the policy's k at iterations of ``iter_s`` (None: none)."""
        return lost_work_cap(self.epoch_len, self.max_lost_fraction, iter_s=iter_s, floor_s=self.lost_work_floor_s)

    def interval_options(self) -> dict[str, Any]:
        """What ``policy.choose_interval`` takes of this config beside p and the lost-work bound."""
        return {"mtbf_s": self.mtbf_s, "max_overhead": self.max_overhead, "restart_s": self.restart_s}

    def is_epoch_end(self, iteration: int) -> bool:
        """Whether ``iteration`` (1-based) ends an epoch."""
        return self.epoch_len is not None and iteration % self.epoch_len == 0

    def checkpoints_epoch_end(self, iteration: int) -> bool:
        """Whether ``iteration`` ends an epoch and epoch ends are checkpoints."""
        return self.checkpoint_epoch_end and self.is_epoch_end(iteration)

    def profiling_window(self) -> int:
        """min(1 % of an epoch, 50) iterations (at least 2, to time one iteration)."""
        if self.profile_iters is not None:
            return self.profile_iters
        if self.epoch_len is None:
            return 50
        return max(2, min(math.ceil(0.01 * self.epoch_len), 50))


def config_from(config: CheckFreqConfig | None, **args: Any) -> CheckFreqConfig:
    """The config, from ``config=`` or from the keyword arguments, never both."""
    given = {name: value for name, value in args.items() if value is not None or name == "max_lost_fraction"}
    if config is not None:
        if given:
            names = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise ValueError(f"CheckFreq(config=..., {names}): set these in the CheckFreqConfig instead, "
                             "not beside it")
        return config
    return CheckFreqConfig(**given)
