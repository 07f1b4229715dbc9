"""Where the engine meets the layer above it: decisions, host memory, persist, RNG states.

``CheckFreq`` takes these by injection (``EngineSeams``); with the defaults it plans and
applies its own decisions in the same step, snapshots into its own buffers and persists
in its own thread. The Ray layer replaces them: rank 0 plans, every rank applies the
same ``Action`` at the same iteration (``lookahead`` iterations after it was planned),
snapshots go into memory a node agent owns, and the agent persists them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

# The seams' protocols live with their owners; named here too, as the engine's API.
from ray_checkfreq.engine.persist import NullPersister, Persister, PersisterFactory
from ray_checkfreq.engine.snapshot import HostMemory, Layout

__all__ = ["CODECS", "Action", "DecisionChannel", "EngineSeams", "HostMemory",
           "Layout", "LocalDecisions", "NullPersister", "Persister", "PersisterFactory", "local_rng_state",
           "set_local_rng_state"]

CODECS = ("raw", "rcfz")  # the codecs an Action may name (the Ray wire format sends the index)
_INT64_MAX = 2**63 - 1  # every int of an Action fits the int64 wire format (ray/decisions.py)


@dataclass(frozen=True, kw_only=True)
class Action:
    """What every rank does right after ``step()`` counted ``iteration`` (1-based)."""

    iteration: int
    checkpoint: bool = False
    epoch_boundary: bool = False
    codec: str | None = None  # None: the store's default
    k: int | None = None  # the k in force; None while it is still being profiled
    stop: bool = False  # a preemption: the engine only records it (stop_requested)

    def __post_init__(self) -> None:
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int) \
                or not 1 <= self.iteration <= _INT64_MAX:
            raise ValueError(f"Action(iteration={self.iteration!r}): must be an int in [1, 2**63)")
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int)
                                   or not 1 <= self.k <= _INT64_MAX):
            raise ValueError(f"Action(k={self.k!r}): must be None or an int in [1, 2**63)")
        if self.codec is not None and self.codec not in CODECS:
            raise ValueError(f"Action(codec={self.codec!r}): must be None or one of {CODECS}")


class DecisionChannel(Protocol):
    """How the planner's actions reach every rank."""

    lookahead: int  # iterations between planning an action and applying it
    is_planner: bool  # True on the one rank that plans

    def exchange(self, planned: Action | None) -> Action | None:
        """Hand over the planner's action for iteration now + lookahead (None elsewhere);
        returns the action to apply now (None: nothing). A channel may hold the hand-over
        back while the returned action is applied: the engine then calls its
        ``hand_over()`` (an optional method) once it has applied it, whatever happened."""
        ...


class LocalDecisions:
    """One process plans and applies in the same step."""

    lookahead = 0
    is_planner = True

    def exchange(self, planned: Action | None) -> Action | None:
        return planned


def local_rng_state() -> dict:
    """This process's torch, numpy, Python (and CUDA, once initialized) RNG states."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": _python_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_local_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    _set_python_rng_state(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_rng_state() -> dict:
    """``random.getstate()`` with its 625 words as one uint32 array: a tuple of 625 ints
    would be 625 leaves for every snapshot to walk, on the critical path."""
    version, words, gauss_next = random.getstate()
    return {"version": version, "words": np.array(words, dtype=np.uint32), "gauss_next": gauss_next}


def _set_python_rng_state(state: Any) -> None:
    """Either form: the dict above, or ``random.getstate()``'s tuple (checkpoints before it)."""
    if isinstance(state, Mapping):
        state = (state["version"], tuple(state["words"].tolist()), state["gauss_next"])
    random.setstate(state)


@dataclass(kw_only=True)
class EngineSeams:
    """The ray layer's hook into ``CheckFreq``; the defaults are the single-process engine.

    ``takes_snapshots=False``: a rank that applies every action (and calls ``rng_state``,
    which may be a collective, once per checkpoint action) but neither snapshots nor
    persists.
    """

    decisions: DecisionChannel = field(default_factory=LocalDecisions)
    persister: PersisterFactory | None = None  # None: PersistWorker(store, on_done=...)
    host_memory: HostMemory | None = None  # None: the Snapshotter's own buffers
    rng_state: Callable[[], Any] = local_rng_state
    set_rng_state: Callable[[Any], None] = set_local_rng_state
    takes_snapshots: bool = True
    # Called with (iteration, iter_s, stall_s, busy) for every timed iteration (say, to feed
    # a policy shared by all ranks); it must not block.
    observe: Callable[[int, float, float, bool], None] | None = None
    # False: the planner's k adapts elsewhere (a policy shared by all ranks calls set_k).
    local_adaptive: bool = True
    # Called with each PersistResult of this rank's persister (from its thread; on rank 0 of
    # a sharded state, after the global commit); it must not block.
    on_persisted: Callable[[Any], None] | None = None
    # Sharded mode: called by the persist thread with each snapshot once its copies landed,
    # before its part is written (the Ray layer seals the snapshot's slot and starts its
    # peer copy); it must not block on other ranks.
    seal_snapshot: Callable[[Any], None] | None = None
    # The engine's clock for iteration times and stalls (a simulated one in tests).
    clock: Callable[[], float] = time.perf_counter
    # Sharded mode on several ranks: a gloo group of every rank, in which a restore agrees
    # on its step and on whether every rank read its part (engine/agreement.py). None: the
    # engine makes one when a restore first needs it (every rank restores at once).
    restore_group: Any = None

    def __post_init__(self) -> None:
        lookahead = self.decisions.lookahead
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"decisions.lookahead={lookahead!r}: must be an int >= 0")
