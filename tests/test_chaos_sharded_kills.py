"""The sharded N-writer commit under SIGKILL and zombie writers: seeded rounds of three real
writer processes, killed (or one frozen) at random moments.

``tests/test_sharded_store.py`` drives ``CheckpointStore``'s commit protocol step by step, with
threads; this kills real writer processes wherever they happen to be: writing a data file,
creating a part manifest, committing, cleaning up. Every round is a new writer generation
(as a restarted job is) that salvages and resumes after the newest commit. Every value is
``step * scale + position`` and every skeleton names its step and generation, so a torn or
mixed checkpoint shows. After every round: each committed step loads whole with its own
values, no directory holds a global manifest without all its files, and the newest commit
never goes back. Some rounds freeze a writer (SIGSTOP) instead of killing it, let the next
generation commit, then let it run on (SIGCONT): the zombie must be fenced by name, or
commit only an old step of its own generation that never becomes the newest. At the end a
clean generation commits three steps, and nothing is left but the checkpoints retention
keeps, holding only the files their manifests list. The loop runs in a process of its own
(``chaos_sharded_kill_child.py``), which forks the writers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.chaos

ROUNDS = 20
ZOMBIE_ROUNDS = 5  # rounds 1, 5, 9, 13, 17
SEED = 20260514
HERE = os.path.dirname(os.path.abspath(__file__))


def test_writers_killed_or_frozen_at_random_never_leave_a_torn_or_orphaned_step(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(HERE, "chaos_sharded_kill_child.py"), str(tmp_path / "ckpt"),
                           str(ROUNDS), str(SEED)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["failures"] == []
    newest = summary["newest"]
    assert newest[-1] > newest[ROUNDS // 2] > newest[0], f"no progress between kills: {newest}"
    assert summary["kills_inside_writes"] >= summary["kills"] // 2, summary["kill_phases"]
    assert summary["interrupted_rounds"] >= ROUNDS // 2, summary["leftovers"]
    zombies = summary["zombies"]
    assert len(zombies) == ZOMBIE_ROUNDS
    for zombie in zombies:
        assert zombie["ended"] == "fenced" or zombie["committed_own_old_step"], zombie
        assert zombie["left_behind"] == [], zombie
    assert summary["orphans"] == []
