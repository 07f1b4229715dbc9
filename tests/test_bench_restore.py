"""``ray-checkfreq bench restore``: a smoke run (its own 2-node cluster, in a child process) and its parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import restore_state

SOURCES = {
    "own-node slot",
    "other-node slot, broadcast",
    "other-node slot, object store",
    "local raw, page cache dropped",
    "local rcfz, page cache dropped",
    "s3 raw (loopback moto)",
    "s3 rcfz (loopback moto)",
}


def _leftover_slots() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("rcf-bench-restore-")}


@pytest.mark.s3
def test_smoke_run_restores_every_source_bit_identical(tmp_path):
    before = _leftover_slots()
    out = tmp_path / "restore.json"
    # A child process: the bench starts its own cluster_utils.Cluster, and this pytest
    # process may hold the session's Ray runtime already.
    done = subprocess.run(
        [sys.executable, "-m", "ray_checkfreq.cli", "bench", "restore", "--state-mb", "3", "--repeats", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["sources"]) == SOURCES
    for name, entry in figures["sources"].items():
        assert entry["identical"] is True, name
        assert len(entry["times_s"]) == 1 and entry["median_s"] > 0 and entry["min_s"] > 0, name
    assert figures["state_bytes"] >= 2 * restore_state.MiB
    assert figures["target"]["fastest_storage"] in SOURCES - {"own-node slot"}
    assert "target: own-node slot >= 5x faster than storage: " in done.stdout
    assert _leftover_slots() == before


def test_a_restore_that_copies_nothing_is_not_identical(tmp_path):
    reference = restore_state.reference_state(1)
    target = restore_state.Target(1)
    assert not target.equals(reference)  # scrambled
    slot = restore_state.write_slot(str(tmp_path / "slot"), reference)
    try:
        _, state = slot.read()
        target.load(state)
        del state
    finally:
        slot.close()
    assert target.equals(reference)
    target.optimizer.state[next(iter(target.model.parameters()))]["exp_avg"].view(-1)[0] += 1
    assert not target.equals(reference)


def test_mlp_state_has_about_the_asked_size():
    for state_mb in (1, 10, 100):
        width, layers = restore_state.mlp_shape(state_mb)
        nbytes = 12 * layers * (width * width + width)
        assert 0.8 < nbytes / (state_mb * restore_state.MiB) < 1.25, (state_mb, width, layers)



def _filesystem_type(path) -> str:
    with open("/proc/mounts") as table:
        mounts = [line.split()[1:3] for line in table]
    best = max((m for m in mounts if str(path).startswith(m[0])), key=lambda m: len(m[0]))
    return best[1]


def test_dropping_the_page_cache_leaves_no_page_resident(tmp_path):
    from benchmarks.restore import drop_page_cache, resident_fraction

    if _filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("on tmpfs the page cache is the storage: nothing can be dropped")
    (tmp_path / "shard.bin").write_bytes(os.urandom(4 << 20))
    (tmp_path / "manifest.json").write_bytes(b"{}")
    (tmp_path / "shard.bin").read_bytes()
    assert resident_fraction(str(tmp_path)) > 0.99
    drop_page_cache(str(tmp_path))
    assert resident_fraction(str(tmp_path)) < 0.01
