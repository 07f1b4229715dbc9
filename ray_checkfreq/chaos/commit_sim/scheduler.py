"""A seeded, deterministic scheduler of actors that run real store code.

Every actor is a greenlet. It runs until it reaches a yield point (each storage operation
is one: ``SimBackend`` calls ``Scheduler.yield_point``), and the scheduler then picks the
next actor to run with its seeded random generator. So one seed is one interleaving,
reproduced exactly. A killed actor is never resumed: what it wrote so far stays, as after
a SIGKILL, and none of its clean-up runs. A paused actor (a zombie) is left out of the
choice for a while, then runs on.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import greenlet


class Killed(BaseException):
    """Raised inside a killed actor's greenlet so that it unwinds without touching storage."""


@dataclass(eq=False)
class Actor:
    name: str
    body: Callable[[], Any]
    kind: str  # "leader", "writer", "reader", "stray": which faults it may get
    glet: Any = None
    done: bool = False
    killed: bool = False
    paused_until: int = -1
    error: BaseException | None = None
    result: Any = None
    started_at: int = 0
    ended_at: int = -1
    files: set[str] = field(default_factory=set)  # paths this actor created (for invariant c)


@dataclass(frozen=True, kw_only=True)
class Faults:
    """Per yield point: how often the running actor is killed or paused."""

    kill: float = 0.004
    pause: float = 0.01
    pause_steps: tuple[int, int] = (20, 200)

    def __post_init__(self) -> None:
        for name in ("kill", "pause"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value!r}: must be a probability from 0 to 1")
        low, high = self.pause_steps
        if not 1 <= low <= high:
            raise ValueError(f"pause_steps={self.pause_steps!r}: must be (low, high) with 1 <= low <= high")


NO_FAULTS = Faults(kill=0.0, pause=0.0)


class Scheduler:
    def __init__(self, rng: random.Random, faults: Faults, *, max_steps: int = 20_000) -> None:
        self.rng = rng
        self.faults = faults
        self.max_steps = max_steps
        self.tick = 0
        self.actors: list[Actor] = []
        self.trace: list[tuple[int, str, str]] = []  # (tick, actor, what it did next)
        self._current: Actor | None = None
        self._main = greenlet.getcurrent()

    @property
    def current(self) -> Actor | None:
        return self._current

    def spawn(self, name: str, body: Callable[[], Any], kind: str) -> Actor:
        actor = Actor(name=name, body=body, kind=kind, started_at=self.tick)
        actor.glet = greenlet.greenlet(lambda: self._run(actor), parent=self._main)
        self.actors.append(actor)
        return actor

    def _run(self, actor: Actor) -> None:
        try:
            actor.result = actor.body()
        except Killed:
            pass
        except BaseException as err:  # recorded for the invariants, never lost
            actor.error = err
        finally:
            actor.done = True
            actor.ended_at = self.tick

    def yield_point(self, label: str) -> None:
        """Called by the running actor before each storage operation."""
        actor = self._current
        if actor is None:
            return  # the driver itself (a check after the run): runs straight through
        if actor.killed:
            raise Killed
        self.trace.append((self.tick, actor.name, label))
        self._main.switch()
        if actor.killed:
            raise Killed

    def run(self, faults: Faults | None = None, until: Callable[[], bool] | None = None) -> None:
        """Interleave the actors until every one is done (or ``until`` holds)."""
        faults = self.faults if faults is None else faults
        while self.tick < self.max_steps and not (until is not None and until()):
            ready = [a for a in self.actors if not a.done and not a.killed and a.paused_until <= self.tick]
            if not ready:
                waiting = [a for a in self.actors if not a.done and not a.killed]
                if not waiting:
                    return
                self.tick = min(a.paused_until for a in waiting)  # only paused actors left: time passes
                continue
            actor = self.rng.choice(ready)
            self.tick += 1
            if actor.kind != "stray" and self._fault(actor, faults):
                continue
            self._current = actor
            try:
                actor.glet.switch()
            finally:
                self._current = None

    def _fault(self, actor: Actor, faults: Faults) -> bool:
        roll = self.rng.random()
        started = bool(actor.glet)  # a greenlet is true once started and until it ends
        if roll < faults.kill and started:
            actor.killed = True
            actor.ended_at = self.tick
            self.trace.append((self.tick, actor.name, "KILLED"))
            return True
        if roll < faults.kill + faults.pause and started:
            actor.paused_until = self.tick + self.rng.randint(*faults.pause_steps)
            self.trace.append((self.tick, actor.name, f"PAUSED until {actor.paused_until}"))
            return True
        return False

    def kill_all(self) -> None:
        """SIGKILL every actor still running or paused; unwind their greenlets quietly."""
        for actor in self.actors:
            if not actor.done:
                actor.killed = True
                if actor.ended_at < 0:
                    actor.ended_at = self.tick
        for actor in self.actors:
            if actor.glet:
                self._current = actor
                try:
                    actor.glet.throw(Killed)
                finally:
                    self._current = None
