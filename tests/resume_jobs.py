"""Crash a training job with SIGKILL in a child process, then judge how it resumed.

A job run in the child records every finished iteration (its k and the samples it
trained on) in a progress file, one write(2) per line, so the record survives the
SIGKILL; nothing is closed or flushed before the kill. The parent then reads the
store's newest committed checkpoint itself and checks the restarted run against it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_checkfreq import CheckpointStore

CHILD_TIMEOUT_S = 240


class Progress:
    """The child's side: an append-only record of finished iterations, and the kill."""

    def __init__(self, path: str | Path | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if path else None
        self._steady = False
        self._committed_when_k_chosen: int | None = None

    def record(self, iteration: int, stats: dict, samples: Sequence[int] = ()) -> None:
        """After ``cf.step()``: the iteration, ``cf.stats()`` and the samples it trained on."""
        k, committed = stats["k"], stats["checkpoints_committed"]
        if k is not None and self._committed_when_k_chosen is None:
            self._committed_when_k_chosen = committed
        # The 2k bound holds once a checkpoint taken at the chosen k has committed; a crash
        # in the profiling window or just after it may lose the whole window.
        self._steady = self._committed_when_k_chosen is not None and committed > self._committed_when_k_chosen
        if self._fd is not None:
            line = json.dumps({"iteration": iteration, "k": k, "samples": list(samples)}) + "\n"
            os.write(self._fd, line.encode())

    def kill_if(self, iteration: int, kill_at: int | None) -> None:
        """SIGKILL this process (a preemption: nothing flushed) at ``kill_at`` or, if the
        policy has not reached its steady state there, as soon as it has."""
        if kill_at is not None and iteration >= kill_at and self._steady:
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Crash:
    """What the killed child had done: iterations finished, k after each, samples trained."""

    kill_iteration: int
    k_after: dict[int, int | None]
    samples: list[int]


def crash_in_child(job: Callable[..., Any], progress: Path, **kwargs: Any) -> Crash:
    """Run ``job(progress=..., **kwargs)`` in a spawned process that must die by SIGKILL."""
    child = multiprocessing.get_context("spawn").Process(target=job, kwargs={"progress": str(progress), **kwargs})
    child.start()
    child.join(CHILD_TIMEOUT_S)
    if child.is_alive():
        child.kill()
        child.join()
        raise AssertionError(f"the child running {job.__name__} did not reach its kill point")
    assert child.exitcode == -signal.SIGKILL, f"the child exited with {child.exitcode}, not by SIGKILL"
    return read_progress(progress)


def read_progress(path: Path) -> Crash:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return Crash(
        kill_iteration=rows[-1]["iteration"] if rows else 0,
        k_after={row["iteration"]: row["k"] for row in rows},
        samples=[s for row in rows for s in row["samples"]],
    )


@dataclass(frozen=True)
class Newest:
    """The newest committed checkpoint as the store reports it, with the k it recorded."""

    step: int
    k: int | None


def newest_committed(uri: str) -> Newest:
    store = CheckpointStore(uri)
    ref = store.latest()
    assert ref is not None, f"the crashed run committed no checkpoint in {uri}"
    return Newest(step=ref.step, k=store.load(ref)["checkfreq"]["k"])


def k_bound(crash: Crash, newest: Newest) -> int:
    """The largest k in force from the newest checkpoint to the kill (the adaptive rate may raise it)."""
    ks = [newest.k] + [k for it, k in crash.k_after.items() if newest.step <= it <= crash.kill_iteration]
    known = [k for k in ks if k is not None]
    assert known, "no k was recorded between the newest checkpoint and the kill"
    return max(known)


def assert_began_at_newest(newest_step: int, *, start: int, executed: int, total: int) -> None:
    """The restarted run began at the newest committed iteration (> 0) and ran only the rest."""
    assert newest_step > 0, f"the newest committed checkpoint is iteration {newest_step}: nothing to resume"
    assert start == newest_step, (
        f"the restarted run began at iteration {start}, not at the newest committed checkpoint "
        f"(iteration {newest_step})"
    )
    assert executed == total - newest_step, (
        f"the restarted run executed {executed} iterations; only the remaining {total - newest_step} "
        f"after iteration {newest_step} were due"
    )


def assert_resumed_at_newest(crash: Crash, newest: Newest, *, start: int, executed: int, total: int) -> None:
    """As above, and the work lost to the crash is at most 2k."""
    assert_began_at_newest(newest.step, start=start, executed=executed, total=total)
    lost, k = crash.kill_iteration - start, k_bound(crash, newest)
    assert 0 <= lost <= 2 * k, f"killed at {crash.kill_iteration}, resumed at {start}: lost {lost} > 2k = {2 * k}"
