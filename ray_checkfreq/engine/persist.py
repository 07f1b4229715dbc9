"""Phase 2 of a checkpoint: encode, write and commit a snapshot in the background.

At most one checkpoint is in flight and none is abandoned: ``submit`` refuses a second
one, ``wait_idle`` blocks until the current one is committed (or failed), and a failure
is kept and raised by the next ``raise_if_failed`` instead of vanishing in the thread.

The persist thread runs at a lower CPU priority (``nice``) than training: where the two
share cores, its encode, checksum and write work fills the gaps training leaves instead
of taking cores from it. Threads it starts (the store's writers) inherit the priority.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ray_checkfreq.engine.snapshot import Snapshot
from ray_checkfreq.engine.threads import BACKGROUND_NICE, lower_thread_priority
from ray_checkfreq.errors import CheckFreqError
from ray_checkfreq.storage import CheckpointStore

logger = logging.getLogger("ray_checkfreq.engine")

PERSIST_NICE = BACKGROUND_NICE


class PersistError(CheckFreqError):
    """A background checkpoint write failed; the cause is chained."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(step, reason)
        self.step = step
        self.reason = reason

    def __str__(self) -> str:
        return f"persisting the checkpoint of iteration {self.step} failed: {self.reason}"


@dataclass(frozen=True)
class PersistResult:
    step: int
    seconds: float  # the whole persist, copy_s included
    copy_s: float  # waiting for the snapshot's copies to land
    codec: str
    raw_bytes: int
    stored_bytes: int
    uri: str


@dataclass(frozen=True)
class Saved:
    """What one save wrote (``PersistThread._save``)."""

    codec: str
    stored_bytes: int
    uri: str


class PersistThread(ABC):
    """The persist thread and its one-job-at-a-time protocol; ``_save`` writes a snapshot."""

    def __init__(self, on_done: Callable[[PersistResult], None] | None = None, nice: int = PERSIST_NICE) -> None:
        self._nice = nice
        self._on_done = on_done
        self._cond = threading.Condition()
        self._job: tuple[Snapshot, dict] | None = None
        self._busy = False
        self._closed = False
        self._error: PersistError | None = None
        self._thread = threading.Thread(target=self._run, name="rcf-persist", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy

    def submit(self, snapshot: Snapshot, **save_options: Any) -> None:
        with self._cond:
            if self._busy:
                raise RuntimeError("a checkpoint is already in flight (call wait_idle first)")
            if self._closed:
                raise RuntimeError("the persist worker is closed")
            self._job = (snapshot, save_options)
            self._busy = True
            self._cond.notify_all()

    def wait_idle(self) -> float:
        """Seconds spent waiting for the in-flight checkpoint to commit."""
        start = time.perf_counter()
        with self._cond:
            while self._busy:
                self._cond.wait()
        return time.perf_counter() - start

    def raise_if_failed(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self.wait_idle()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        lower_thread_priority(self._nice)
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                snapshot, options = self._job
            result, error = self._persist(snapshot, options)
            # Report before going idle: whoever waited for idle sees this checkpoint's figures.
            if result is not None and self._on_done is not None:
                self._on_done(result)
            with self._cond:
                self._job = None
                self._busy = False
                if error is not None:
                    self._error = error
                self._cond.notify_all()

    def _persist(self, snapshot: Snapshot, options: dict) -> tuple[PersistResult | None, PersistError | None]:
        snapshot.copies.wait_complete()  # held open until the next iteration starts: not persist time
        start = time.perf_counter()
        try:
            snapshot.copies.wait()
            copied = time.perf_counter()
            saved = self._save(snapshot, options)
        except PersistError as err:
            return None, err
        except BaseException as err:
            error = PersistError(snapshot.step, f"{type(err).__name__}: {err}")
            error.__cause__ = err
            return None, error
        return PersistResult(
            step=snapshot.step,
            seconds=time.perf_counter() - start,
            copy_s=copied - start,
            codec=saved.codec,
            raw_bytes=snapshot.size_bytes,
            stored_bytes=saved.stored_bytes,
            uri=saved.uri,
        ), None

    @abstractmethod
    def _save(self, snapshot: Snapshot, options: dict) -> Saved:
        """Write the snapshot (its copies have landed); raise on failure."""


class PersistWorker(PersistThread):
    """Saves each snapshot whole with ``CheckpointStore.save`` (one process, or a replica's rank 0)."""

    def __init__(self, store: CheckpointStore, on_done: Callable[[PersistResult], None] | None = None,
                 nice: int = PERSIST_NICE) -> None:
        self.store = store
        super().__init__(on_done, nice)

    def _save(self, snapshot: Snapshot, options: dict) -> Saved:
        ref = self.store.save(snapshot.step, snapshot.state, epoch_boundary=snapshot.epoch_boundary, **options)
        return Saved(codec=str(options.get("codec", self.store.config.codec)), stored_bytes=ref.size_bytes,
                     uri=ref.uri)


class Persister(Protocol):
    """Phase 2 of a checkpoint: ``PersistWorker`` is the in-process one."""

    @property
    def busy(self) -> bool: ...

    def submit(self, snapshot: Snapshot, **options: Any) -> None: ...

    def wait_idle(self) -> float: ...

    def raise_if_failed(self) -> None: ...

    def close(self) -> None: ...


# Called with the engine's store (a CheckpointStore; a ShardedStore in sharded mode) and
# the callback for each persisted checkpoint.
PersisterFactory = Callable[[Any, Callable[[PersistResult], None]], Persister]


class NullPersister:
    """The persister of a rank that takes no snapshots: never busy, refuses work."""

    busy = False

    def submit(self, snapshot: Snapshot, **options: Any) -> None:
        raise RuntimeError("this rank takes no snapshots (EngineSeams.takes_snapshots=False)")

    def wait_idle(self) -> float:
        return 0.0

    def raise_if_failed(self) -> None:
        return None

    def close(self) -> None:
        return None
