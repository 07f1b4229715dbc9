"""The loop ``test_chaos_sharded_kills.py`` runs in a process of its own: three forked writers
save and commit sharded steps (``CheckpointStore``), get SIGKILLed (or one frozen with SIGSTOP,
a zombie) at seeded random moments, and what survived is checked; repeat.

Run as ``python chaos_sharded_kill_child.py ROOT ROUNDS SEED``; prints a JSON summary as its
last stdout line. Each round takes a new writer generation (as a restarted job does),
salvages, and forks the writers from this process, which has done its imports already.

Every stored value is ``step * scale + position`` and every skeleton names its step and
generation, so a checkpoint mixing two steps, two generations or a half-written file shows.
Violations are collected as text in ``failures``, never raised, so one run reports them all.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
from store_helpers import newest_sharded, part_store

from ray_checkfreq.errors import FencedWriterError, StorageError
from ray_checkfreq.storage import commit, part_writer
from ray_checkfreq.storage.chunks import whole
from ray_checkfreq.storage.manifest import MANIFEST_NAME, PART_FILE, PART_MANIFEST, ManifestError, decode_part
from ray_checkfreq.storage.names import parse_checkpoint_dir
from ray_checkfreq.storage.store import CheckpointRef, CheckpointStore, ChunkSource

WORLD = 3
KEEP_LAST = 2
PART_FILE_BYTES = 8 << 10  # a part is two or three data files
JITTER_S = 0.004  # each writer's random pause after a save and after a commit: they drift apart
RUN_S = 0.4  # the writers run 0 to RUN_S before the first kill
KILL_GAP_S = 0.04  # the random gap between two kills
ZOMBIE_EVERY = 4  # rounds 1, 5, 9, ... freeze a writer instead of killing it
COMMIT_WAIT_S = 20.0  # the round after a zombie commits a step of its own before the kills
ZOMBIE_WAIT_S = 10.0  # a resumed zombie must end within this
CLEAN_STEPS = 3

FENCED_EXIT, STORAGE_EXIT, CRASH_EXIT = 3, 4, 5
PHASES = ("between", "save_part", "data_file", "part_manifest", "commit", "housekeeping")
BETWEEN, SAVE, DATA, PART, COMMIT, HOUSEKEEPING = range(len(PHASES))
EXACT_BELOW = {"<f8": 2**53, "<f4": 2**24, "<i4": 2**31, "<i8": 2**63}


@dataclass(frozen=True)
class Tensor:
    """A saved array whose element ``i`` at ``step`` holds ``step * scale + base + i``."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    bounds: tuple[int, ...]  # rank r owns rows bounds[r] to bounds[r + 1]; one rank: its own leaf
    scale: int
    base: int = 0

    def values(self, step: int) -> np.ndarray:
        size = math.prod(self.shape)
        if step * self.scale + self.base + size >= EXACT_BELOW[self.dtype]:
            raise ValueError(f"{self.key}: step {step} is past the values {self.dtype} holds exactly")
        flat = step * self.scale + self.base + np.arange(size, dtype=np.int64)
        return flat.astype(self.dtype).reshape(self.shape)


GLOBAL_TENSORS = (  # split unevenly by rows between the three ranks
    Tensor("model/w", "<f8", (193, 67), (0, 50, 131, 193), scale=10**5),
    Tensor("optim/m", "<f4", (151, 41), (0, 60, 61, 151), scale=10**4),
    Tensor("model/odd", "<i4", (5, 3, 7), (0, 1, 3, 5), scale=10**3),
)
RANK_LEAVES = tuple(Tensor(f"rank/{r}/x", "<i8", (r + 2, 5), (0, r + 2), scale=10**4, base=100 * r)
                    for r in range(WORLD))
ALL_TENSORS = GLOBAL_TENSORS + RANK_LEAVES


def skeleton(step: int, generation: int, rank: int) -> dict:
    return {"step": step, "generation": generation, "rank": rank, "consumed": [rank, step]}


def rank_chunks(step: int, rank: int) -> list[ChunkSource]:
    chunks = []
    for tensor in GLOBAL_TENSORS:
        lo, hi = tensor.bounds[rank], tensor.bounds[rank + 1]
        offsets = (lo,) + (0,) * (len(tensor.shape) - 1)
        chunks.append(ChunkSource(key=tensor.key, data=np.ascontiguousarray(tensor.values(step)[lo:hi]),
                                  global_shape=tensor.shape, offsets=offsets, rank=rank))
    leaf = RANK_LEAVES[rank]
    chunks.append(ChunkSource(key=leaf.key, data=leaf.values(step), global_shape=leaf.shape,
                              offsets=(0,) * len(leaf.shape), rank=rank))
    return chunks


