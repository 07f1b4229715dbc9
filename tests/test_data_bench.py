"""The iterator benchmark's pure parts: the before/after demo and the shuffle metrics."""

from __future__ import annotations

import argparse
import json

import numpy as np

from ray_checkfreq.bench import iterator as bench


def test_before_after_counts():
    counts = bench.before_after(num_samples=2000, batch_size=16, interrupt_at=0.5)
    assert counts["stock DataLoader, restart the epoch"]["repeated"] == 62 * 16
    assert counts["stock DistributedSampler, 4 -> 5 ranks, skip"]["missed"] > 0
    assert counts["stock DistributedSampler, 4 -> 3 ranks, skip"]["repeated"] > 0
    ours = {k: v for k, v in counts.items() if k.startswith("ours")}
    assert len(ours) == 3 and all(v == {"repeated": 0, "missed": 0} for v in ours.values())


def test_shuffle_quality_separates_sequential_from_uniform():
    n = 10_000
    seq = bench.shuffle_quality(np.arange(n), n, 100)
    uni = bench.shuffle_quality(np.random.default_rng(0).permutation(n), n, 100)
    assert seq["spearman"] == 1.0 and seq["displacement"] == 0.0 and seq["neighbours_same_batch"] > 0.98
    assert abs(uni["spearman"]) < 0.05 and abs(uni["displacement"] - 1 / 3) < 0.02
    assert uni["neighbours_same_batch"] < 0.03


def test_demo_only_run_prints_and_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "iter.json"
    assert bench.run(parser.parse_args(["--demo-only", "--json", str(out)])) == 0
    assert "ours, 4 -> 3 ranks" in capsys.readouterr().out
    assert json.loads(out.read_text())["before_after"]["ours, same world size"] == {"repeated": 0, "missed": 0}
