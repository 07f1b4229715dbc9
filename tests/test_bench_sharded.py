"""``ray-checkfreq bench sharded``: smoke runs (tiny FSDP2 state, one round) in a child process,
on spawned gloo ranks and (``--ray``) in one TorchTrainer run on its own 2-node cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import sharded_job
from benchmarks import sharded_ray_job as ray_job
from benchmarks.sharded import save_figures, targets

VARIANTS = {"baseline", "ours", "dcp async_save", "dcp save"}


def test_smoke_run_has_every_variant_figures_and_ours_committed(tmp_path):
    out = tmp_path / "sharded.json"
    done = subprocess.run(
        [sys.executable, "-m", "ray_checkfreq.cli", "bench", "sharded", "--state-mb", "1", "--width", "64",
         "--rounds", "1", "--iterations", "4", "--every", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=150,  # about 15 s on a quiet machine; loaded, 3x that
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    variants = figures["variants"]
    assert set(variants) == VARIANTS
    assert variants["ours"]["checkpoints"] == [2]  # iterations 2 and 4, both committed
    assert variants["dcp async_save"]["checkpoints"] == variants["dcp save"]["checkpoints"] == [2]
    assert variants["baseline"]["checkpoints"] == [0]
    for name in VARIANTS - {"baseline"}:
        entry = variants[name]
        assert entry["stall_s_per_checkpoint"]["slowest"] > 0, name
        assert entry["stall_s_per_checkpoint"]["slowest"] >= entry["stall_s_per_checkpoint"]["rank0"], name
        assert len(entry["peak_rss_bytes"]) == 2 and min(entry["peak_rss_bytes"]) > 0, name
        assert isinstance(entry["slowdown_s_per_checkpoint"], float), name
        assert entry["stall_s_first_checkpoint"]["slowest"] > 0 and entry["stall_s_later_checkpoints"]["slowest"] > 0
    restores = figures["restore"]
    assert len(restores) == 3
    for label, entry in restores.items():
        assert entry["iteration"] == [4] and entry["median_s"] > 0, label  # the newest checkpoint came back
    assert set(figures["targets"]) >= {"stall_met", "slowdown_met", "stall_below_async_x"}
    assert "target: stall at least 5x below async_save" in done.stdout
    assert "whole run:" in done.stdout


def test_ray_smoke_run_measures_both_ours_variants_and_every_restore_source(tmp_path):
    out = tmp_path / "sharded-ray.json"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-m", "ray_checkfreq.cli", "bench", "sharded", "--ray", "--state-mb", "1", "--width", "64",
         "--rounds", "1", "--iterations", "4", "--every", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env,  # about 30 s on a quiet machine
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    variants = figures["variants"]
    assert set(variants) == set(ray_job.VARIANTS)
    assert variants[ray_job.BASELINE]["checkpoints"] == [0]
    for name in (ray_job.PEER, ray_job.NO_PEER):
        entry = variants[name]
        assert entry["checkpoints"] == [2], name  # iterations 2 and 4, both committed
        assert entry["engine_stall_s_per_checkpoint"]["slowest"] > 0, name
        assert entry["loop_stall_s_per_checkpoint"]["slowest"] > 0, name
        assert isinstance(entry["slowdown_s_per_checkpoint"], float), name
        assert len(entry["peak_rss_bytes"]) == 2 and min(entry["peak_rss_bytes"]) > 0, name
        assert entry["peer_copies"]["failed"] == [0], name
    copies = variants[ray_job.PEER]["peer_copies"]
    # Counted once none travels: each of the 2 ranks' 2 snapshots sent, or skipped while one travelled.
    assert copies["sent"][0] > 0 and copies["sent"][0] + copies["skipped"][0] == 4, copies
    assert variants[ray_job.NO_PEER]["peer_copies"]["sent"] == [0]
    restore = figures["restore"]
    # One more checkpoint after the timed stretch (iteration 6), taken while no copy travelled:
    # every source holds it, and every rank loaded that iteration from each.
    assert restore["step"] == restore["expected_step"] == 6
    assert set(restore["kinds"]) == set(ray_job.RESTORE_KINDS)
    for kind, entry in restore["kinds"].items():
        assert entry["iterations"] == [6] and entry["median_s"] > 0, kind
    assert set(figures["targets"]) == {"peer_faster_than_storage_x", "peer_restore_met",
                                       "peer_faster_than_page_cache_x"}
    assert "target: restore from a peer copy at least 3x faster than from storage" in done.stdout
    assert "whole run:" in done.stdout


def _run(variant: str, rank: int, wall: float, stall: float, checkpoints: int,
         intervals: list[float] | None = None) -> dict:
    return {"round": 0, "variant": variant, "wall_s": wall, "stall_s": stall, "checkpoints": checkpoints,
            "engine_stall_s": stall, "off_checkpoint_step_s": [0.001],
            "interval_stall_s": intervals if intervals is not None else [stall / max(checkpoints, 1)] * checkpoints,
            "rss_at_start_bytes": 1, "peak_rss_bytes": 2}


def test_figures_take_the_slowest_rank_and_the_same_round_baseline():
    settings = sharded_job.Settings(ranks=2, rounds=1, iterations=6, every=2)
    per_rank = [[_run("baseline", 0, 1.0, 0, 0), _run("ours", 0, 1.2, 0.03, 3, [0.02, 0.004, 0.006]),
                 _run("dcp async_save", 0, 1.4, 0.15, 3), _run("dcp save", 0, 2.0, 0.6, 3)],
                [_run("baseline", 1, 1.1, 0, 0), _run("ours", 1, 1.5, 0.09, 3, [0.074, 0.008, 0.008]),
                 _run("dcp async_save", 1, 1.3, 0.15, 3), _run("dcp save", 1, 2.1, 0.75, 3)]]
    figures = save_figures(per_rank, settings)
    ours = figures["ours"]
    assert ours["stall_s_per_checkpoint"] == {"rank0": 0.01, "slowest": 0.03, "by_rank": [0.01, 0.03]}
    assert ours["stall_s_first_checkpoint"] == {"slowest": 0.074, "by_rank": [0.02, 0.074]}
    assert ours["stall_s_later_checkpoints"] == {"slowest": 0.008, "by_rank": [0.005, 0.008]}
    assert ours["slowdown_s_per_checkpoint"] == pytest.approx((1.5 - 1.1) / 3)
    assert figures["dcp save"]["slowdown_s_per_checkpoint"] == pytest.approx((2.1 - 1.1) / 3)
    aims = targets(figures)
    # Later checkpoints: 0.05 s against 0.008 s (met); every checkpoint: 0.05 against 0.03.
    assert aims["stall_below_async_x"] == pytest.approx(6.25) and aims["stall_met"]
    assert aims["stall_below_async_x_all_checkpoints"] == pytest.approx(0.05 / 0.03)


@pytest.mark.parametrize("field", [{"every": 0}, {"ranks": True}, {"ranks": 1}, {"state_mb": 0},
                                   {"every": 9, "iterations": 4}])
def test_settings_refuse_bad_values(field):
    with pytest.raises(ValueError, match="--"):
        sharded_job.Settings(**field)