# ------------------------------------------------------------------ a writer process
def trace_phases(store: CheckpointStore, phases: Any, rank: int) -> None:
    """Record in ``phases[rank]`` what the writer is doing, for the parent to read at a kill."""

    def traced(method: Any, phase: int | None) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            before = phases[rank]
            if phase is not None:
                phases[rank] = phase
            elif PART_MANIFEST.match(str(args[0]).rsplit("/", 1)[-1]):
                phases[rank] = PART  # create_exclusive of a part manifest; else the commit's
            try:
                return method(*args, **kwargs)
            finally:
                phases[rank] = before
        return run

    store.save_part = traced(store.save_part, SAVE)  # type: ignore[method-assign]
    part_writer.write_part_files = traced(part_writer.write_part_files, DATA)  # this process's own module
    store.backend.create_exclusive = traced(store.backend.create_exclusive, None)  # type: ignore[method-assign]
    store.try_commit = traced(store.try_commit, COMMIT)  # type: ignore[method-assign]
    housekeeper = store._housekeeper
    housekeeper.after_commit = traced(housekeeper.after_commit, HOUSEKEEPING)  # type: ignore[method-assign]


def write_steps(root: str, generation: int, rank: int, start: int, steps: int | None, seed: int, phases: Any,
                conn: Connection) -> None:
    """Save and commit steps start+1, start+2, ... (``steps`` of them; None: until killed)."""
    rng = random.Random(seed)
    store = part_store(root, writer_generation=generation, keep_last=KEEP_LAST, codec="raw",
                         shard_size_bytes=PART_FILE_BYTES, io_threads=1)
    trace_phases(store, phases, rank)
    code = 0
    try:
        numbers = itertools.count(start + 1) if steps is None else range(start + 1, start + 1 + steps)
        for step in numbers:
            store.save_part(step, world_size=WORLD, skeletons={rank: skeleton(step, generation, rank)},
                            chunks=rank_chunks(step, rank))
            time.sleep(rng.uniform(0, JITTER_S))
            if store.try_commit(step).by_me:
                conn.send(("commit", step))
            time.sleep(rng.uniform(0, JITTER_S))
    except FencedWriterError as err:
        conn.send(("fenced", str(err)))
        code = FENCED_EXIT
    except StorageError as err:
        conn.send(("storage_error", str(err)))
        code = STORAGE_EXIT
    except Exception:
        conn.send(("crash", traceback.format_exc()[-2000:]))
        code = CRASH_EXIT
    conn.close()
    sys.exit(code)


@dataclass
class Writer:
    rank: int
    generation: int
    process: Any
    conn: Connection
    messages: list = field(default_factory=list)
    frozen_in: str = ""  # the phase it was in when SIGSTOPped

    def receive(self) -> bool:
        """Take one message if there is one; False at the end of the pipe."""
        try:
            self.messages.append(self.conn.recv())
            return True
        except Exception:  # EOFError, or a message cut short by the kill
            return False

    def drain(self) -> None:
        while self.conn.poll() and self.receive():
            pass

    def said(self, kind: str) -> list:
        return [text for k, text in self.messages if k == kind]


def fork_writers(context: Any, root: str, generation: int, start: int, steps: int | None,
                 rng: random.Random) -> tuple[list[Writer], Any]:
    phases = context.RawArray("b", WORLD)
    writers = []
    for rank in range(WORLD):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=write_steps, daemon=True,
                                  args=(root, generation, rank, start, steps, rng.randrange(2**32), phases, sender))
        process.start()
        sender.close()
        writers.append(Writer(rank, generation, process, receiver))
    return writers, phases


