"""What the actors of one schedule were told and did, and the invariants checked on it.

(a) A directory any writer or reader was told is committed stays loadable whole, with its
    own values, until a retention removes it; a retention that began after a pointer
    named its step never removes it.
(b) ``latest()`` never goes back: a call that starts after another ended returns a
    checkpoint at least as new.
(c) A fenced writer ends with ``FencedWriterError`` by name (no other error) and leaves no
    file outside committed directories.
(d) After a clean generation, nothing is left but what retention keeps.
(e) A step whose every writer wrote its part and returned from ``try_commit`` is committed
    (runner.py checks it from the workload's record).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ray_checkfreq.chaos.commit_sim.memory_backend import SimFile
from ray_checkfreq.storage import commit
from ray_checkfreq.storage.manifest import MANIFEST_NAME
from ray_checkfreq.storage.names import parse_checkpoint_dir

OrderKey = tuple[int, int, int, str]


@dataclass(frozen=True)
class LatestCall:
    actor: str
    started: int
    ended: int
    key: OrderKey | None


@dataclass
class History:
    clock: Callable[[], int]
    told: dict[str, str] = field(default_factory=dict)  # directory -> who was told first
    retired: dict[str, tuple[int, str]] = field(default_factory=dict)  # directory -> (tick, by whom)
    undone: dict[str, str] = field(default_factory=dict)  # directory -> the writer that removed its own manifest
    pointers: dict[int, int] = field(default_factory=dict)  # step -> tick a pointer was confirmed
    housekeeping_started: dict[str, int] = field(default_factory=dict)  # actor -> tick of its last start
    removing: set[str] = field(default_factory=set)  # actors inside commit.remove_committed (retention, delete)
    latest_calls: list[LatestCall] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def tell(self, name: str, actor: str) -> None:
        self.told.setdefault(name, actor)

    def violate(self, text: str) -> None:
        self.violations.append(f"tick {self.clock()}: {text}")

    def on_delete(self, path: str, gone: SimFile, by: str) -> None:
        """The backend's hook: a real manifest deleted by a removal of a committed directory
    (retention, ``delete``) is a retirement; by anything else, an undo."""
        directory, _, name = path.rpartition("/")
        if name != MANIFEST_NAME or not gone.data or commit.is_abandon_record(gone.data):
            return
        if by not in self.removing:
            self.undone[directory] = by
            return
        self.retired[directory] = (self.clock(), by)
        parsed = parse_checkpoint_dir(directory)
        registered = self.pointers.get(parsed[0]) if parsed else None
        began = self.housekeeping_started.get(by)
        if directory in self.told and registered is not None and began is not None and began > registered:
            self.violate(f"(a) {by} removed {directory}, step {parsed[0] if parsed else '?'}, which a pointer "
                         f"had protected since tick {registered}; its housekeeping began at tick {began}")

    def record_latest(self, actor: str, started: int, key: OrderKey | None) -> None:
        call = LatestCall(actor, started, self.clock(), key)
        for earlier in self.latest_calls:
            if earlier.ended < call.started and _older(call.key, earlier.key):
                self.violate(f"(b) latest() went back: {earlier.actor} got {_show(earlier.key)} by tick "
                             f"{earlier.ended}, then {actor} got {_show(call.key)} from tick {call.started}")
                break
        self.latest_calls.append(call)


def _older(key: OrderKey | None, than: OrderKey | None) -> bool:
    if than is None:
        return False
    return key is None or key < than


def _show(key: OrderKey | None) -> str:
    return "nothing" if key is None else key[3]
