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

This is the one fault-injection mechanism for processes the product starts (node agents,
training workers): nothing of it is in a product class. An arm may name the first step it
applies to (``from_step``: a persist of an earlier step that is still on its way passes)
and the nodes whose processes may claim it; ``release`` ends a hold early (a test that
lets a held persist go on once a restart has chosen its source).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Collection
from typing import Any

import pyarrow.fs as pafs

from ray_checkfreq.storage.names import parse_checkpoint_dir

PHASES = ("snapshot", "persist", "commit")
MANIFEST_SUFFIX = "/manifest.json"
RELEASE_POLL_S = 0.05


def _arm_path(control_dir: str, phase: str) -> str:
    return os.path.join(control_dir, f"arm-{phase}")


def _inside_path(control_dir: str, phase: str) -> str:
    return os.path.join(control_dir, f"inside-{phase}.json")


def _release_path(control_dir: str, phase: str) -> str:
    return os.path.join(control_dir, f"release-{phase}")


def arm(control_dir: str, phase: str, *, hold_s: float, from_step: int | None = None,
        nodes: Collection[str] | None = None) -> None:
    """The next process to reach ``phase`` (at a step >= ``from_step``, on one of ``nodes``,
    where given) stops there for up to ``hold_s`` seconds, or until ``release``."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: expected one of {', '.join(PHASES)}")
    os.makedirs(control_dir, exist_ok=True)
    _remove(_inside_path(control_dir, phase))
    _remove(_release_path(control_dir, phase))
    spec = {"hold_s": hold_s, "from_step": from_step, "nodes": sorted(nodes) if nodes is not None else None}
    tmp = _arm_path(control_dir, phase) + f".{os.getpid()}"
    with open(tmp, "w") as out:
        out.write(json.dumps(spec))
    os.rename(tmp, _arm_path(control_dir, phase))  # a reader never sees half a spec


def disarm(control_dir: str, phase: str) -> None:
    _remove(_arm_path(control_dir, phase))
    _remove(_inside_path(control_dir, phase))
    _remove(_release_path(control_dir, phase))


def release(control_dir: str, phase: str) -> None:
    """The process held in ``phase`` (now or later: the arm stays) goes on at once."""
    os.makedirs(control_dir, exist_ok=True)
    with open(_release_path(control_dir, phase), "w"):
        pass


def inside(control_dir: str, phase: str) -> dict | None:
    """The marker of the process held in ``phase`` (pid, step, time), or None yet."""
    try:
        with open(_inside_path(control_dir, phase)) as lines:
            return json.loads(lines.read())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def hold_here(control_dir: str | None, phase: str, *, step: int | None = None, **where: Any) -> None:
    """Called at a hold point: sleep there if ``phase`` is armed for this step and node and
    this process claims it."""
    if control_dir is None or not os.path.exists(_arm_path(control_dir, phase)):
        return
    try:
        with open(_arm_path(control_dir, phase)) as lines:
            spec = json.loads(lines.read())
    except FileNotFoundError:  # another process claimed it first
        return
    node = _node_id()
    if not _applies(spec, step=step, node=node):
        return
    claimed = os.path.join(control_dir, f"claimed-{phase}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(_arm_path(control_dir, phase), claimed)
    except FileNotFoundError:  # another process claimed it first
        return
    marker = {"pid": os.getpid(), "phase": phase, "t": time.time(), "node": node, "step": step, **where}
    tmp = _inside_path(control_dir, phase) + f".{os.getpid()}"
    with open(tmp, "w") as out:
        out.write(json.dumps(marker))
    os.rename(tmp, _inside_path(control_dir, phase))
    # The injector kills this process now, or releases it; waking up at the end means neither did.
    deadline = time.monotonic() + float(spec["hold_s"])
    while time.monotonic() < deadline and not os.path.exists(_release_path(control_dir, phase)):
        time.sleep(min(RELEASE_POLL_S, max(0.0, deadline - time.monotonic())))


def _applies(spec: dict, *, step: int | None, node: str | None) -> bool:
    from_step, nodes = spec.get("from_step"), spec.get("nodes")
    if from_step is not None and (step is None or step < from_step):
        return False
    return nodes is None or node in nodes


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
            hold_here(self.control_dir, "commit", step=_step_of(dest), path=dest)
        self.local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.local.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.local.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        if _is_shard(path):
            hold_here(self.control_dir, "persist", step=_step_of(path), path=path)
        return self.local.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any = None) -> Any:
        return self.local.open_append_stream(path, metadata=metadata)


def _is_shard(path: str) -> bool:
    """A data file inside a checkpoint directory (not its manifest, not a temporary file)."""
    parent, name = os.path.split(path)
    return os.path.basename(parent).startswith("step-") and not name.startswith("manifest") \
        and not name.endswith(".tmp")


def _step_of(path: str) -> int | None:
    parsed = parse_checkpoint_dir(os.path.basename(os.path.dirname(path)))
    return parsed[0] if parsed is not None else None


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
