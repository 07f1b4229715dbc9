"""Hold points: make a process stop inside a phase (snapshot, persist, commit) so a kill lands there.

The injector *arms* a phase by creating ``arm-<phase>`` in a control directory. The first
process that reaches that phase claims the file (an atomic rename, so exactly one does),
writes ``inside-<phase>.json`` (its pid and the step), and sleeps; the injector reads the
marker and SIGKILLs that pid while it sleeps. Nothing is armed: a hold point costs one
``stat``. The control directory must be visible to every process (true on one machine,
which is where ``cluster_utils.Cluster`` runs its nodes).

Where the holds are: ``snapshot`` in the training worker, before its slot is sealed
COMPLETE (``HeldSeal`` around ``MappedSlot.finish_write``); ``persist`` when a shard file
of a checkpoint is opened for writing, and ``commit`` between writing the manifest's
temporary file and renaming it into place, both in the process that persists (the node
agent), through ``HoldingFileSystem`` (a ``pyarrow.fs.PyFileSystem`` handler over the local
file system that the chaos job's store writes through).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pyarrow.fs as pafs

PHASES = ("snapshot", "persist", "commit")
MANIFEST_SUFFIX = "/manifest.json"


def _arm_path(control_dir: str, phase: str) -> str:
    return os.path.join(control_dir, f"arm-{phase}")


def _inside_path(control_dir: str, phase: str) -> str:
    return os.path.join(control_dir, f"inside-{phase}.json")


def arm(control_dir: str, phase: str, *, hold_s: float) -> None:
    """The next process to reach ``phase`` stops there for up to ``hold_s`` seconds."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: expected one of {', '.join(PHASES)}")
    os.makedirs(control_dir, exist_ok=True)
    _remove(_inside_path(control_dir, phase))
    with open(_arm_path(control_dir, phase), "w") as out:
        out.write(json.dumps({"hold_s": hold_s}))


def disarm(control_dir: str, phase: str) -> None:
    _remove(_arm_path(control_dir, phase))
    _remove(_inside_path(control_dir, phase))


def inside(control_dir: str, phase: str) -> dict | None:
    """The marker of the process held in ``phase`` (pid, step, time), or None yet."""
    try:
        with open(_inside_path(control_dir, phase)) as lines:
            return json.loads(lines.read())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def hold_here(control_dir: str | None, phase: str, **where: Any) -> None:
    """Called at a hold point: sleep there if ``phase`` is armed and this process claims it."""
    if control_dir is None or not os.path.exists(_arm_path(control_dir, phase)):
        return
    claimed = os.path.join(control_dir, f"claimed-{phase}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(_arm_path(control_dir, phase), claimed)
    except FileNotFoundError:  # another process claimed it first
        return
    with open(claimed) as lines:
        hold_s = float(json.loads(lines.read())["hold_s"])
    marker = {"pid": os.getpid(), "phase": phase, "t": time.time(), "node": _node_id(), **where}
    tmp = _inside_path(control_dir, phase) + f".{os.getpid()}"
    with open(tmp, "w") as out:
        out.write(json.dumps(marker))
    os.rename(tmp, _inside_path(control_dir, phase))
    time.sleep(hold_s)  # the injector kills this process now; waking up means nobody did


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # outside Ray, or a runtime without a node: the pid is what matters
        return None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class HoldingFileSystem(pafs.FileSystemHandler):
    """The local file system, with the ``persist`` and ``commit`` hold points of a checkpoint write.

    Use as ``pyarrow.fs.PyFileSystem(HoldingFileSystem(control_dir))``; it pickles, so a
    store on it reaches the node agents with its holds.
    """

    def __init__(self, control_dir: str) -> None:
        self.control_dir = control_dir
        self.local = pafs.LocalFileSystem()

    def __reduce__(self) -> tuple:
        return (HoldingFileSystem, (self.control_dir,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HoldingFileSystem) and other.control_dir == self.control_dir

    def __hash__(self) -> int:
        return hash(("HoldingFileSystem", self.control_dir))

    def get_type_name(self) -> str:
        return "rcf-holding"

    def normalize_path(self, path: str) -> str:
        return self.local.normalize_path(path)

    def equals(self, other: Any) -> bool:
        return self == other

    def get_file_info(self, paths: list[str]) -> list:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list:
        return self.local.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("HoldingFileSystem refuses to empty the root directory")

    def delete_file(self, path: str) -> None:
        self.local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        if dest.endswith(MANIFEST_SUFFIX):
            hold_here(self.control_dir, "commit", path=dest)
        self.local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.local.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.local.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        if _is_shard(path):
            hold_here(self.control_dir, "persist", path=path)
        return self.local.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any = None) -> Any:
        return self.local.open_append_stream(path, metadata=metadata)


def _is_shard(path: str) -> bool:
    """A data file inside a checkpoint directory (not its manifest, not a temporary file)."""
    parent, name = os.path.split(path)
    return os.path.basename(parent).startswith("step-") and not name.startswith("manifest") \
        and not name.endswith(".tmp")


def holding_filesystem(control_dir: str) -> pafs.PyFileSystem:
    return pafs.PyFileSystem(HoldingFileSystem(control_dir))


class HeldSeal:
    """Installs the ``snapshot`` hold point in this process: before a slot is sealed COMPLETE."""

    installed = False

    @classmethod
    def install(cls, control_dir: str) -> None:
        from ray_checkfreq.ray import slots

        if cls.installed:
            return
        original = slots.MappedSlot.finish_write

        def finish_write(self: Any, state: Any) -> Any:
            hold_here(control_dir, "snapshot", step=self.header().step, path=self.path)
            return original(self, state)

        slots.MappedSlot.finish_write = finish_write  # type: ignore[method-assign]
        cls.installed = True
