"""The engine under SIGKILL: 50 seeded kills of a training process while it snapshots and persists.

``tests/test_crash_consistency.py`` kills a bare ``CheckpointStore.save`` loop; this kills
the whole engine (the fenced snapshot, the background persist thread, restore) at seeded
random moments. The model's every value is the iteration it was trained to
(``CountingOptimizer``), so a checkpoint mixing two iterations or a half-written one
shows. After every kill: every committed checkpoint is whole, the newest commit never
goes back, and the next process restores exactly the newest commit, untorn. The loop
runs in a process of its own (``chaos_kill_child.py``), which forks the children.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.chaos

KILLS = 50
SEED = 20261201
HERE = os.path.dirname(os.path.abspath(__file__))


def test_fifty_kills_during_snapshots_and_writes_never_load_a_torn_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(HERE, "chaos_kill_child.py"), str(tmp_path / "ckpt"),
                           str(KILLS), str(SEED)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["failures"] == []
    assert len(summary["restores"]) == KILLS
    assert summary["newest"] > KILLS, "training made progress between kills"
    assert len(set(summary["restores"])) > KILLS // 2, "most restarts resumed from a newer checkpoint"
    assert summary["interrupted"] >= KILLS // 5, f"only {summary['interrupted']} kills landed inside a write"
