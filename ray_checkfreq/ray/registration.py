"""Registration with Ray Train: pointer checkpoints, their cadence, and ``load``.

A pointer is a directory ``<experiment_fs_path>/checkfreq-pointer-<step>-<hex>`` on the
run's storage filesystem holding one JSON file that names the store and a committed step.
It is reported with ``NO_UPLOAD``, so Ray Train registers it as it is (``Result.checkpoint``)
and owns it: ``CheckpointConfig(num_to_keep)`` deletes evicted pointers.

Invariants:
- A pointer names only a step that is committed, checked after the pointer is written.
  The store's retention keeps every step a live pointer names (``PointedSteps`` is its
  ``protected_steps``), so a pointer never outlives its data. Between the step's commit
  and the pointer's write at most one further checkpoint commits (the registration runs
  on the training thread, which starts no new persist meanwhile): with ``keep_last >= 2``
  retention cannot take the step in that window.
- ``report()`` is a barrier that every rank must call equally often: every rank checks
  at the same iterations, rank 0 decides and broadcasts (step, report or not, next check)
  on the control group, so the ranks cannot disagree.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ray_checkfreq.errors import LocatedError
from ray_checkfreq.ray.transfer import broadcast_json
from ray_checkfreq.storage import CheckpointStore
from ray_checkfreq.storage.names import MAX_STEP
from ray_checkfreq.storage.stored_json import StoredJsonError, is_int, parse_stored_json

logger = logging.getLogger("ray_checkfreq.ray")

POINTER_PREFIX = "checkfreq-pointer-"
POINTER_FILE = "checkfreq-pointer.json"
POINTER_FORMAT = "ray_checkfreq.pointer"
POINTER_VERSION = 1
MAX_POINTER_BYTES = 64 * 1024
FIRST_CHECK_AFTER = 32  # iterations after a start before rank 0 is first asked (it has a Ti by then)


class PointerError(LocatedError, ValueError):
    """A directory that is not a ray_checkfreq pointer checkpoint, or a damaged one."""


@dataclass(frozen=True, kw_only=True)
class RegistrationConfig:
    """When pointers are reported to Ray Train.

    ``every``: a fixed interval in iterations. None (the default): from the measured cost
    of a report (``report_s`` until measured), so registration takes at most
    ``overhead_share`` of the engine's overhead budget p, and never more often than one
    report per ``min_interval_s`` (Ray Train takes about one report per 2 s poll).
    """

    every: int | None = None
    """A fixed interval in iterations; None: from the measured report cost."""
    overhead_share: float = 0.25
    """Share of p the report barrier may take."""
    report_s: float = 2.0
    """Seconds: the report cost assumed until measured."""
    min_interval_s: float = 2.0
    """Seconds: at most one report per this."""

    def __post_init__(self) -> None:
        if self.every is not None and (isinstance(self.every, bool) or not isinstance(self.every, int)
                                       or self.every < 1):
            raise ValueError(f"every={self.every!r}: must be None or an int >= 1")
        if not 0 < self.overhead_share <= 1:
            raise ValueError(f"overhead_share={self.overhead_share!r}: must be a fraction in (0, 1]")
        for name in ("report_s", "min_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 0 seconds")


def register_every(*, report_s: float, iter_s: float, overhead: float, config: RegistrationConfig) -> int:
    """Iterations between reports: a report costs at most ``overhead_share * overhead``."""
    if config.every is not None:
        return config.every
    if iter_s <= 0:
        return FIRST_CHECK_AFTER
    by_budget = report_s / (config.overhead_share * overhead * iter_s)
    by_poll = config.min_interval_s / iter_s
    return max(1, math.ceil(max(by_budget, by_poll)))


# ------------------------------------------------------------------ pointers
@dataclass(frozen=True, kw_only=True)
class Pointer:
    """What a pointer checkpoint says: a store and one committed step in it.

    ``run_filesystem``: the store lives on the run's storage filesystem (the default
    store), so ``load`` reopens it on the checkpoint's filesystem.
    """

    store_uri: str
    step: int
    run_filesystem: bool

    def encode(self) -> bytes:
        return json.dumps({"format": POINTER_FORMAT, "version": POINTER_VERSION, "store_uri": self.store_uri,
                           "step": self.step, "run_filesystem": self.run_filesystem}).encode()

    @classmethod
    def decode(cls, data: bytes, location: str) -> Pointer:
        try:
            doc = parse_stored_json(data, max_bytes=MAX_POINTER_BYTES)
        except StoredJsonError as err:
            raise PointerError(location, f"not JSON within the limits: {err}") from None
        if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
            raise PointerError(location, f"not a ray_checkfreq pointer (format {POINTER_FORMAT!r} expected)")
        if doc.get("version") != POINTER_VERSION:
            raise PointerError(location, f"pointer version {doc.get('version')!r}, this reader knows "
                                         f"{POINTER_VERSION}")
        step, uri, on_run = doc.get("step"), doc.get("store_uri"), doc.get("run_filesystem")
        if not is_int(step) or not 0 <= step <= MAX_STEP or not isinstance(uri, str) \
                or not uri or not isinstance(on_run, bool):
            raise PointerError(location, f"malformed pointer: {doc!r:.300}")
        return cls(store_uri=uri, step=step, run_filesystem=on_run)


def write_pointer(filesystem: Any, experiment_fs_path: str, pointer: Pointer) -> str:
    """A new pointer directory under the experiment directory; returns its path.

    The path is built with ``os.path.join`` on ``experiment_fs_path`` exactly as Ray Train
    gives it: Ray checks NO_UPLOAD paths by string prefix.
    """
    name = f"{POINTER_PREFIX}{pointer.step:012d}-{uuid.uuid4().hex[:8]}"
    path = os.path.join(experiment_fs_path, name)
    filesystem.create_dir(path, recursive=True)
    partial = f"{path}/.{POINTER_FILE}.partial"
    with filesystem.open_output_stream(partial) as out:
        out.write(pointer.encode())
    filesystem.move(partial, f"{path}/{POINTER_FILE}")  # readers never see half a pointer
    return path


def read_pointer(filesystem: Any, path: str) -> Pointer:
    location = f"{path}/{POINTER_FILE}"
    try:
        with filesystem.open_input_stream(location) as stream:
            data = stream.read()
    except FileNotFoundError:
        raise PointerError(path, f"not a ray_checkfreq pointer checkpoint (no {POINTER_FILE})") from None
    return Pointer.decode(data, location)


def delete_pointer(filesystem: Any, path: str) -> None:
    try:
        filesystem.delete_dir(path)
    except FileNotFoundError:
        pass


class PointedSteps:
    """A store's ``protected_steps``: the steps that the run's live pointers name.

    Picklable (node agents persist with a pickled store). Asked at every retention, so a
    pointer Ray Train deleted stops protecting its step. A listing that fails raises, and
    the store then deletes nothing.
    """

    def __init__(self, filesystem: Any, experiment_fs_path: str, store_uri: str) -> None:
        self.filesystem = filesystem
        self.experiment_fs_path = experiment_fs_path
        self.store_uri = store_uri

    def __call__(self) -> set[int]:
        import pyarrow.fs

        selector = pyarrow.fs.FileSelector(self.experiment_fs_path, allow_not_found=True)
        steps = set()
        for info in self.filesystem.get_file_info(selector):
            if info.type != pyarrow.fs.FileType.Directory or not info.base_name.startswith(POINTER_PREFIX):
                continue
            pointer = self._read(info.path)
            if pointer is not None and pointer.store_uri == self.store_uri:
                steps.add(pointer.step)
        return steps

    def _read(self, path: str) -> Pointer | None:
        try:
            return read_pointer(self.filesystem, path)
        except PointerError as err:  # being deleted by Ray, not ours, or damaged: it protects nothing
            damaged = err.location.endswith(POINTER_FILE)  # the file is there but does not parse
            (logger.warning if damaged else logger.debug)("ignoring pointer %s", err)
            return None


def load(checkpoint: Any, *, store: CheckpointStore | None = None) -> dict:
    """The state a pointer checkpoint names (``Result.checkpoint`` of a run), as
    ``CheckpointStore.load(step)`` returns it: keys "model", "optimizer", ... A sharded
    (FSDP2) run's step comes gathered: every tensor whole, in this process's memory.

    ``store``: where the state lives, for a store the pointer cannot reopen by itself
    (one built with its own filesystem or S3 options).
    """
    path, filesystem = checkpoint.path, checkpoint.filesystem
    pointer = read_pointer(filesystem, path)
    if store is None:
        store = CheckpointStore(pointer.store_uri, filesystem=filesystem if pointer.run_filesystem else None)
    return store.load(pointer.step)


# ---------------------------------------------------------------- cadence
class Registrar:
    """One rank's side of registration; every rank calls ``after_step`` every iteration
    and ``close`` once (both are collectives at the iterations they act)."""

    def __init__(self, *, rank: int, group: Any, store: CheckpointStore, storage: Any,
                 run_filesystem: bool, overhead: float, config: RegistrationConfig, metrics: Callable[[], dict],
                 on_registered: Callable[[int], None] | None = None) -> None:
        self.rank = rank
        self.group = group
        self.store = store
        self.storage = storage  # Ray Train's StorageContext: storage_filesystem, experiment_fs_path
        self.run_filesystem = run_filesystem
        self.overhead = overhead
        self.config = config
        self.metrics = metrics
        self.on_registered = on_registered
        self.committed_step: int | None = None  # rank 0: the newest step known committed
        self.registered_step: int | None = None
        self.registrations = 0
        self.report_s = config.report_s
        self.every: int | None = None
        self.user_metrics: dict[str, Any] = {}  # the newest cf.report(): in every later report
        self._next_check: int | None = None
        self._since: tuple[float, int] | None = None  # (time, iteration) the current interval began
        self._closed = False

    def start(self, iteration: int, committed_step: int | None) -> None:
        self.committed_step = committed_step
        self.registered_step = None
        self._next_check = iteration + (self.config.every or FIRST_CHECK_AFTER)
        self._since = (time.perf_counter(), iteration)

    def committed(self, step: int) -> None:
        """Rank 0: a persist committed ``step`` (called from the persist thread)."""
        if self.committed_step is None or step > self.committed_step:
            self.committed_step = step

    def after_step(self, iteration: int) -> None:
        if self._next_check is None or iteration < self._next_check:
            return
        next_in = self._check(iteration)
        self._next_check = iteration + next_in

    def report_now(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        """Every rank: report ``metrics`` (the user's) now, with a new pointer to the newest
        committed step even when it was registered before, so that they reach
        ``Result.metrics`` (Ray Train takes it from the newest report with a checkpoint)."""
        self.user_metrics = dict(metrics)
        plan = self._plan(iteration, again=True) if self.rank == 0 else None
        plan = broadcast_json(plan, src=0, rank=self.rank, group=self.group)
        self._report(iteration, plan["step"], plan["path"])

    def close(self, iteration: int) -> None:
        """The final registration, after the last checkpoint is durable."""
        if self._closed or self._next_check is None:
            return
        self._closed = True
        self._check(iteration)

    def stats(self) -> dict:
        return {"registered_step": self.registered_step, "registrations": self.registrations,
                "report_s": self.report_s, "every": self.every}

    # --------------------------------------------------------------- inner
    def _check(self, iteration: int) -> int:
        plan = self._plan(iteration) if self.rank == 0 else None
        plan = broadcast_json(plan, src=0, rank=self.rank, group=self.group)
        if plan["step"] is not None:
            self._report(iteration, plan["step"], plan["path"])
        self._since = (time.perf_counter(), iteration)
        return int(plan["next_in"])

    def _plan(self, iteration: int, *, again: bool = False) -> dict:
        self.every = register_every(report_s=self.report_s, iter_s=self._iter_s(iteration),
                                    overhead=self.overhead, config=self.config)
        step = self.committed_step
        if step is None or (step == self.registered_step and not again):
            # Nothing new: ask again soon; a check without a report costs one small broadcast.
            return {"step": None, "path": None, "next_in": max(1, self.every // 4)}
        path = self._write_pointer(step)
        if path is None:
            return {"step": None, "path": None, "next_in": max(1, self.every // 4)}
        return {"step": step, "path": path, "next_in": self.every}

    def _iter_s(self, iteration: int) -> float:
        if self._since is None or iteration <= self._since[1]:
            return 0.0
        return (time.perf_counter() - self._since[0]) / (iteration - self._since[1])

    def _write_pointer(self, step: int) -> str | None:
        fs, root = self.storage.storage_filesystem, self.storage.experiment_fs_path
        path = write_pointer(fs, root, Pointer(store_uri=self.store.uri, step=step, run_filesystem=self.run_filesystem))
        if not any(ref.step == step for ref in self.store.list()):
            logger.warning("step %d left the store before its pointer was written (keep_last=1?): not registered",
                           step)
            delete_pointer(fs, path)
            return None
        return path

    def _report(self, iteration: int, step: int | None, path: str | None) -> None:
        """A report (a barrier: every rank), with the pointer ``path`` to ``step`` (None: metrics only)."""
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        checkpoint = None
        if self.rank == 0 and path is not None:  # only rank 0 names it: every rank's path must agree
            checkpoint = Checkpoint(path, filesystem=self.storage.storage_filesystem)
        metrics = {**self.user_metrics, **self.metrics(), "iteration": iteration}
        if step is not None:
            metrics["checkfreq_step"] = step
        started = time.perf_counter()
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        self.report_s = time.perf_counter() - started
        if step is None:
            return
        self.registered_step = step
        self.registrations += 1
        if self.on_registered is not None:
            self.on_registered(step)
