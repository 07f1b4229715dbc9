"""The actors of a schedule: generations of writers, readers, and stray files.

Every generation is a restarted job: a leader takes a writer generation, salvages, reads
``latest()`` and starts its writers at the step after it. ``sharded``: one writer per rank
(``save_part``, ``try_commit``; rank 0 polls), a world of 1 to ``max_world`` ranks (one
part is the replicated case). ``replicated``: one writer (``CheckpointStore.save``).
Readers list, ask ``latest()``, load and check values, and register pointers (the Ray
layer's protected steps). A stray actor creates and removes foreign files in step
directories (an NFS client's ``.nfs*`` files), so files vanish in the middle of listings.
Every value names its generation, step and rank, so a torn or mixed checkpoint shows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_checkfreq.chaos.commit_sim.history import History, OrderKey
from ray_checkfreq.chaos.commit_sim.memory_backend import SimBackend
from ray_checkfreq.chaos.commit_sim.scheduler import Scheduler
from ray_checkfreq.errors import CheckFreqError
from ray_checkfreq.storage.chunks import Box
from ray_checkfreq.storage.names import parse_checkpoint_dir
from ray_checkfreq.storage.store import CheckpointStore, ChunkSource

STRAY_PREFIX = ".nfs"


@dataclass(frozen=True, kw_only=True)
class Workload:
    store: str = "sharded"  # "sharded" (N parts) or "replicated" (CheckpointStore)
    generations: int = 3
    steps: int = 3  # steps each generation saves
    max_world: int = 3  # sharded: ranks per generation, 1 to this
    readers: int = 2
    reader_ops: int = 6
    strays: int = 40  # foreign files made and removed: enough that listings lose entries often
    commit_polls: int = 3
    keep_last: int = 2
    full_every: int = 1  # > 1: rcfz XOR deltas between full saves (their bases kept by retention)

    def __post_init__(self) -> None:
        if self.store not in ("sharded", "replicated"):
            raise ValueError(f"store={self.store!r}: must be 'sharded' or 'replicated'")
        for name in ("generations", "steps", "max_world", "keep_last", "full_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 1")
        for name in ("readers", "reader_ops", "strays", "commit_polls"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 0")


PER_RANK = 16  # values of each rank's chunk: enough that a delta of an unchanged tail pays
_TAIL = np.sqrt(np.arange(1, PER_RANK, dtype=np.float32))  # every mantissa bit in use: compresses badly


def expected_values(generation: int, step: int, world: int) -> np.ndarray:
    """Each rank's chunk: its own (generation, step) first, then a tail that never changes
    (so that an XOR delta is smaller than the chunk, and the store keeps deltas)."""
    return np.concatenate([np.concatenate([[generation * 1000 + step * 10 + rank], _TAIL + rank]).astype(np.float32)
                           for rank in range(world)])


@dataclass
class Context:
    workload: Workload
    scheduler: Scheduler
    backend: SimBackend
    history: History
    rng: random.Random
    pointers: set[int] = field(default_factory=set)
    # (generation, step) -> {rank: tick its try_commit returned}, and the steps one was told committed
    finished: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    committed_steps: set[tuple[int, int]] = field(default_factory=set)
    worlds: dict[int, int] = field(default_factory=dict)  # generation -> its world size
    acquired: dict[int, int] = field(default_factory=dict)  # generation -> tick it was taken
    clean_steps: list[tuple[int, int]] = field(default_factory=list)  # (generation, step) of the clean run

    # ------------------------------------------------------------ stores
    def _protected(self) -> list[int]:
        return sorted(self.pointers)

    def store(self, generation: int | None = None) -> CheckpointStore:
        store = CheckpointStore(self.backend.root_uri, filesystem=self.backend, writer_generation=generation,
                                protected_steps=self._protected, keep_last=self.workload.keep_last, io_threads=1,
                                codec=self._codec(), full_every=self.workload.full_every)
        self._trace_housekeeping(store._housekeeper, "after_commit")
        return store

    def _codec(self) -> str:
        return "rcfz" if self.workload.full_every > 1 else "raw"

    def _trace_housekeeping(self, store: Any, method: str) -> None:
        """Note when each actor's housekeeping begins (what it may rely on of the pointers)."""
        original = getattr(store, method)

        def traced(*args: Any, **kwargs: Any) -> Any:
            self.history.housekeeping_started[self.me()] = self.scheduler.tick
            return original(*args, **kwargs)

        setattr(store, method, traced)

    # ------------------------------------------------------------ helpers
    def me(self) -> str:
        actor = self.scheduler.current
        return actor.name if actor is not None else "driver"

    def wait(self, label: str) -> None:
        self.scheduler.yield_point(label)

    def latest(self, store: Any) -> Any:
        started = self.scheduler.tick
        ref = newest(store, self.workload)
        self.history.record_latest(self.me(), started, order_key(ref))
        if ref is not None:
            self.history.tell(ref.name, self.me())
        return ref


