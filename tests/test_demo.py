"""The single-process demo (examples/demo.py): SIGKILL, restart at the newest committed checkpoint, bit-identical end.

The demo runs here in its two stages so that the test can read the store between the
kill and the restart, and hold the demo's printed resume iteration against it.
"""

import re
import signal
import subprocess
import sys
from pathlib import Path

from ray_checkfreq import CheckpointStore

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def _demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=300)


def test_demo_resumes_at_the_newest_checkpoint_after_a_sigkill(tmp_path):
    storage, progress = str(tmp_path / "ckpt"), str(tmp_path / "run1.txt")
    crashed = _demo("--stage", "crash", "--storage", storage, "--progress", progress)
    assert crashed.returncode == 0, crashed.stderr
    assert f"(exit status {-signal.SIGKILL})" in crashed.stdout
    killed_at = int(re.search(r"killed by SIGKILL at iteration (\d+)", crashed.stdout).group(1))
    assert max(int(line.split()[0]) for line in Path(progress).read_text().splitlines()) == killed_at
    newest = CheckpointStore(storage).latest()
    assert newest is not None and 0 < newest.step <= killed_at

    resumed = _demo("--stage", "resume", "--storage", storage, "--progress", progress)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    start = int(re.search(r"resumed at iteration (\d+)", resumed.stdout).group(1))
    assert start == newest.step, f"the demo resumed at {start}; the store's newest checkpoint was {newest.step}"
    assert f"newest committed checkpoint before the restart is iteration {newest.step}" in resumed.stdout
    for claim in ("exactly the samples the uninterrupted run read after that point: True",
                  "every sample exactly once per epoch: True",
                  "final weights bit-identical to an uninterrupted run: True"):
        assert claim in resumed.stdout
