"""Run seeded schedules of the commit protocol and check every invariant after each.

One seed is one schedule, reproduced exactly: the interleaving, the faults, the layout
(POSIX directories or an object store's prefixes), the world sizes, and every random name
(``uuid.uuid4`` and ``time.time_ns`` are the scheduler's for the run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.chaos.commit_sim import workload as load
from ray_checkfreq.chaos.commit_sim.history import History
from ray_checkfreq.chaos.commit_sim.memory_backend import SimBackend
from ray_checkfreq.chaos.commit_sim.scheduler import NO_FAULTS, Faults, Scheduler
from ray_checkfreq.errors import CheckFreqError, FencedWriterError
from ray_checkfreq.storage import commit, fencing
from ray_checkfreq.storage.backends import listing
from ray_checkfreq.storage.backends.base import Backend
from ray_checkfreq.storage.legacy import decode_any_manifest
from ray_checkfreq.storage.manifest import MANIFEST_NAME
from ray_checkfreq.storage.names import parse_checkpoint_dir


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    workload: load.Workload = load.Workload()
    faults: Faults = Faults()
    layouts: tuple[str, ...] = ("posix", "object")  # one is drawn per schedule
    max_steps: int = 20_000

    def __post_init__(self) -> None:
        if not self.layouts or set(self.layouts) - {"posix", "object"}:
            raise ValueError(f"layouts={self.layouts!r}: choose from 'posix' and 'object'")


@dataclass(frozen=True)
class Outcome:
    seed: int
    violations: tuple[str, ...]
    trace: tuple[tuple[int, str, str], ...]  # (tick, actor, what it did next)
    ticks: int


def run_schedule(seed: int, config: SimConfig = SimConfig()) -> Outcome:
    rng = random.Random(seed)
    scheduler = Scheduler(random.Random(rng.getrandbits(64)), config.faults, max_steps=config.max_steps)
    history = History(clock=lambda: scheduler.tick)
    backend = SimBackend(scheduler, directories=rng.choice(config.layouts) == "posix", on_delete=history.on_delete)
    ctx = load.Context(config.workload, scheduler, backend, history, random.Random(rng.getrandbits(64)))
    with _deterministic(rng, scheduler), _removals_noted(history, scheduler):
        _random_phase(ctx, rng)
        _clean_generation(ctx)
        _final_checks(ctx)
    return Outcome(seed, tuple(history.violations), tuple(scheduler.trace), scheduler.tick)


def _random_phase(ctx: load.Context, rng: random.Random) -> None:
    """Generations start at random moments, so older ones still run (zombies) when they do."""
    scheduler, work = ctx.scheduler, ctx.workload
    for index in range(work.readers):
        scheduler.spawn(f"reader{index}", load._bind(load.reader, ctx), "reader")
    if work.strays:
        scheduler.spawn("stray", load._bind(load.stray_files, ctx), "stray")
    for index in range(work.generations):
        scheduler.spawn(f"leader{index + 1}", load._bind(load.start_generation, ctx), "writer")
        start_next = scheduler.tick + rng.randint(5, 400)
        scheduler.run(until=lambda: scheduler.tick >= start_next)  # noqa: B023 (used at once)
    scheduler.run()
    _remove_strays(ctx.backend)
    scheduler.kill_all()


def _remove_strays(backend: SimBackend) -> None:
    for files in backend.dirs.values():
        for name in [n for n in files if n.startswith(load.STRAY_PREFIX)]:
            del files[name]


def _clean_generation(ctx: load.Context) -> None:
    ctx.scheduler.spawn("clean", lambda: load.start_generation(ctx, clean=True), "writer")
    ctx.scheduler.run(faults=NO_FAULTS)


# ------------------------------------------------------------ invariants after the run
def _final_checks(ctx: load.Context) -> None:
    _check_told_stay_loadable(ctx)
    _check_every_finished_step_committed(ctx)
    _check_actor_endings(ctx)
    _check_clean_leftovers(ctx)


def _driver_store(ctx: load.Context) -> Any:
    return ctx.store()


def _check_told_stay_loadable(ctx: load.Context) -> None:
    """(a) at the end: whatever anyone was told is committed is whole, unless retired."""
    store = _driver_store(ctx)
    listed = {ref.name: ref for ref in store.list()}
    for name, who in sorted(ctx.history.told.items()):
        if name in ctx.history.retired:
            continue
        ref = listed.get(name)
        if ref is None:
            undone = ctx.history.undone.get(name)
            how = f"its writer {undone} removed its manifest" if undone else "it is not whole"
            ctx.history.violate(f"(a) {who} was told {name} is committed; no retention removed it, but {how}")
            continue
        try:
            load.check_values(ctx.history, ref, load.load_values(store, ref), "the final check")
        except (CheckFreqError, FileNotFoundError, KeyError) as err:
            ctx.history.violate(f"(a) {who} was told {name} is committed; it no longer loads: {err!r}")


def _check_every_finished_step_committed(ctx: load.Context) -> None:
    """(e): a step whose every rank wrote its part and returned from ``try_commit`` before a
    newer generation was taken is committed (the last writer to list sees every part), and
    one of them was told so. A newer generation may fence the last one first: no commit."""
    for (generation, step), returned in sorted(ctx.finished.items()):
        world = ctx.worlds.get(generation, 0)
        last = max(returned.values())
        superseded = any(newer > generation and tick <= last for newer, tick in ctx.acquired.items())
        if len(returned) == world and not superseded and (generation, step) not in ctx.committed_steps:
            ctx.history.violate(f"(e) every one of the {world} writers of step {step}, generation {generation}, "
                                "wrote its part and returned from try_commit, and none was told it committed")


def _check_actor_endings(ctx: load.Context) -> None:
    """(c): writers end well or fenced by name, and a fenced one leaves nothing."""
    for actor in ctx.scheduler.actors:
        err = actor.error
        if err is None:
            continue
        if actor.kind != "writer" or not isinstance(err, FencedWriterError):
            ctx.history.violate(f"(c) {actor.name} ended with {type(err).__name__}: {err}")
            continue
        committed_once = set(ctx.history.told) | set(ctx.history.retired)
        left = [path for path in sorted(actor.files) if _left_outside_a_commit(ctx.backend, path)
                and path.rpartition("/")[0] not in committed_once]  # a checkpoint's files: retention's
        if left:
            ctx.history.violate(f"(c) {actor.name} was fenced and left {left[:6]}")


def _left_outside_a_commit(backend: SimBackend, path: str) -> bool:
    directory, _, name = path.rpartition("/")
    files = backend.dirs.get(directory) if directory else backend.root_files
    if files is None or name not in files:
        return False
    if directory == fencing.WRITERS_DIR:
        return False  # a generation's marker is never removed
    if not directory:
        return True
    manifest = files.get(MANIFEST_NAME)
    return manifest is None or commit.is_abandon_record(manifest.data)


def _check_clean_leftovers(ctx: load.Context) -> None:
    """(d): after the clean generation only what retention keeps is left."""
    history, backend = ctx.history, ctx.backend
    store = _driver_store(ctx)
    intact = {ref.name for ref in store.list()}
    kept = []
    for name, files in sorted(backend.dirs.items()):
        parsed = parse_checkpoint_dir(name)
        if parsed is None or parsed[0] in ctx.pointers:
            continue  # writers/, or a step a pointer protects
        if name not in intact:
            history.violate(f"(d) after a clean generation {name} is left, holding {sorted(files)[:6]}")
        else:
            kept.append(name)
    # A delta is only as good as its base: a base that a kept checkpoint names is kept too.
    bases = {base for name in intact
             for base in decode_any_manifest(backend.dirs[name][MANIFEST_NAME].data).delta_bases}
    counted = [name for name in kept if name not in bases]
    if len(counted) > ctx.workload.keep_last:
        history.violate(f"(d) {len(counted)} unprotected checkpoints kept, more than keep_last: {kept} "
                        f"(delta bases among them: {sorted(bases & set(kept))})")
    dead = {a.name for a in ctx.scheduler.actors if a.killed}
    for name, file in backend.root_files.items():
        if listing.is_staged(name) and file.creator not in dead:
            history.violate(f"(d) {file.creator}, which was not killed, left the staged file {name}")
    latest = load.newest(store, ctx.workload)
    if ctx.clean_steps and (latest is None or (latest.writer_generation, latest.step) != ctx.clean_steps[-1]):
        history.violate(f"(d) latest() after the clean generation is {load.order_key(latest)}, not "
                        f"{ctx.clean_steps[-1]}")


@contextlib.contextmanager
def _deterministic(rng: random.Random, scheduler: Scheduler) -> Iterator[None]:
    """Random names and clocks from the seed, the store's log quiet, for one schedule."""
    saved = uuid.uuid4, time.time_ns
    names = random.Random(rng.getrandbits(64))
    uuid.uuid4 = lambda: uuid.UUID(int=names.getrandbits(128), version=4)
    time.time_ns = lambda: 1_700_000_000_000_000_000 + scheduler.tick * 1_000_000
    log = logging.getLogger("ray_checkfreq")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        uuid.uuid4, time.time_ns = saved
        log.setLevel(level)


