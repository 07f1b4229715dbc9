"""A simulated machine for the engine: a clock the loop advances, a persister whose
duration is drawn, and iterations slowed while a persist runs beside them.

The engine runs for real (snapshots, plans, policy, adaptive rate) but reads time from
``SimClock`` (``EngineSeams.clock``), so a run of thousands of 100 ms iterations takes a
second or two and is the same every time for a seed. The same drawn iteration times
without checkpoints give the ground truth to compare its overhead figures with.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ray_checkfreq.engine import CheckFreq, EngineSeams, PersistResult


class SimClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class SimPersister:
    """Phase 2 in simulated time: a persist submitted at t is done at t + ``duration()``."""

    def __init__(self, clock: SimClock, duration: Callable[[], float], on_done) -> None:
        self.clock, self.duration, self.on_done = clock, duration, on_done
        self.finish: float | None = None
        self.pending: tuple | None = None
        self.persists: list[float] = []

    @property
    def busy(self) -> bool:
        if self.pending is not None and self.clock.t >= self.finish:
            self._complete()
        return self.pending is not None

    def submit(self, snapshot, **options) -> None:
        assert not self.busy, "one persist in flight at most"
        seconds = self.duration()
        self.persists.append(seconds)
        self.finish = self.clock.t + seconds
        self.pending = (snapshot.step, seconds, options.get("codec") or "raw", snapshot.size_bytes)

    def wait_idle(self) -> float:
        if not self.busy:
            return 0.0
        waited = self.finish - self.clock.t
        self.clock.advance(waited)
        self._complete()
        return waited

    def remaining(self) -> float:
        return max(0.0, self.finish - self.clock.t) if self.busy else 0.0

    def _complete(self) -> None:
        step, seconds, codec, size = self.pending
        self.pending = None
        self.on_done(PersistResult(step=step, seconds=seconds, copy_s=0.0, codec=codec, raw_bytes=size,
                                   stored_bytes=size, uri=f"sim://{step}"))

    def raise_if_failed(self) -> None:
        return None

    def close(self) -> None:
        self.wait_idle()


@dataclass
class Machine:
    """Iteration and persist times of a machine, drawn from a seeded generator."""

    iter_s: float = 0.1
    jitter: float = 0.05  # relative, normal
    burst_p: float = 0.0  # chance an iteration is hit by a burst of other work
    burst_s: float = 0.0
    persist_s: float = 0.5
    tail_p: float = 0.0  # chance a persist is hit by a heavy-tailed delay
    tail_s: float = 0.0  # scale of that delay (Pareto, shape 2, at most 10x the scale)
    contention: float = 0.3  # iterations run this much slower while a persist runs beside them
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def iteration(self) -> float:
        base = self.iter_s * max(0.2, self.rng.gauss(1.0, self.jitter))
        if self.rng.random() < self.burst_p:
            base += self.burst_s
        return base

    def persist(self) -> float:
        seconds = self.persist_s
        if self.rng.random() < self.tail_p:
            seconds += self.tail_s * min(10.0, self.rng.paretovariate(2.0))
        return seconds


@dataclass
class SimRun:
    cf: CheckFreq
    clock: SimClock
    persister: SimPersister
    machine: Machine
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    base_s: list[float] = field(default_factory=list)  # each iteration's time without checkpoints
    wall_s: list[float] = field(default_factory=list)  # each iteration's time as run (step to step)
    ks: list[int | None] = field(default_factory=list)
    pauses: dict[int, float] = field(default_factory=dict)  # after iteration i: a pause (evaluation)

    def run(self, iterations: int, machine: Machine | None = None) -> None:
        machine = machine or self.machine
        x = torch.ones(2, 4)
        for _ in range(iterations):
            before = self.clock.t
            base = machine.iteration() + self.pauses.get(self.cf.iteration, 0.0)
            overlap = min(base, self.persister.remaining())  # the persist slows what runs beside it
            self.clock.advance(base + machine.contention * overlap)
            self.opt.zero_grad()
            self.model(x).sum().backward()
            self.opt.step()
            self.cf.step()
            self.base_s.append(base)
            self.wall_s.append(self.clock.t - before)
            self.ks.append(self.cf.applied_k)

    def run_toggling(self, iterations: int, quiet: Machine, loaded: Machine, *, period_s: float) -> None:
        """A noisy neighbour: ``quiet``, then ``loaded`` (iterations and persists drawn from
        it), each for ``period_s`` of its iterations, and so on."""
        done, now = 0, quiet
        while done < iterations:
            count = min(iterations - done, max(1, round(period_s / now.iter_s)))
            self.persister.duration = now.persist
            self.run(count, now)
            done += count
            now = loaded if now is quiet else quiet
        self.persister.duration = self.machine.persist

    def truth(self, start: int = 0, stop: int | None = None) -> float:
        """Wall-clock overhead against the same iterations without checkpoints."""
        return sum(self.wall_s[start:stop]) / sum(self.base_s[start:stop]) - 1


def sim_run(tmp_path, machine: Machine, **options) -> SimRun:
    clock = SimClock()
    made: list[SimPersister] = []

    def persister(store, on_done):
        made.append(SimPersister(clock, machine.persist, on_done))
        return made[-1]

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    options.setdefault("compress", False)
    cf = CheckFreq(model=model, optimizer=opt, storage=str(tmp_path / "store"),
                   seams=EngineSeams(clock=clock, persister=persister), **options)
    cf.restore()
    return SimRun(cf=cf, clock=clock, persister=made[0], machine=machine, model=model, opt=opt)