def wait_for_a_commit(writers: list[Writer], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    open_conns = {w.conn: w for w in writers}
    while open_conns and time.monotonic() < deadline:
        for conn in wait(list(open_conns), timeout=max(0.0, deadline - time.monotonic())):
            writer = open_conns[conn]  # type: ignore[index]
            if not writer.receive():
                del open_conns[writer.conn]
            elif writer.said("commit"):
                return True
    return False


def ended_by_itself(writer: Writer, label: str) -> str:
    writer.drain()
    last = writer.messages[-1][1][-400:] if writer.messages else "no message"
    return f"{label}: writer {writer.rank} of generation {writer.generation} ended by itself with exit " \
           f"{writer.process.exitcode}: {last}"


# ------------------------------------------------------------------ checks
def check_ref(reader: CheckpointStore, ref: CheckpointRef) -> list[str]:
    """The committed step loads whole, with exactly the values of its step and generation."""
    label = f"step {ref.step} of generation {ref.writer_generation} ({ref.name})"
    problems = []
    try:
        keys = sorted(t.key for t in reader.reader(ref).manifest.tensors)
        if keys != sorted(t.key for t in ALL_TENSORS):
            problems.append(f"{label}: tensors {keys}")
        loaded = reader.reader(ref).load_boxes({t.key: [whole(t.shape)] for t in ALL_TENSORS})
        for tensor in ALL_TENSORS:
            got, want = loaded[tensor.key][0], tensor.values(ref.step)
            if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
                steps = sorted({int(v) // tensor.scale for v in np.asarray(got, dtype=np.int64).ravel()})
                problems.append(f"{label}: {tensor.key} holds the values of steps {steps[:6]}")
        skeletons = reader.reader(ref).skeletons()
        if skeletons != {r: skeleton(ref.step, ref.writer_generation, r) for r in range(WORLD)}:
            problems.append(f"{label}: skeletons {skeletons!r:.400}")
    except Exception as err:
        problems.append(f"{label}: does not load: {type(err).__name__}: {err}")
    return problems


def check_store(root: str, label: str) -> tuple[list[str], CheckpointRef | None]:
    """Every committed step loads whole, and every directory with a global manifest is complete."""
    reader = part_store(root)
    refs = reader.list()
    problems = [f"{label}: {p}" for ref in refs for p in check_ref(reader, ref)]
    listed = {ref.name for ref in refs}
    for name, files in reader.backend.list_tree().items():
        if parse_checkpoint_dir(name) is not None and holds_global_manifest(os.path.join(root, name), files) \
                and name not in listed:
            problems.append(f"{label}: {name} has a global manifest but is incomplete or unreadable: "
                            f"{sorted(files)}")
    return problems, (refs[-1] if refs else None)


def part_files(path: str, names: list[str]) -> tuple[set[str], int]:
    """The data files the part manifests in ``path`` list, and how many parts are unreadable."""
    listed: set[str] = set()
    unreadable = 0
    for name in names:
        if PART_MANIFEST.match(name):
            try:
                with open(os.path.join(path, name), "rb") as f:
                    listed |= {p.name for p in decode_part(f.read(), name=name).files}
            except (OSError, ManifestError):
                unreadable += 1
    return listed, unreadable


def survey(root: str, generation: int) -> dict[str, int]:
    """What the kills left of ``generation``'s saves: evidence that they landed inside writes."""
    left = {"uncommitted_dirs": 0, "parts_without_commit": 0, "data_without_part": 0, "tmp_files": 0,
            "unreadable_parts": 0}
    for name in os.listdir(root):
        parsed = parse_checkpoint_dir(name)
        if parsed is None or parsed[1] != generation:
            continue
        path = os.path.join(root, name)
        names = os.listdir(path)
        listed, unreadable = part_files(path, names)
        left["unreadable_parts"] += unreadable
        left["tmp_files"] += sum(n.endswith(".tmp") for n in names)
        left["data_without_part"] += sum(bool(PART_FILE.match(n)) and n not in listed for n in names)
        if not holds_global_manifest(path, names):
            left["uncommitted_dirs"] += 1
            left["parts_without_commit"] += sum(bool(PART_MANIFEST.match(n)) for n in names)
    return left


def orphans(root: str) -> list[str]:
    """Checkpoint directories that are not committed, and files no manifest lists."""
    reader = part_store(root)
    kept = {ref.name: ref for ref in reader.list()}
    found = []
    for name in sorted(os.listdir(root)):
        if parse_checkpoint_dir(name) is None:
            continue  # writers/ and metadata documents
        present = set(os.listdir(os.path.join(root, name)))
        if name not in kept:
            found.append(f"{name}: not a committed checkpoint, holds {sorted(present)[:6]}")
            continue
        manifest = reader.reader(kept[name]).manifest
        listed = {MANIFEST_NAME} | {p.name for p in manifest.parts}
        listed |= {f.name for p in manifest.parts for f in p.files}
        if present != listed:
            found.append(f"{name}: files {sorted(present - listed)} not listed, {sorted(listed - present)} missing")
    return found


# ------------------------------------------------------------------ zombies
def dirs_of(root: str, generation: int) -> dict[str, list[str]]:
    """``generation``'s checkpoint directories and their files."""
    found = {}
    for name in os.listdir(root):
        parsed = parse_checkpoint_dir(name)
        if parsed is not None and parsed[1] == generation:
            try:
                found[name] = sorted(os.listdir(os.path.join(root, name)))
            except FileNotFoundError:
                continue
    return found


def new_uncommitted_files(root: str, before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    """Files in uncommitted directories that were not there ``before``: what a fenced writer
    left behind (a withdrawn part, an emptied directory: nothing)."""
    return [f"{name}/{file}" for name, files in sorted(after.items())
            if not holds_global_manifest(os.path.join(root, name), files)
            for file in files if file not in before.get(name, [])]


def committed_dirs(root: str, generation: int) -> set[str]:
    return {name for name, files in dirs_of(root, generation).items()
            if holds_global_manifest(os.path.join(root, name), files)}


def holds_global_manifest(path: str, names: Any) -> bool:
    """A global manifest, not an abandon record (a remover's hold on the name: commit.py)."""
    if MANIFEST_NAME not in names:
        return False
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            return not commit.is_abandon_record(f.read())
    except FileNotFoundError:
        return False


def resume_zombie(root: str, zombie: Writer, label: str) -> tuple[dict, list[str]]:
    """SIGCONT a writer frozen a round ago, let it run until it ends; nothing of it may
    become the newest or hide a newer generation's steps."""
    failures = []
    reader = part_store(root)
    before = reader.list()
    own_before = committed_dirs(root, zombie.generation)
    dirs_before = dirs_of(root, zombie.generation)
    zombie.drain()
    zombie.messages.clear()
    os.kill(zombie.process.pid, signal.SIGCONT)
    zombie.process.join(ZOMBIE_WAIT_S)
    if zombie.process.exitcode is None:
        failures.append(f"{label}: the zombie of generation {zombie.generation} still runs "
                        f"{ZOMBIE_WAIT_S:g} s after SIGCONT")
        os.kill(zombie.process.pid, signal.SIGKILL)
        zombie.process.join()
    zombie.drain()
    zombie.conn.close()
    after = part_store(root).list()
    own_new = sorted(committed_dirs(root, zombie.generation) - own_before)
    left_behind = new_uncommitted_files(root, dirs_before, dirs_of(root, zombie.generation))
    fenced = zombie.said("fenced")
    outcome = {"generation": zombie.generation, "exit": zombie.process.exitcode, "committed_own_old_step": own_new,
               "left_behind": left_behind, "frozen_in": zombie.frozen_in,
               "message": (zombie.messages[-1][1][-400:] if zombie.messages else "")}
    if zombie.process.exitcode == FENCED_EXIT and fenced \
            and f"writer generation {zombie.generation} is fenced" in fenced[0]:
        outcome["ended"] = "fenced"
    else:
        outcome["ended"] = {STORAGE_EXIT: "storage_error", CRASH_EXIT: "crash"}.get(zombie.process.exitcode, "other")
        failures.append(f"{label}: the zombie of generation {zombie.generation} (frozen in {zombie.frozen_in}) "
                        f"ended by {outcome['ended']}, not by a FencedWriterError naming it: "
                        f"{outcome['message'][-300:]}")
    if left_behind:
        failures.append(f"{label}: the fenced zombie of generation {zombie.generation} left {left_behind[:6]}")
    latest_before = before[-1].name if before else None
    latest_after = after[-1].name if after else None
    if latest_after != latest_before:
        failures.append(f"{label}: the zombie of generation {zombie.generation} changed latest() from "
                        f"{latest_before} to {latest_after}")
    if latest_after in own_new:
        failures.append(f"{label}: the zombie's own old step {latest_after} became the newest")
    newer = {r.name for r in before if r.writer_generation > zombie.generation}
    gone = sorted(newer - {r.name for r in after})
    if gone:
        failures.append(f"{label}: the zombie of generation {zombie.generation} hid newer steps {gone}")
    return outcome, failures


# ------------------------------------------------------------------ the loop
def begin_generation(root: str) -> tuple[int, int]:
    """A new generation, as a restarted job takes it: acquire, salvage, resume after latest()."""
    store = part_store(root)
    generation = store.acquire_writer()
    store.salvage()
    latest = newest_sharded(store)
    return generation, (latest.step if latest else 0)


def stop_writers(writers: list[Writer], phases: Any, rng: random.Random, freeze: bool,
                 label: str) -> tuple[list[str], Writer | None, list[str]]:
    """SIGKILL the writers one by one (SIGSTOP one of them when ``freeze``); the phase each
    killed one was in when its signal went, the frozen writer, and failures."""
    order = rng.sample(writers, len(writers))
    to_freeze = rng.choice(order) if freeze else None
    frozen = None
    kill_phases, failures = [], []
    for writer in order:
        time.sleep(rng.uniform(0, KILL_GAP_S))
        if writer.process.exitcode is not None:
            failures.append(ended_by_itself(writer, label))
            continue
        if writer is to_freeze:
            frozen = writer
            writer.frozen_in = PHASES[phases[writer.rank]]
            os.kill(writer.process.pid, signal.SIGSTOP)
        else:
            kill_phases.append(PHASES[phases[writer.rank]])
            os.kill(writer.process.pid, signal.SIGKILL)
    for writer in writers:
        if writer is not frozen:
            writer.process.join()
            writer.drain()
            writer.conn.close()
    return kill_phases, frozen, failures


def clean_generation(root: str, context: Any, rng: random.Random) -> tuple[list[str], int, int]:
    """One generation writes and commits CLEAN_STEPS steps; its writers exit normally."""
    generation, start = begin_generation(root)
    writers, _ = fork_writers(context, root, generation, start, CLEAN_STEPS, rng)
    failures = []
    for writer in writers:
        writer.process.join(60)
        if writer.process.exitcode != 0:
            failures.append(ended_by_itself(writer, "clean generation"))
            if writer.process.exitcode is None:
                os.kill(writer.process.pid, signal.SIGKILL)
                writer.process.join()
    return failures, generation, start


def kill_loop(root: str, rounds: int, seed: int) -> dict:
    began = time.monotonic()
    rng = random.Random(seed)
    context = multiprocessing.get_context("fork")
    failures: list[str] = []
    newest: list[int] = []
    newest_key = (0, 0)
    kill_phases: dict[str, int] = dict.fromkeys(PHASES, 0)
    leftovers: dict[str, int] = {}
    interrupted_rounds = 0
    zombies: list[dict] = []
    zombie: Writer | None = None
    for n in range(rounds):
        label = f"round {n}"
        generation, start = begin_generation(root)
        writers, phases = fork_writers(context, root, generation, start, None, rng)
        if zombie is not None and not wait_for_a_commit(writers, COMMIT_WAIT_S):
            failures.append(f"{label}: generation {generation} committed nothing in {COMMIT_WAIT_S:g} s")
        time.sleep(rng.uniform(0, RUN_S))
        freeze = n % ZOMBIE_EVERY == 1 and n < rounds - 1
        phases_now, frozen, stop_failures = stop_writers(writers, phases, rng, freeze, label)
        failures += stop_failures
        for phase in phases_now:
            kill_phases[phase] += 1
        left = survey(root, generation)
        for kind, count in left.items():
            leftovers[kind] = leftovers.get(kind, 0) + count
        interrupted_rounds += bool(left["uncommitted_dirs"] or left["tmp_files"])
        if zombie is not None:
            outcome, zombie_failures = resume_zombie(root, zombie, label)
            zombies.append({"round": n - 1, **outcome})
            failures += zombie_failures
        zombie = frozen
        problems, latest = check_store(root, label)
        failures += problems
        key = (latest.step, latest.writer_generation) if latest else (0, 0)
        if key < newest_key:
            failures.append(f"{label}: the newest commit went back from {newest_key} to {key}")
        newest_key = max(newest_key, key)
        newest.append(key[0])
    clean_failures, generation, start = clean_generation(root, context, rng)
    failures += clean_failures
    problems, latest = check_store(root, "end")
    failures += problems
    steps_kept = [(r.writer_generation, r.step) for r in part_store(root).list()]
    want_kept = [(generation, start + CLEAN_STEPS - k) for k in reversed(range(KEEP_LAST))]
    if steps_kept != want_kept:
        failures.append(f"end: kept (generation, step) {steps_kept}, retention should keep {want_kept}")
    found_orphans = orphans(root)
    return {
        "rounds": rounds,
        "failures": failures,
        "newest": newest,
        "final": latest.step if latest else 0,
        "kills": sum(kill_phases.values()),
        "kill_phases": kill_phases,
        "kills_inside_writes": sum(count for phase, count in kill_phases.items() if phase != "between"),
        "interrupted_rounds": interrupted_rounds,
        "leftovers": leftovers,
        "zombies": zombies,
        "zombies_fenced": sum(z["ended"] == "fenced" for z in zombies),
        "zombies_committed_own_old_step": sum(bool(z["committed_own_old_step"]) for z in zombies),
        "orphans": found_orphans,
        "seconds": round(time.monotonic() - began, 1),
    }


if __name__ == "__main__":
    print(json.dumps(kill_loop(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