@contextlib.contextmanager
def _removals_noted(history: History, scheduler: Scheduler) -> Iterator[None]:
    """Tell the history which manifest deletions are removals of committed directories."""
    original = commit.remove_committed

    def noted(backend: Backend, name: str, generation: int) -> None:
        who = scheduler.current.name if scheduler.current is not None else "driver"
        history.removing.add(who)
        try:
            original(backend, name, generation)
        finally:
            history.removing.discard(who)

    commit.remove_committed = noted
    try:
        yield
    finally:
        commit.remove_committed = original


# ------------------------------------------------------------ many schedules
@dataclass(frozen=True)
class Summary:
    schedules: int
    seconds: float
    failures: tuple[Outcome, ...]

    @property
    def per_second(self) -> float:
        return self.schedules / self.seconds if self.seconds > 0 else 0.0


def run_many(first_seed: int, count: int, config: SimConfig = SimConfig(), *, stop_at_first: bool = False) -> Summary:
    started = time.monotonic()
    failures = []
    done = 0
    for seed in range(first_seed, first_seed + count):
        outcome = run_schedule(seed, config)
        done += 1
        if outcome.violations:
            failures.append(outcome)
            if stop_at_first:
                break
    return Summary(done, time.monotonic() - started, tuple(failures))


def shrink(seed: int, config: SimConfig) -> tuple[SimConfig, Outcome]:
    """The smallest workload (fewer generations, steps, readers, ranks...) with which this
    seed still breaks an invariant: greedy, one field at a time."""
    best = run_schedule(seed, config)
    if not best.violations:
        return config, best
    improved = True
    while improved:
        improved = False
        for name in ("generations", "steps", "readers", "reader_ops", "strays", "max_world", "commit_polls"):
            value = getattr(config.workload, name)
            floor = 1 if name in ("generations", "steps", "max_world") else 0
            if value <= floor:
                continue
            smaller = dataclasses.replace(config, workload=dataclasses.replace(config.workload, **{name: value - 1}))
            outcome = run_schedule(seed, smaller)
            if outcome.violations and len(outcome.trace) <= len(best.trace):
                config, best, improved = smaller, outcome, True
    return config, best


def report(outcome: Outcome, config: SimConfig, *, tail: int = 60) -> str:
    """The seed, the workload that reproduces it, the violations and the trace before the first."""
    first_tick = min(int(v.split(":", 1)[0].removeprefix("tick ")) for v in outcome.violations)
    trace = [f"{tick} {actor}: {label}" for tick, actor, label in outcome.trace if tick <= first_tick]
    lines = [f"seed {outcome.seed}: {len(outcome.violations)} violation(s); reproduce with "
             f"run_schedule({outcome.seed}, {config!r})", *outcome.violations,
             f"trace up to tick {first_tick} (last {min(tail, len(trace))} of {len(trace)} steps):", *trace[-tail:]]
    return "\n".join(lines)