def order_key(ref: Any) -> OrderKey | None:
    return None if ref is None else (ref.writer_generation, ref.step, ref.created_unix_ns, ref.name)


# ------------------------------------------------------------ generations
def start_generation(ctx: Context, *, clean: bool = False) -> None:
    """The body of a generation's leader."""
    if ctx.workload.store == "replicated":
        _replicated_generation(ctx, clean)
        return
    store = ctx.store()
    generation = store.acquire_writer()
    ctx.acquired[generation] = ctx.scheduler.tick
    salvaged = store.salvage()
    if salvaged is not None:
        ctx.history.tell(salvaged.name, ctx.me())
    latest = ctx.latest(store)
    first = latest.step + 1 if latest is not None else 1
    steps = list(range(first, first + ctx.workload.steps))
    world = ctx.rng.randint(1, ctx.workload.max_world)
    if clean:
        ctx.clean_steps.extend((generation, step) for step in steps)
    ctx.worlds[generation] = world
    for rank in range(world):
        ctx.scheduler.spawn(f"g{generation}.r{rank}", _bind(_sharded_writer, ctx, generation, rank, world, steps),
                            "writer")


def _sharded_writer(ctx: Context, generation: int, rank: int, world: int, steps: list[int]) -> None:
    store = ctx.store(generation)
    for step in steps:
        values = expected_values(generation, step, world)[PER_RANK * rank:PER_RANK * (rank + 1)].copy()
        chunk = ChunkSource(key="w", data=values, global_shape=(PER_RANK * world,), offsets=(PER_RANK * rank,),
                            rank=rank)
        store.save_part(step, world_size=world, skeletons={rank: {"generation": generation, "step": step}},
                        chunks=[chunk])
        result = store.try_commit(step)
        for _ in range(ctx.workload.commit_polls if rank == 0 else 0):
            if result.committed:
                break
            ctx.wait("poll")
            result = store.try_commit(step)
        ctx.finished.setdefault((generation, step), {})[rank] = ctx.scheduler.tick
        if result.committed and result.ref is not None:
            ctx.history.tell(result.ref.name, ctx.me())
            ctx.committed_steps.add((generation, step))


def _replicated_generation(ctx: Context, clean: bool) -> None:
    store = ctx.store()
    generation = store.acquire_writer()
    latest = ctx.latest(store)
    first = latest.step + 1 if latest is not None else 1
    for step in range(first, first + ctx.workload.steps):
        ref = store.save(step, {"w": expected_values(generation, step, 1)}, meta={"generation": generation})
        ctx.history.tell(ref.name, ctx.me())
        if clean:
            ctx.clean_steps.append((generation, step))


# ------------------------------------------------------------ readers and strays
def reader(ctx: Context) -> None:
    store = ctx.store()
    for _ in range(ctx.workload.reader_ops):
        ctx.wait("think")
        operation = ctx.rng.choice((_list, _latest, _load, _register_pointer))
        operation(ctx, store)


