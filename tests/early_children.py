"""Long tests whose work runs in a child process with a cluster of its own: each child
starts when the session's collection finishes, so it runs beside the suite's first tests
instead of after them; its test then waits for it and checks what it left.

A test module registers a starter for a test's node id at import (collection); conftest
starts the starters of the selected tests (``start_selected``) and stops what is left at
the session's end (``stop_all``). A child runs with ``RCF_EARLY_CHILD=1`` and starts none
of its own, so a child that is a pytest run of the same test does the work itself.

Only for a child whose checks hold at any speed: it shares the cores with the suite. (The
goodput replay is not one: on a loaded machine its short replay can keep no iteration.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

IN_CHILD = os.environ.get("RCF_EARLY_CHILD") == "1"
Starter = Callable[[Path, dict], subprocess.Popen]


@dataclass
class Finished:
    returncode: int
    output: str
    directory: Path


_starters: dict[str, Starter] = {}
_running: dict[str, tuple[subprocess.Popen, Path]] = {}


def register(node_id: str, starter: Starter) -> None:
    """``starter(directory, env)``: the child of ``node_id``, its output into ``directory/out.log``."""
    _starters[node_id] = starter


def start_selected(node_ids: set[str]) -> None:
    if IN_CHILD:
        return
    for node_id, starter in _starters.items():
        if node_id in node_ids and node_id not in _running:
            directory = Path(tempfile.mkdtemp(prefix="rcf-early-"))
            _running[node_id] = (starter(directory, {**os.environ, "RCF_EARLY_CHILD": "1"}), directory)


def wait(node_id: str, timeout_s: float) -> Finished:
    """The child's end (stopped after ``timeout_s`` from now, which fails its test)."""
    child, directory = _running[node_id]
    deadline = time.monotonic() + timeout_s
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    _end(child)
    output = (directory / "out.log").read_text(errors="replace") if (directory / "out.log").exists() else ""
    return Finished(child.returncode, output, directory)


def stop_all() -> None:
    """End every child; a failed child's directory (its log, its tmp_path) stays for diagnosis."""
    for child, directory in _running.values():
        _end(child)
        if child.returncode == 0:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            print(f"\nan early child failed (exit {child.returncode}); its files are kept in {directory}",
                  file=sys.stderr)
    _running.clear()


def _end(child: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Stop a child still running: SIGINT first, so that a pytest child runs its ``finally``
    blocks (a spot cluster's ``down``) instead of leaving its processes behind; then SIGKILL."""
    if child.poll() is not None:
        return
    child.send_signal(signal.SIGINT)
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def start_logged(command: list[str], directory: Path, env: dict, cwd: Path) -> subprocess.Popen:
    with open(directory / "out.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_default_sigint)


def _default_sigint() -> None:
    """In the child before exec: SIGINT as Python expects it (a shell's background job has it
    ignored, and an ignored signal stays ignored across exec), so ``_end`` can interrupt it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
