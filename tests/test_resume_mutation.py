"""The resume checks can fail: with `CheckFreq.restore()` broken on purpose they go red.

Each mutant (tests/mutants/sitecustomize.py) is switched on by an environment variable
in a pytest subprocess and in every process it starts, the demo's included. A
deterministic job retrained from scratch ends with the same weights as a resumed one,
so only the checks against the store's newest checkpoint can catch these; the tests
below demand that each resume test fails, and fails for that reason. (With the real
restore the same tests pass: that is the normal run of the suite.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = Path(__file__).resolve().parent / "mutants"
ENGINE_RESUME_TESTS = (
    "tests/test_engine.py::test_restore_after_a_crash_is_bit_identical_to_an_uninterrupted_run",
    "tests/test_engine.py::test_the_profile_is_cached_and_reused_after_a_graceful_restart",
    "tests/test_engine_with_data.py::test_resume_mid_epoch_is_exact_and_sees_every_sample_once",
)
DEMO_RESUME_TEST = "tests/test_demo.py::test_demo_resumes_at_the_newest_checkpoint_after_a_sigkill"
REASON = "not at the newest committed checkpoint"


MUTANT_RUNS = {
    "restore-noop": (*ENGINE_RESUME_TESTS, DEMO_RESUME_TEST),
    "restore-previous": ENGINE_RESUME_TESTS,
}


def _start_under(mutant: str, node_ids: tuple[str, ...], tmp_path: Path) -> subprocess.Popen:
    """A pytest child running ``node_ids`` with the mutant on."""
    env = {**os.environ, "RAY_CHECKFREQ_MUTANT": mutant,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(MUTANTS), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base"),
         f"--junit-xml={tmp_path / 'report.xml'}", *node_ids],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.fixture(scope="module")
def mutant_runs(tmp_path_factory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """Both mutants' children, started together (two cores, no shared files); each test waits for its own."""
    runs = {}
    for mutant, node_ids in MUTANT_RUNS.items():
        directory = tmp_path_factory.mktemp(mutant)
        runs[mutant] = (_start_under(mutant, node_ids, directory), directory)
    yield runs
    for child, _ in runs.values():
        child.kill()


def _finish(mutant: str, runs: dict[str, tuple[subprocess.Popen, Path]]) -> dict[str, str | None]:
    """{node id: failure text, or None if it passed} of the mutant's child."""
    child, directory = runs[mutant]
    stdout, stderr = child.communicate(timeout=420)
    assert f"mutant active: {mutant}" in stderr, "the mutant was not loaded:\n" + stderr[-2000:]
    assert child.returncode == 1, f"pytest exited with {child.returncode}:\n{stdout[-3000:]}"
    return _outcomes(directory / "report.xml")


def _outcomes(report: Path) -> dict[str, str | None]:
    outcomes: dict[str, str | None] = {}
    for case in ET.parse(report).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        failure = case.find("failure")
        error = case.find("error")
        bad = failure if failure is not None else error
        outcomes[f"{path}::{case.get('name')}"] = None if bad is None else (bad.get("message", "") + (bad.text or ""))
    return outcomes


@pytest.mark.parametrize(("mutant", "node_ids"), MUTANT_RUNS.items())
def test_every_resume_check_fails_when_restore_does_not_resume_from_the_newest(mutant, node_ids, mutant_runs):
    outcomes = _finish(mutant, mutant_runs)
    assert set(outcomes) == set(node_ids), f"ran {sorted(outcomes)}"
    for node_id, failure in outcomes.items():
        assert failure is not None, f"{node_id} passed with restore() broken ({mutant})"
        assert REASON in failure, f"{node_id} failed for another reason:\n{failure[-2000:]}"