def _list(ctx: Context, store: Any) -> None:
    for ref in store.list():
        ctx.history.tell(ref.name, ctx.me())


def _latest(ctx: Context, store: Any) -> None:
    ctx.latest(store)


def _load(ctx: Context, store: Any) -> None:
    ref = ctx.latest(store)
    if ref is None:
        return
    try:
        values = load_values(store, ref)
    except (CheckFreqError, FileNotFoundError, KeyError) as err:
        if ref.name not in ctx.history.retired:
            ctx.history.violate(f"(a) {ctx.me()} could not load {ref.name}, which latest() had just named: {err!r}")
        return
    check_values(ctx.history, ref, values, ctx.me())


def _register_pointer(ctx: Context, store: Any) -> None:
    """What the Ray layer does: point at a step, then confirm it is still there."""
    ref = ctx.latest(store)
    if ref is None:
        return
    registered = ctx.scheduler.tick
    ctx.pointers.add(ref.step)
    if ref.name in {r.name for r in store.list(step=ref.step)}:  # reads that step's manifests only
        ctx.history.pointers.setdefault(ref.step, registered)


def stray_files(ctx: Context) -> None:
    """Foreign files that come and go in step directories, the newest one most often (where
    a listing that lost its files would hide the latest checkpoint)."""
    for _ in range(ctx.workload.strays):
        for _ in range(ctx.rng.randint(1, 40)):
            ctx.wait("idle")
        steps = sorted((parse_checkpoint_dir(name), name) for name in ctx.backend.list_dirs()
                       if parse_checkpoint_dir(name) is not None)
        if not steps:
            continue
        target = steps[-1][1] if ctx.rng.random() < 0.7 else ctx.rng.choice(steps)[1]
        path = f"{target}/{STRAY_PREFIX}{ctx.rng.getrandbits(32):08x}"
        try:
            ctx.backend.write(path, [b"stray"])
        except CheckFreqError:
            continue  # the directory went away meanwhile
        for _ in range(ctx.rng.randint(1, 10)):
            ctx.wait("hold")
        ctx.backend.delete_file(path)


def newest(store: CheckpointStore, workload: Workload) -> Any:
    """What a restart resumes from: the newest complete sharded step (every rank reads its
    own boxes), or the newest replicated checkpoint ``latest()`` loads."""
    if workload.store == "sharded":
        refs = store.list(placement="sharded")
        return refs[-1] if refs else None
    return store.latest()


# ------------------------------------------------------------ values
def load_values(store: Any, ref: Any) -> tuple[np.ndarray, int]:
    """The checkpoint's values and the generation its contents name."""
    if ref.placement == "sharded":
        reader = store.reader(ref)
        loaded = reader.load_boxes({"w": [Box((0,), (PER_RANK * ref.world_size,))]})["w"][0]
        skeletons = reader.skeletons()
        generations = {skeleton["generation"] for skeleton in skeletons.values()}
        steps = {skeleton["step"] for skeleton in skeletons.values()}
        if len(generations) != 1 or steps != {ref.step}:
            return np.asarray(loaded), -1
        return np.asarray(loaded), generations.pop()
    state = store.load(ref)
    return np.asarray(state["w"]), int(ref.meta.get("generation", -1))


def check_values(history: History, ref: Any, loaded: tuple[np.ndarray, int], who: str) -> None:
    values, generation = loaded
    world = getattr(ref, "world_size", 1)
    expected = expected_values(ref.writer_generation, ref.step, world)
    if generation != ref.writer_generation or values.shape != expected.shape or not np.array_equal(values, expected):
        history.violate(f"(a) {who} loaded {ref.name} with values {values.tolist()} of generation {generation}, "
                        f"not its own {expected.tolist()}")


def _bind(function: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: function(*args)
