"""Every example runs with a short setting, so none rots.

Each runs as a child process (`python examples/x.py ...`), as a user would. The
single-process ones are killed by SIGKILL mid-run and rerun: the rerun must start at the
newest checkpoint the store committed (> 0) and end with the weights of an uninterrupted
run. The Ray ones start their own local Ray cluster (`ray.init(address="local")`), apart
from the test session's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ray_checkfreq import CheckpointStore

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The Train controller polls its workers every 0.5 s (default 2): a run's end and a killed
# worker are seen sooner.
RAY_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30", "RAY_DEDUP_LOGS": "0",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def _example_command(name: str, *args: str) -> tuple[list[str], dict[str, str]]:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_ENV)
    return [sys.executable, str(EXAMPLES / name), *args], env


def run_example(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command, env = _example_command(name, *args)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def start_example(name: str, *args: str) -> subprocess.Popen:
    """The example running beside the test (collect it with ``finish_example``)."""
    command, env = _example_command(name, *args)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish_example(child: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    stdout, stderr = child.communicate(timeout=timeout)
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def succeeded(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def found(pattern: str, text: str) -> re.Match:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in:\n{text[-3000:]}"
    return match


def crash_then_resume(name: str, tmp_path: Path, crash_at: int, k: int, *args: str) -> None:
    """Kill the example at ``crash_at``, rerun it; the rerun resumes at the newest commit and ends
    with the weights of an uninterrupted run."""
    storage = str(tmp_path / "ckpt")
    # The uninterrupted run shares no file with the other two: it runs beside them.
    uninterrupted = start_example(name, "--storage", str(tmp_path / "whole"), "--every", str(k), *args)
    try:
        crashed = run_example(name, "--storage", storage, "--crash-at", str(crash_at), "--every", str(k), *args)
        assert crashed.returncode == -signal.SIGKILL, crashed.stdout[-2000:] + crashed.stderr[-3000:]
        newest = CheckpointStore(storage).latest()
        assert newest is not None and 0 < newest.step <= crash_at
        assert crash_at - newest.step <= 2 * k
        resumed = succeeded(run_example(name, "--storage", storage, "--every", str(k), *args))
        assert int(found(r"started at iteration (\d+)", resumed).group(1)) == newest.step
        whole = succeeded(finish_example(uninterrupted))
        assert found(r"started at iteration (\d+)", whole).group(1) == "0"
    finally:
        uninterrupted.kill()
    digest = r"weights digest ([0-9a-f]{16})"
    assert found(digest, resumed).group(1) == found(digest, whole).group(1)


def test_minimal_loop_resumes_after_sigkill_with_the_weights_of_an_uninterrupted_run(tmp_path):
    crash_then_resume("minimal_loop.py", tmp_path, 37, 5, "--iterations", "60")


def test_gpt_bf16_resumes_after_sigkill_with_the_weights_of_an_uninterrupted_run(tmp_path):
    crash_then_resume("gpt_bf16.py", tmp_path, 17, 5, "--iterations", "30", "--layers", "1", "--width", "32",
                      "--batch", "16")
    saved = CheckpointStore(str(tmp_path / "whole")).load()
    assert str(saved["model"]["tokens.weight"].dtype) == "torch.bfloat16"


def test_dali_pipeline_resumes_after_sigkill_with_the_weights_of_an_uninterrupted_run(tmp_path):
    pytest.importorskip("nvidia.dali")
    crash_then_resume("dali_pipeline.py", tmp_path, 17, 5, "--iterations", "30", "--batch", "32")


@pytest.mark.chaos
def test_ray_train_script_resumes_by_itself_with_a_diff_under_10_lines(tmp_path):
    out = succeeded(run_example("ray_train_script.py", "--crash-at", "30", "--storage", str(tmp_path), timeout=420))
    assert int(found(r"differs from the plain Ray Train script in (\d+) lines", out).group(1)) < 10
    assert found(r"attempt 1: 2 workers, started at iteration (\d+)", out).group(1) == "0"
    second = found(r"attempt 2: 2 workers, started at iteration (\d+) \(restored from (\w+)", out)
    assert 0 < int(second.group(1)) <= 30 and second.group(2) in ("slot", "storage")
    assert float(found(r"held-out accuracy ([\d.]+)", out).group(1)) > 0.5


@pytest.mark.chaos
def test_ray_data_elastic_resumes_on_one_worker_with_every_sample_once(tmp_path):
    out = succeeded(run_example("ray_data_elastic.py", "--storage", str(tmp_path), "--every", "4", "--epochs", "1",
                                "--crash-at", "18", timeout=420))
    assert found(r"phase 1: (\d+) workers, started at iteration 0", out).group(1) == "2"
    resumed = found(r"phase 2: 1 worker\(s\), resumed at iteration (\d+) from storage", out)
    assert 18 - 2 * 4 <= int(resumed.group(1)) <= 18  # a commit at k = 4 lost at most 2k before the loss at 18
    assert out.count("every sample exactly once: True") == 1  # the one epoch
